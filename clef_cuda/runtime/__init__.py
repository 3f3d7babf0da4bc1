"""Process and device plumbing the rooms above share: what a CUDA error means (cuda_errors.py) and the child
processes' supervisor (children.py: kernel trials, tensor-parallel workers)."""
