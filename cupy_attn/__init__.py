"""cupy_attn: attention and fused kernels compiled at run time by CuPy (NVRTC). No PyTorch build step."""
__version__ = "0.1.0"
