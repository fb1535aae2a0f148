"""Decode calls whose key length changes every step, replayed without the checks and the plan.

A generation loop over a growing KV cache (Hugging Face's dynamic cache: K and V concatenated one row longer each
step) calls scaled_dot_product_attention with q (B, Hq, L, E) and contiguous k, v (B, Hkv, S, E | Ev), S one larger
each time. Every call has new sizes, so the call cache (runtime/callcache.py, keyed by the exact layout) misses, and
each call paid the checks, the plan and a new launch: 0.6-3 ms of host time (issue 34).

Here such calls have a *family* key: the exact key with S, and the key and value strides that follow from it,
left out (the key and value must be contiguous). The first decode call of a family leaves a template: a launch of
its own (flash_decode, the v1 kernel) for that split count and tile. A later call of the family computes the split
plan for its S (flash_decode.choose, as the plan would), and where a template of that split count and tile exists,
writes the S-dependent words of its struct (seqlen_k, split_keys, the key and value batch and head strides) and
launches it: the same bytes a new launch for that S would carry (tests/test_decode_loop_cpu.py compares them).

What a family key fixes, every decode decision depends on: the query's layout, B, Hq, Hkv, L, E, Ev, dtypes,
device and stream, the flags, the environment overrides; S is checked against the decode rule (prefer_decode: S ≥
256 unless num_splits is given) on each call. Calls with a mask, dropout, a generator or any variant never take
this path.
"""
from __future__ import annotations

import threading
import types

from ..runtime import callcache
from . import checks
from .kernels import flash_decode

# (family key, tile, split count) -> _Template; family key -> (arch, SMs) of its device. Bounded like the call cache.
_TEMPLATES: dict = {}
_DEVICES: dict = {}
MAX_TEMPLATES = 64


class _Template:
    """A decode launch kept for retargeting: ``run`` (bound to the family's stream), its PreparedLaunch, the output
    shapes, and a lock that makes a retarget and its launch one step for concurrent threads."""

    __slots__ = ("run", "launch", "out_shape", "lse_shape", "causal", "lock")

    def __init__(self, run, launch, out_shape, lse_shape, causal):
        self.run, self.launch, self.out_shape, self.lse_shape, self.causal = run, launch, out_shape, lse_shape, causal
        self.lock = threading.Lock()


def family_key(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, backend, return_lse, allow_tf32,
               workspace_bytes, num_splits, variants, generator) -> tuple | None:
    """The family key of a torch call that may run the decode kernel with a growing S, or None: torch CUDA tensors,
    contiguous key and value (and mask, whose last axis is S: Hugging Face's (B, 1, L, S) padding mask), no dropout,
    generator or variant, backend "auto"."""
    if generator is not None or backend != "auto" or any(x is not None for x in variants):
        return None
    if type(dropout_p) not in (float, int) or dropout_p != 0:
        return None
    sig = callcache.signatures((query, key, value, attn_mask))
    if sig is None or sig[0] != "torch" or len(query.shape) != 4 or len(key.shape) != 4 or len(value.shape) != 4:
        return None
    if not (key.is_contiguous() and value.is_contiguous()) or key.shape[2] != value.shape[2]:
        return None  # (a key and value of different lengths: the checks raise it)
    qs, ks, vs, ms = sig[1]
    drop_s = (lambda s: (s[0][:2] + s[0][3:],) + s[2:])  # noqa: E731  (shape without S; dtype, device, address mod 16)
    if attn_mask is not None:
        if not attn_mask.is_contiguous() or attn_mask.dim() == 0 or attn_mask.shape[-1] != key.shape[2]:
            return None  # its strides must follow from its shape, S its last axis
        ms = (ms[0][:-1],) + ms[2:]
    return ("decode-family", qs, drop_s(ks), drop_s(vs), ms, sig[2], type(is_causal), is_causal, type(scale), scale,
            type(enable_gqa), enable_gqa, type(return_lse), return_lse, type(allow_tf32), allow_tf32,
            type(workspace_bytes), workspace_bytes, type(num_splits), num_splits, callcache.env_values())


