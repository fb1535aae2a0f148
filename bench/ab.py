"""Same-process A/B of this checkout against an earlier revision of cupy_attn, on the plain benchmark rows.

    python bench/ab.py --export REV [--dest .ab]          # here (needs git): the revision as package cupy_attn_base
    PYTHONPATH=. python bench/ab.py --base .ab/REV [--rows fwd,bwd,decode] [--rounds 7] [--only d512]   # on the GPU

The export copies the revision's cupy_attn/ and cuda_src/ to DEST/REV/cupy_attn_base and DEST/REV/cuda_src, renaming
the package's absolute self-references (``cupy_attn.`` module paths; the kernels' C++ namespace ``cupy_attn::`` is
left alone), so both versions import side by side in one process and share the GPU's clock, the compile cache and
the inputs. Every row times the two versions' public calls on the same fresh random tensors in rotated rounds
(bench/common.rotated_ms) and prints ms and the ratio new / base; a row slower by more than 1% is flagged. This is the
check behind "no plain row slows by more than 1%" and "a kernel whose code changed shows an A/B within 1%".
"""
from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)
sys.path.insert(0, HERE)

# (name, B, Hq, Hkv, L, S, D, causal, dtype): the forward rows of bench/RESULTS.md that exercise each path.
FWD_ROWS = [
    ("seed split", 32, 32, 32, 512, 512, 1024, False, "float16"),
    ("seed split bf16", 32, 32, 32, 512, 512, 1024, False, "bfloat16"),
    ("seed causal", 32, 32, 32, 512, 512, 1024, True, "float16"),
    ("seed fp32", 8, 32, 32, 512, 512, 1024, False, "float32"),
    ("S=300 pv kernel", 16, 32, 32, 512, 300, 1024, False, "float16"),
    ("d512 fused", 2, 8, 8, 4096, 4096, 512, False, "bfloat16"),
    ("d512 fused causal", 2, 8, 8, 4096, 4096, 512, True, "bfloat16"),
    ("fa3 d64", 4, 32, 32, 4096, 4096, 64, False, "float16"),
    ("fa3 d80", 4, 32, 32, 2048, 2048, 80, False, "float16"),
    ("fa3 d96", 4, 32, 32, 2048, 2048, 96, False, "float16"),
    ("fa3 d128", 8, 16, 16, 2048, 2048, 128, False, "float16"),
    ("fa3 d128 bf16", 8, 16, 16, 2048, 2048, 128, False, "bfloat16"),
    ("fa3 d128 causal", 2, 16, 16, 8192, 8192, 128, True, "float16"),
    ("fa3 d128 gqa causal", 4, 32, 8, 8192, 8192, 128, True, "bfloat16"),
    ("fa3 d256", 8, 16, 16, 1024, 1024, 256, False, "float16"),
    ("fa3 d256 causal", 2, 16, 8, 8192, 8192, 256, True, "bfloat16"),
    ("wgmma small d128", 1, 8, 8, 256, 256, 128, False, "float16"),
    ("mma d32", 4, 32, 32, 2048, 2048, 32, False, "float16"),
    ("keypad d128", 8, 16, 16, 2048, 2048, 128, "keypad", "float16"),
]
DECODE_ROWS = [
    ("decode", 64, 32, 32, 1, 4096, 128, "bottom_right", "float16"),
    ("decode gqa", 8, 32, 8, 1, 32768, 128, "bottom_right", "bfloat16"),
    ("decode gqa L=4", 16, 64, 8, 4, 8192, 128, "bottom_right", "float16"),
]
BWD_ROWS = [
    ("bwd d128", 8, 16, 16, 2048, 2048, 128, False, "float16"),
    ("bwd d64", 4, 32, 32, 4096, 4096, 64, False, "float16"),
    ("bwd d128 causal", 2, 16, 16, 8192, 8192, 128, True, "bfloat16"),
    ("bwd d256", 8, 16, 16, 1024, 1024, 256, False, "float16"),
    ("bwd seed", 8, 32, 32, 512, 512, 1024, False, "float16"),
]


