"""Proving kernels and answers: the on-device self-check (selfcheck.py), shadow verification of answered records
on the reference ops (shadow.py), and the op library that never runs a kernel that failed on this device
(guarded_ops.py)."""