def _problem(query, key, value):
    B, Hq, L, E = (int(n) for n in query.shape)
    Hkv, S, Ev = int(key.shape[1]), int(key.shape[2]), int(value.shape[3])
    return types.SimpleNamespace(batch=B, num_heads=Hq, num_kv_heads=Hkv, seqlen_q=L, seqlen_k=S, head_dim=E,
                                 head_dim_v=Ev, groups=Hq // Hkv if Hkv else 0, key=None, value=None)


def remember(fkey, plan, out4, lse3, arch: int, num_sms: int) -> None:
    """After a decode plan ran a family's call: keep a launch of its own for that split count and tile (the call
    cache's entry, if any, keeps its own launch, whose struct this one must not share)."""
    choice = plan.choice
    if choice.family is not flash_decode.FLASH_DECODE or plan.problem is None:
        return
    tkey = (fkey, choice.tile, choice.num_splits)
    if tkey in _TEMPLATES:
        return
    launch = flash_decode.build(plan.problem, choice, out4, lse3)
    if len(_TEMPLATES) >= MAX_TEMPLATES:
        _TEMPLATES.clear()
        _DEVICES.clear()
    _DEVICES[fkey] = (arch, num_sms, plan.problem.ctx.device_id)
    _TEMPLATES[tkey] = _Template(launch.bind(plan.problem.ctx.stream), launch, tuple(out4.shape),
                                 None if lse3 is None else tuple(lse3.shape), plan.problem.causal)


def _current_device() -> int:
    from cupy.cuda import runtime
    return runtime.getDevice()


def fields(p, choice, mask_strides=None, causal=None) -> dict:
    """The struct words of a decode launch that follow from S for contiguous key and value: seqlen_k, split_keys, the
    causal offset (S − L bottom-right, 0 top-left: checks.causal_offset) and the key and value batch and head strides
    (in elements); with a mask, its strides (elements) as broadcast to (B, Hq, L, S) (0 on broadcast axes: the
    checks' view). num_splits and the tile are the template's."""
    S, Hkv = p.seqlen_k, p.num_kv_heads
    out = {"seqlen_k": S, "split_keys": choice.split_keys, "causal_offset": checks.causal_offset(causal, p.seqlen_q, S),
           "k_stride_b": Hkv * S * p.head_dim, "k_stride_h": S * p.head_dim,
           "v_stride_b": Hkv * S * p.head_dim_v, "v_stride_h": S * p.head_dim_v}
    if mask_strides is not None:
        out.update(zip(("mask_stride_b", "mask_stride_h", "mask_stride_l", "mask_stride_s"), mask_strides))
    return out


def replay(fkey, query, key, value, attn_mask, return_lse: bool, num_splits):
    """Run a family's call on its template for this S, or None when none fits (the caller takes the full path)."""
    device = _DEVICES.get(fkey)
    if device is None or _current_device() != device[2]:
        return None  # no template yet, or another device is current (its launch would go to that one's context)
    p = _problem(query, key, value)
    if p.seqlen_k == 0 or (num_splits is None and not flash_decode.prefer_decode(p.seqlen_q, p.seqlen_k, p.groups)[0]):
        return None  # S = 0 is the empty call's (the full path's); short S are not the decode plan's
    choice = flash_decode.choose(p, device[0], device[1], num_splits)
    t = _TEMPLATES.get((fkey, choice.tile, choice.num_splits))
    if t is None:
        return None
    import torch
    out = query.new_empty(query.shape[:-1] + (p.head_dim_v,))
    lse = query.new_empty(query.shape[:-1], dtype=torch.float32) if t.lse_shape is not None else None
    mask_strides = None if attn_mask is None else attn_mask.expand(p.batch, p.num_heads, p.seqlen_q,
                                                                      p.seqlen_k).stride()
    with t.lock:
        t.launch.write_fields(fields(p, choice, mask_strides, t.causal))
        t.run(query.data_ptr(), key.data_ptr(), value.data_ptr(), out.data_ptr(), 0 if lse is None else lse.data_ptr(),
              0 if attn_mask is None else attn_mask.data_ptr())
    return (out, lse) if return_lse else out
