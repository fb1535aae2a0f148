"""The attention calls today's models make: sliding window, sinks, softcap, and Hugging Face's padded prefill mask,
against FlashAttention-4 and torch's default SDPA (with the equivalent boolean mask) in the same process.

    PYTHONPATH=. python bench/bench_variants.py [--quick] [--no-backward]

Rows follow issue 33's table (bf16, causal, BSHD tensors as FlashAttention takes them; cupy_attn reads the
(B, H, L, D) transposed views in place). Each row: ms (medians of CUDA events, ours and each peer alternating in
rounds on the same fresh random inputs, bench/common.interleaved_ms), TFLOP/s counted on the visible (query, key)
pairs only (4·B·H·visible·D, D the head dim), and ratios against FlashAttention-4 (when its wheel is importable:
../shared/tools/peer_wheels.sh) and torch's default. FlashAttention-4 is looked for in /tmp/site as the device
machine's wheel install puts it.
"""
from __future__ import annotations

import argparse
import os
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

from common import environment, fa4, interleaved_ms, print_table, save_json  # noqa: E402

# (name, B, Hq, Hkv, L, D, window (left, right) or None, sinks, softcap, head dim of V)
CASES = [
    ("window 1024", 4, 32, 8, 8192, 128, (1024, 0), False, None),
    ("window 1024 hd256", 2, 16, 8, 8192, 256, (1024, 0), False, None),
    ("window 128 + sinks", 1, 64, 8, 8192, 64, (128, 0), True, None),
    ("softcap 50 hd256", 2, 16, 8, 4096, 256, None, False, 50.0),
    ("window 1024 hd512", 1, 16, 8, 8192, 512, (1024, 0), False, None),
]
QUICK = ("window 1024", "window 128 + sinks")
COLUMNS = [("name", "case", ""), ("shape", "(B, Hq/Hkv, L, D)", ""), ("ms", "ms", ".3f"), ("tflops", "TFLOP/s", ".0f"),
           ("fa4_ms", "FA4 ms", ".3f"), ("x_fa4", "× FA4", ".2f"), ("torch_ms", "torch+mask ms", ".3f"),
           ("x_torch", "× torch", ".2f"), ("max_err", "max err", ".2e"), ("fa4_err", "FA4 err", ".2e")]


def visible_pairs(L: int, S: int, window) -> int:
    """(query, key) pairs a causal call with this window sees (bottom-right aligned; L = S here)."""
    from cupy_attn import reference
    if L * S <= 1 << 26:
        return int(reference.visible_keys(L, S, True, window).sum())
    left = window[0] if window else None
    if left is None:
        return L * (L + 1) // 2
    return sum(min(i, left) + 1 for i in range(L))


def _check(out, q, k, v, window, sinks, softcap, heads=1):
    """Max error of the first query head against the float64 reference (the last 1024 rows: a window row's keys)."""
    from cupy_attn import reference
    Hq, Hkv = q.shape[2], k.shape[2]
    rows = slice(q.shape[1] - 1024, q.shape[1])
    qh = q[0, rows, :heads].transpose(0, 1).double().cpu().numpy()
    kh = k[0, :, :1].transpose(0, 1).double().cpu().numpy()
    vh = v[0, :, :1].transpose(0, 1).double().cpu().numpy()
    L, S = q.shape[1], k.shape[1]
    # rows L-1024 ... L-1 of a causal call against all S keys: bottom-right alignment of a 1024-row block
    ref = reference.scaled_dot_product_attention(qh, kh, vh, is_causal="bottom_right", window_size=window,
                                                 sinks=None if sinks is None else sinks[:heads].double().cpu().numpy(),
                                                 softcap=softcap)
    got = out[0, rows, :heads].transpose(0, 1).double().cpu().numpy()
    return float(np.abs(got - ref).max())


