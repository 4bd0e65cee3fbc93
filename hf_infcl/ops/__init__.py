"""Numerics of the loss, with no Hugging Face imports: the reference, the tiled PyTorch block
ops, the fused Triton block ops, and the autograd Functions that drive them (one per algorithm:
single process and ring)."""
