"""cupy_attn: attention and fused kernels compiled at run time by CuPy (NVRTC). No PyTorch build step.

Public API:
    scaled_dot_product_attention  torch.nn.functional.scaled_dot_product_attention's semantics, fused or split path
    varlen_attention              packed batches of sequences of different lengths (FlashAttention's varlen API)
    explain                       which path a call takes, and why
    explain_varlen                the same for varlen_attention
    attention_with_kvcache        decode against a KV cache, dense or paged (FlashAttention's flash_attn_with_kvcache)
    merge_attention_states        two partial attention results (out, lse) over disjoint keys merged into one
    AttentionMod                  score_mod / mask_mod as CUDA C++ snippets (FlexAttention's idea, compiled by NVRTC)
    create_block_mask             a mask_mod's visible key range per block of query rows, for the kernels to skip
    linear_batchnorm_softmax      softmax(scale · BatchNorm1d(x Wᵀ + b), dim=1) as one operation
    release_memory                gives back the device memory kept between calls (bounded per-stream workspaces)
    cupy_attn.reference           float64 NumPy references (the ground truth of the tests)
    cupy_attn.philox              Philox4x32-10 and attention dropout's keep mask in NumPy (what the kernels draw)
    cupy_attn.torch               nn.Module wrappers (imported on demand: it needs torch)
    cupy_attn.torch_ops           torch.library custom ops the entry points use under torch.compile (needs torch)
    cupy_attn.distributed         ring attention over torch.distributed: context parallelism (needs torch)
    cupy_attn.integrations        transformers.register(): attn_implementation="cupy_attn" for Hugging Face models
"""
from __future__ import annotations

from . import philox, reference
from .attention import (AttentionMod, BlockMask, attention_with_kvcache, create_block_mask, explain, explain_varlen,
                        merge_attention_states, scaled_dot_product_attention, varlen_attention)
from .linear_bn_softmax import linear_batchnorm_softmax
from .runtime.workspace import release_memory

__version__ = "0.1.0"
__all__ = ["scaled_dot_product_attention", "varlen_attention", "explain", "explain_varlen", "merge_attention_states",
           "AttentionMod", "BlockMask", "create_block_mask", "attention_with_kvcache", "linear_batchnorm_softmax",
           "release_memory", "reference", "philox", "__version__"]
