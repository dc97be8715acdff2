"""Torch execution of plans: generated straight-line code, autograd, CUDA graphs."""
