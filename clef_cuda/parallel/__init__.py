"""Spreading a trunk over the cards of one machine: tensor parallel's worker ranks, in lock-step
(tensor_parallel.py)."""
