"""Attention: sdpa (public entry points), checks, dispatch (the plan), fused (FlashAttention kernel launcher),
split (cuBLAS + softmax kernel), wgmma_gen (Hopper MMA wrappers generator)."""
from .sdpa import explain, scaled_dot_product_attention

__all__ = ["scaled_dot_product_attention", "explain"]
