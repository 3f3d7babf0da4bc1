"""Choosing the kernels a device runs: the tunes of each op with more than one implementation, timed per bucket of
call shape (tunes.py), the kernel trials that run every never-run kernel in a child process first (trials.py), and
the entry point that caches, installs and reports the choices (autotune.py)."""
