"""Hugging Face transformers: cupy_attn's scaled_dot_product_attention as ``attn_implementation="cupy_attn"``.

    import cupy_attn.integrations.transformers as cupy_attn_hf
    cupy_attn_hf.register()
    model = AutoModelForCausalLM.from_pretrained(name, attn_implementation="cupy_attn", torch_dtype=torch.float16)

Works with models whose attention goes through transformers' ``AttentionInterface`` (Llama, Mistral, Qwen2, Gemma,
BERT and most models written since transformers 4.48), in eager mode and under ``torch.compile(fullgraph=True)``
(the attention is then one custom-op node, see cupy_attn.torch_ops). Needs transformers >= 4.51 (the release that
exports AttentionInterface); from 4.53 the mask function is registered too (``AttentionMaskInterface``), so models
build the same boolean 4-D masks (or none, when ``is_causal`` suffices) as for "sdpa". Tested with 5.23.0.
"""
from __future__ import annotations

import warnings

import torch

from ..attention.sdpa import scaled_dot_product_attention

__all__ = ["register", "attention_forward", "NAME"]

NAME = "cupy_attn"


def attention_forward(module, query, key, value, attention_mask, dropout: float = 0.0, scaling: float | None = None,
                      is_causal: bool | None = None, **kwargs):
    """transformers' attention-function contract, computed by :func:`cupy_attn.scaled_dot_product_attention`.

    query (B, Hq, L, D), key (B, Hkv, S, D), value (B, Hkv, S, Dv) torch tensors (CUDA: our kernels; CPU: the float64
    reference, for checking). Hkv < Hq (grouped-query attention) reads the shared K/V heads in place (enable_gqa),
    with or without a mask: no ``repeat_kv`` copy. attention_mask: None or a 4-D mask broadcastable to (B, Hq, L, S),
    bool (True = attend, what the "sdpa" mask function builds) or float (added to the scores, the "eager" one).
    is_causal: the call's flag, else ``module.is_causal`` (default True); it applies only without a mask and for L > 1,
    as in transformers' sdpa_attention_forward; causal alignment is top-left, torch's (a prefill of L queries against
    a longer static cache masks the unused slots, which sdpa crops instead: the same result). scaling: default
    1/sqrt(D).

    Training: on CUDA tensors autograd records cupy_attn's own backward (cupy_attn.scaled_dot_product_attention's),
    attention dropout included (``dropout``, drawn from torch's default generator as torch's SDPA does). CPU tensors
    requiring grad run torch's scaled_dot_product_attention instead (gradients are never silently lost).

    The variants transformers' models pass (Gemma 2/3, Mistral, gpt-oss) run in the kernels, not through masks:
    ``sliding_window`` W (a query sees itself and the W − 1 keys before it, and, without a causal mask, as many after:
    window_size=(W − 1, W − 1), transformers' flash-attention convention), ``softcap`` (Gemma 2's
    attn_logit_softcapping) and ``s_aux`` (gpt-oss's per-head sink logits, differentiable).

    Returns (attn_output (B, L, Hq, Dv) contiguous, None): no attention weights are ever materialized.
    Raises: NotImplementedError for a position_bias and for transformers' paged cache; ValueError for shapes the
    kernels refuse (with the argument and axis named).
    """
    sliding_window = kwargs.get("sliding_window")
    window_size = None if not sliding_window else (int(sliding_window) - 1, int(sliding_window) - 1)
    softcap = kwargs.get("softcap")
    sinks = kwargs.get("s_aux")
    if kwargs.get("position_bias") is not None:
        raise NotImplementedError("attn_implementation='cupy_attn' does not support position_bias yet (use 'sdpa')")
    if kwargs.get("cache") is not None:
        raise NotImplementedError("attn_implementation='cupy_attn' does not support transformers' paged cache")
    if kwargs.get("output_attentions", False):
        warnings.warn("attn_implementation='cupy_attn' does not return attention weights (output_attentions)",
                      stacklevel=2)
    q_length = query.shape[2]
    if is_causal is None:
        is_causal = getattr(module, "is_causal", True)
    # Only L > 1 and no mask: a single query sees every key, and a given mask already holds the causal pattern.
    # q_length first: under dynamic-shape tracing, `and` on a SymBool must not become the result (sdpa's note).
    is_causal = q_length > 1 and attention_mask is None and bool(is_causal)
    enable_gqa = query.shape[1] != key.shape[1]
    plain = window_size is None and softcap is None and sinks is None
    if torch.is_grad_enabled() and (query.requires_grad or key.requires_grad or value.requires_grad) and (
            not query.is_cuda) and plain:
        # CPU training keeps torch's SDPA (its gradients are what a CPU user expects, at torch's speed).
        out = torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask,
                                                               dropout_p=dropout, is_causal=is_causal,
                                                               scale=scaling, enable_gqa=enable_gqa)
        return out.transpose(1, 2).contiguous(), None
    out = scaled_dot_product_attention(query, key, value, attn_mask=attention_mask, dropout_p=float(dropout),
                                       is_causal=is_causal, scale=scaling, enable_gqa=enable_gqa,
                                       window_size=window_size, softcap=softcap, sinks=sinks)
    return out.transpose(1, 2).contiguous(), None


def register(name: str = NAME) -> None:
    """Register :func:`attention_forward` as ``attn_implementation=name`` (default "cupy_attn") for all models.

    Registers with ``transformers.AttentionInterface``, and, where transformers has ``AttentionMaskInterface``, maps
    ``name`` to the "sdpa" mask function (boolean 4-D masks, None when ``is_causal`` suffices). Without it (older
    versions, 4.51-4.52) models build their default masks, 4-D float or bool, which attention_forward also takes.
    Idempotent.

    Raises ImportError when transformers is not installed or has no AttentionInterface (< 4.51).
    """
    try:
        from transformers import AttentionInterface
    except ImportError as e:
        raise ImportError("cupy_attn.integrations.transformers.register() needs transformers >= 4.51 "
                          "(pip install 'transformers>=4.53')") from e
    AttentionInterface.register(name, attention_forward)
    try:
        from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
    except ImportError:
        return
    AttentionMaskInterface.register(name, ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])
