"""Render bench/RESULTS.md and the README's results block from the JSON files a GPU run of bench/main.py wrote.

    python bench/update_results.py DIR [NOTE]   # DIR holds main.json (as written under $OUT on the device); NOTE is
                                                # a line placed under the header (run-to-run spread, caveats)
"""
from __future__ import annotations

import json
import os
import re
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)

from common import GEMM_CEILING_TFLOPS, fmt  # noqa: E402


def table(rows: list[dict], columns: list) -> str:
    lines = [f"| {' | '.join(c[1] for c in columns)} |", "|" + "---|" * len(columns)]
    for r in rows:
        lines.append("| " + " | ".join(fmt(r.get(k), s) if s else str(r.get(k, "")) for k, _, s in columns) + " |")
    return "\n".join(lines)


# The README's tables: a few of each section's columns, under words a reader without the benchmark code can follow
# (defined in README_WORDS). The numbers and their formats are the section's own; RESULTS.md keeps every column.
README_COLUMNS = {
    "bench_sdpa": [("name", "case"), ("dtype", "dtype"), ("backend", "path"), ("ms", "ms"), ("tflops", "TFLOP/s"),
                   ("torch_default_ms", "torch ms"), ("speedup_default", "× torch"), ("torch_best", "torch best"),
                   ("speedup_best", "× best"), ("max_err", "max err"), ("torch_err", "torch err")],
    "bench_linear_bn_softmax": [("name", "case"), ("dtype", "dtype"), ("mode", "mode"), ("ms", "ms"),
                                ("torch_ms", "torch ms"), ("speedup", "× torch"), ("gemm_ms", "GEMM alone ms"),
                                ("tflops", "TFLOP/s"), ("max_err", "max err"), ("torch_err", "torch err"),
                                ("host_us", "host µs"), ("torch_host_us", "torch host µs")],
}
README_WORDS = {
    "bench_sdpa": (
        "Words: *case*: the shape above, or the one change made to it (×4 batch: batch 128; causal: `is_causal=True`; "
        "key-padding mask: a bool (batch, 1, 1, seqlen) mask with 10% of keys masked out; fp32 TF32 opt-in: ours with "
        "`allow_tf32=True`, torch in exact fp32). *path*: what `backend=\"auto\"` chose (split = cuBLAS GEMMs around "
        "our softmax kernel; fused = our FlashAttention-2 kernel). *ms*: median time of one call on torch tensors; "
        "*TFLOP/s*: 4·B·H·L·S·D / ms (halved for causal). "
        "*torch ms*: `torch.nn.functional.scaled_dot_product_attention` as torch chooses its backend; *torch best*: "
        "torch's fastest backend that accepts the call (default, math, efficient, flash, cudnn). *× torch*, *× best*: "
        "torch ms / ms, and the best backend's time / ms. *max err*, *torch err*: max |out − ref| of ours and of "
        "torch's default against the float64 reference, on the first (batch, head) pairs."),
    "bench_linear_bn_softmax": (
        "Words: *case*: `cupy_attn` is `linear_batchnorm_softmax`; `+tf32` runs the fp32 GEMM on TF32 tensor cores "
        "(ours and torch's). *mode*: training (batch statistics; running stats updated) or eval (running stats). "
        "*ms*: median time of one whole call on torch tensors, Python included; *torch ms*: the plain torch module "
        "(`nn.Linear` → `nn.BatchNorm1d` → ·scale → softmax) under `no_grad`; *× torch* = torch ms / ms. "
        "*GEMM alone ms*: our x·Wᵀ GEMM by itself, the floor for the whole operation. *TFLOP/s*: 2·N·K·F / ms. "
        "*max err*, *torch err*: max |out − ref| against a float64 computation. *host µs*, *torch host µs*: median "
        "CPU time of one call. Mode *train step*: one forward + backward (`torch.autograd.grad` for the five "
        "parameters; `+dx` for x too) of `cupy_attn.torch.LinearBatchNormSoftmax` against the plain module's, "
        "*TFLOP/s* counting its GEMMs (4·N·K·F, or 6·N·K·F with dx), *max err*/*torch err* the largest gradient "
        "error max |g − ref| / max |ref|."),
}


