"""Building clef-tiny: the synthetic decision dataset (synthetic.py) and its training script (train.py)."""