def run_case(name, B, Hq, Hkv, L, D, window, with_sinks, softcap, flash=None):
    import torch
    import torch.nn.functional as F

    import cupy_attn
    dt = torch.bfloat16
    q = torch.randn(B, L, Hq, D, device="cuda", dtype=dt)
    k = torch.randn(B, L, Hkv, D, device="cuda", dtype=dt)
    v = torch.randn(B, L, Hkv, D, device="cuda", dtype=dt)
    sinks = torch.randn(Hq, device="cuda", dtype=torch.float32) if with_sinks else None
    qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))  # (B, H, L, D) views: read in place
    ours = lambda: cupy_attn.scaled_dot_product_attention(  # noqa: E731
        qt, kt, vt, is_causal=True, enable_gqa=True, window_size=window, sinks=sinks, softcap=softcap)
    fns = {"ours": ours}
    if flash is not None:
        peer = lambda: flash(q, k, v, causal=True, window_size=window or (None, None),  # noqa: E731
                             learnable_sink=sinks, softcap=softcap or 0.0)
        try:
            peer()
            fns["fa4"] = peer
        except Exception as exc:  # e.g. head dims above 256: the row keeps ours without FA4
            print(f"{name}: FlashAttention-4 cannot run it: {type(exc).__name__}: {str(exc)[:200]}", flush=True)
    keep = None
    if softcap is None and not with_sinks and L * L <= 1 << 27:
        from cupy_attn import reference
        keep = torch.from_numpy(reference.visible_keys(L, L, True, window)).cuda()
        fns["torch"] = lambda: F.scaled_dot_product_attention(qt, kt, vt, attn_mask=keep, enable_gqa=True)  # noqa
    outs = {n: fn() for n, fn in fns.items()}
    times = dict(zip(fns, interleaved_ms(list(fns.values()), rounds=5, repeat=10)))
    pairs = B * Hq * visible_pairs(L, L, window)
    row = {"name": name, "shape": f"({B}, {Hq}/{Hkv}, {L}, {D})", "ms": times["ours"],
           "tflops": 4.0 * pairs * D / times["ours"] / 1e9,
           "max_err": _check(outs["ours"].transpose(1, 2), q, k, v, window, sinks, softcap)}
    if "fa4" in times:
        fo = outs["fa4"][0] if isinstance(outs["fa4"], tuple) else outs["fa4"]
        row.update(fa4_ms=times["fa4"], x_fa4=times["fa4"] / times["ours"],
                   fa4_err=_check(fo, q, k, v, window, sinks, softcap))
    if "torch" in times:
        row.update(torch_ms=times["torch"], x_torch=times["torch"] / times["ours"])
    del q, k, v, outs
    torch.cuda.empty_cache()
    return row


def run_backward(flash=None):
    """Forward + backward with window 1024 at (4, 32/8, 8192, 128) bf16, against FlashAttention-4 (issue 33: 4.21 ms)."""
    import torch

    import cupy_attn
    B, Hq, Hkv, L, D, window = 4, 32, 8, 8192, 128, (1024, 0)
    dt = torch.bfloat16
    q = torch.randn(B, L, Hq, D, device="cuda", dtype=dt, requires_grad=True)
    k = torch.randn(B, L, Hkv, D, device="cuda", dtype=dt, requires_grad=True)
    v = torch.randn(B, L, Hkv, D, device="cuda", dtype=dt, requires_grad=True)
    dout = torch.randn(B, L, Hq, D, device="cuda", dtype=dt)

    def ours():
        out = cupy_attn.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                     is_causal=True, enable_gqa=True, window_size=window)
        torch.autograd.grad(out, (q, k, v), dout.transpose(1, 2))
    fns = {"ours": ours}
    if flash is not None:
        def peer():
            out = flash(q, k, v, causal=True, window_size=window)
            out = out[0] if isinstance(out, tuple) else out
            torch.autograd.grad(out, (q, k, v), dout)
        fns["fa4"] = peer
    for fn in fns.values():
        fn()
    times = dict(zip(fns, interleaved_ms(list(fns.values()), rounds=5, repeat=5)))
    pairs = B * Hq * visible_pairs(L, L, window)
    row = {"name": "fwd+bwd window 1024", "shape": f"({B}, {Hq}/{Hkv}, {L}, {D})", "ms": times["ours"],
           "tflops": 2.5 * 4.0 * pairs * D / times["ours"] / 1e9}
    if "fa4" in times:
        row.update(fa4_ms=times["fa4"], x_fa4=times["fa4"] / times["ours"])
    return row