def _readme_case(section: str, name: str) -> str:
    """Row names for readers: the SDPA rows are variations of one shape, the Linear-BN rows of one operation."""
    if section == "bench_sdpa":
        rest = name[len("seed"):].strip() if name.startswith("seed") else name
        return rest.replace("x4 batch", "×4 batch") or "shape above"
    return name.replace("linear_bn_softmax", "cupy_attn")


def readme_table(sec: dict, rows: list[dict]) -> str:
    specs = {k: s for k, _, s in sec["columns"]}
    specs.setdefault("name", "")
    columns = [(k, header, specs.get(k, ".3f")) for k, header in README_COLUMNS[sec["name"]]]
    rows = [{**r, "name": _readme_case(sec["name"], r["name"])} for r in rows]
    return table(rows, columns)


def render(payload: dict, note: str = "") -> tuple[str, str]:
    """(RESULTS.md, the README's results block). ``note`` goes to RESULTS.md only: the README says what a reader
    needs and links the full record."""
    env = payload["env"]
    facts = (f"Command: `{payload['command']}`. Times are medians of CUDA-event timings "
             f"(`cupyx.profiler.benchmark`) after warm-up, on fresh random data, torch measured in the same process. ")
    head = (f"Measured {env.get('date')} on {env.get('gpu')} (CUDA runtime {env.get('cuda_runtime')}), "
            f"CuPy {env.get('cupy')}, torch {env.get('torch')}, Python {env.get('python')}.\n" + facts +
            f"TFLOP/s count 4·B·H·L·S·D (halved for causal) against a measured fp16 GEMM ceiling of "
            f"{GEMM_CEILING_TFLOPS:.0f} TFLOP/s. Errors are max |out − ref| against the float64 reference.\n"
            + (f"\n{note}\n" if note else ""))
    sections = []
    for sec in payload["sections"]:
        sections.append(f"### {sec['title']}\n\n{table(sec['rows'], sec['columns'])}\n")
    full = ("# Benchmark results\n\n" + head + "\n![head-dim sweep](bench_sdpa.png)\n\n" + "\n".join(sections))
    short = (f"Measured {env.get('date')} on an {env.get('gpu')} (CUDA runtime {env.get('cuda_runtime')}) with "
             f"CuPy {env.get('cupy')}, torch {env.get('torch')} (the torch installed on that GPU machine) and Python "
             f"{env.get('python')}. " + facts + "Full tables, sweeps and the fused-kernel comparison: "
             "[bench/RESULTS.md](bench/RESULTS.md).\n")
    for sec in payload["sections"]:
        if sec["name"] == "bench_sdpa":
            rows = [r for r in sec["rows"] if r["name"].startswith("seed")]
            B, H, L, S, D, Dv = rows[0]["shape"]
            keys = f", {S} keys" if S != L else ""
            title = (f"scaled_dot_product_attention, query/key/value of shape (batch, heads, seqlen, head dim) = "
                     f"({B}, {H}, {L}, {D}){keys}" + (": a head dim above 256, which torch's flash and cuDNN kernels "
                                                      "do not take" if D > 256 else ""))
        elif sec["name"] == "bench_linear_bn_softmax":
            rows, title = sec["rows"], sec["title"]
        else:
            continue
        short += f"\n{title}:\n\n{readme_table(sec, rows)}\n\n{README_WORDS[sec['name']]}\n"
    return full, short


def main(argv=None) -> int:
    args = argv or sys.argv[1:] or [os.path.join(HERE, "out")]
    src, note = args[0], " ".join(args[1:])
    with open(os.path.join(src, "main.json")) as f:
        payload = json.load(f)
    full, short = render(payload, note)
    with open(os.path.join(HERE, "RESULTS.md"), "w") as f:
        f.write(full)
    readme = os.path.join(ROOT, "README.md")
    text = open(readme).read()
    text = re.sub(r"<!-- results:start -->.*<!-- results:end -->",
                  "<!-- results:start -->\n" + short + "<!-- results:end -->", text, flags=re.S)
    with open(readme, "w") as f:
        f.write(text)
    print(f"wrote bench/RESULTS.md and README.md's results block from {src}/main.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
