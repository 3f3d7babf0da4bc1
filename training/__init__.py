"""Building clef-tiny: the vocabulary-disjoint decision task (vocabulary.py), the trainable model (model.py),
its training script (train.py) and its evaluation through the server (evaluate.py)."""