def run_padded_prefill():
    """Hugging Face's padded prefill: a 4-D bool mask (causal and left padding of 0-1500 tokens), (8, 32/8, 2048, 128)
    fp16, against torch's default SDPA with the same mask and against our causal call without a mask (issue 33:
    torch 1.715 ms, ours 3.266 ms before the mask ran in the FA3-design kernel; unmasked causal 0.509 ms)."""
    import torch
    import torch.nn.functional as F

    import cupy_attn
    B, Hq, Hkv, L, D = 8, 32, 8, 2048, 128
    q = torch.randn(B, Hq, L, D, device="cuda", dtype=torch.float16)
    k = torch.randn(B, Hkv, L, D, device="cuda", dtype=torch.float16)
    v = torch.randn(B, Hkv, L, D, device="cuda", dtype=torch.float16)
    pads = torch.tensor([0, 0, 100, 300, 700, 900, 1200, 1500], device="cuda")
    i, j = torch.arange(L, device="cuda")[:, None], torch.arange(L, device="cuda")[None, :]
    mask = ((j <= i)[None] & (j[None] >= pads[:, None, None]))[:, None]  # (B, 1, L, L)
    fns = {"ours": lambda: cupy_attn.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True),
           "torch": lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True),
           "causal": lambda: cupy_attn.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)}
    outs = {n: fn() for n, fn in fns.items()}
    times = dict(zip(fns, interleaved_ms(list(fns.values()), rounds=5, repeat=10)))
    pairs = int(mask.sum().item()) * Hq
    live = (i >= pads[:, None, None]).expand(B, L, L)[:, :, 0]  # rows with keys (torch gives NaN in the others)
    err = (outs["ours"].float() - outs["torch"].float()).abs().transpose(1, 2)[live].max().item()
    print(f"padded prefill: causal without a mask {times['causal']:.3f} ms", flush=True)
    return {"name": "HF padded prefill (bool mask)", "shape": f"({B}, {Hq}/{Hkv}, {L}, {D})", "ms": times["ours"],
            "tflops": 4.0 * pairs * D / times["ours"] / 1e9, "torch_ms": times["torch"],
            "x_torch": times["torch"] / times["ours"], "max_err": err}


def benchmark(quick: bool = False, backward: bool = True) -> list[dict]:
    flash = fa4()
    rows = []
    for case in CASES:
        if quick and case[0] not in QUICK:
            continue
        try:
            rows.append(run_case(*case, flash=flash))
        except Exception as exc:  # one failing row must not hide the others
            print(f"{case[0]}: {type(exc).__name__}: {exc}", flush=True)
    try:
        rows.append(run_padded_prefill())
    except Exception as exc:
        print(f"padded prefill: {type(exc).__name__}: {exc}", flush=True)
    if backward and not quick:
        try:
            rows.append(run_backward(flash))
        except Exception as exc:
            print(f"fwd+bwd: {type(exc).__name__}: {exc}", flush=True)
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--no-backward", action="store_true")
    args = ap.parse_args(argv)
    rows = benchmark(args.quick, not args.no_backward)
    print_table(rows, COLUMNS, title=f"variants ({environment()})")
    save_json("variants.json", {"env": environment(), "rows": rows})


if __name__ == "__main__":
    main()