def export(rev: str, dest: str) -> str:
    """cupy_attn/ and cuda_src/ of ``rev`` into dest/rev as the package cupy_attn_base; returns that folder."""
    out = os.path.join(dest, rev)
    shutil.rmtree(out, ignore_errors=True)
    os.makedirs(out)
    archive = subprocess.run(["git", "-C", ROOT, "archive", rev, "cupy_attn", "cuda_src"], check=True,
                             capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", out], input=archive, check=True)
    os.rename(os.path.join(out, "cupy_attn"), os.path.join(out, "cupy_attn_base"))
    pattern = re.compile(r"\bcupy_attn(?=\.[A-Za-z_])")
    for folder, _, files in os.walk(os.path.join(out, "cupy_attn_base")):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                text = open(path).read()
                new = pattern.sub("cupy_attn_base", text).replace("import cupy_attn\n", "import cupy_attn_base\n")
                if new != text:
                    open(path, "w").write(new)
    return out


def _inputs(B, Hq, Hkv, L, S, D, causal, dtype, grad=False):
    import torch
    dt = getattr(torch, dtype)
    q = torch.randn(B, Hq, L, D, device="cuda", dtype=dt, requires_grad=grad)
    k = torch.randn(B, Hkv, S, D, device="cuda", dtype=dt, requires_grad=grad)
    v = torch.randn(B, Hkv, S, D, device="cuda", dtype=dt, requires_grad=grad)
    kw = {"enable_gqa": Hq != Hkv}
    if causal == "keypad":
        kw["attn_mask"] = torch.rand(B, 1, 1, S, device="cuda") > 0.1
    else:
        kw["is_causal"] = causal
    return q, k, v, kw


def run(base_dir: str, which: list[str], rounds: int, only: str = "") -> int:
    import torch

    import cupy_attn
    from common import rotated_ms
    sys.path.insert(0, os.path.abspath(base_dir))
    import cupy_attn_base

    rows = [("fwd", r) for r in FWD_ROWS] * ("fwd" in which) + [("decode", r) for r in DECODE_ROWS] * (
        "decode" in which) + [("bwd", r) for r in BWD_ROWS] * ("bwd" in which)
    rows = [r for r in rows if only in r[1][0]]
    print(f"{'row':24s} {'dtype':9s} {'new ms':>9s} {'base ms':>9s} {'new/base':>9s}", flush=True)
    slow = 0
    for kind, (name, B, Hq, Hkv, L, S, D, causal, dtype) in rows:
        q, k, v, kw = _inputs(B, Hq, Hkv, L, S, D, causal, dtype, grad=kind == "bwd")
        fns = {}
        for label, lib in (("new", cupy_attn), ("base", cupy_attn_base)):
            if kind == "bwd":
                dout = torch.randn_like(q)

                def fn(lib=lib, dout=dout):
                    out = lib.scaled_dot_product_attention(q, k, v, **kw)
                    torch.autograd.grad(out, (q, k, v), dout)
            else:
                def fn(lib=lib):
                    lib.scaled_dot_product_attention(q, k, v, **kw)
            fn()
            fns[label] = fn
        with torch.no_grad() if kind != "bwd" else torch.enable_grad():
            ms = rotated_ms(fns, rounds=rounds)
        ratio = ms["new"] / ms["base"]
        flag = "  SLOWER" if ratio > 1.01 else ""
        slow += ratio > 1.01
        print(f"{name:24s} {dtype:9s} {ms['new']:9.3f} {ms['base']:9.3f} {ratio:9.3f}{flag}", flush=True)
        del q, k, v, fns
        torch.cuda.empty_cache()
    print(f"{slow} of {len(rows)} rows slower than the base by more than 1%")
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--export", metavar="REV", help="write the revision as package cupy_attn_base under --dest")
    ap.add_argument("--dest", default=os.path.join(ROOT, ".ab"))
    ap.add_argument("--base", help="folder holding cupy_attn_base (an --export result)")
    ap.add_argument("--rows", default="fwd,decode,bwd")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--only", default="", help="keep the rows whose name contains this text")
    args = ap.parse_args(argv)
    if args.export:
        print(export(args.export, args.dest))
        return 0
    if not args.base:
        ap.error("--base or --export is required")
    return run(args.base, args.rows.split(","), args.rounds, args.only)


if __name__ == "__main__":
    sys.exit(main())
