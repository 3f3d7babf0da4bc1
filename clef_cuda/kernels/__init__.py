"""The kernel layer: the ops of clef_cuda._C (ops.py: typed wrappers, CUDA or CPU by the tensors' device), their
pure-torch references (reference.py: the same signatures, fp32 inside), torch's SDPA backends as attention
candidates (sdpa.py), the extension's loader (extension.py) and what the CPU offers (cpu_features.py). It imports
nothing of clef_cuda above it."""
