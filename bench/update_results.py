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


def render(payload: dict, note: str = "") -> tuple[str, str]:
    env = payload["env"]
    head = (f"Measured {env.get('date')} on {env.get('gpu')} (CUDA runtime {env.get('cuda_runtime')}), "
            f"CuPy {env.get('cupy')}, torch {env.get('torch')}, Python {env.get('python')}.\n"
            f"Command: `{payload['command']}`. Times are medians of CUDA-event timings "
            f"(`cupyx.profiler.benchmark`) after warm-up, on fresh random data, torch measured in the same process. "
            f"TFLOP/s count 4·B·H·L·S·D (halved for causal) against a measured fp16 GEMM ceiling of "
            f"{GEMM_CEILING_TFLOPS:.0f} TFLOP/s. Errors are max |out − ref| against the float64 reference.\n"
            + (f"\n{note}\n" if note else ""))
    sections = []
    for sec in payload["sections"]:
        sections.append(f"### {sec['title']}\n\n{table(sec['rows'], sec['columns'])}\n")
    full = ("# Benchmark results\n\n" + head + "\n![head-dim sweep](bench_sdpa.png)\n\n" + "\n".join(sections))
    short = head + "\nFull tables, sweeps and the fused-kernel comparison: [bench/RESULTS.md](bench/RESULTS.md).\n"
    for sec in payload["sections"]:
        if sec["name"] == "bench_sdpa":
            rows = [r for r in sec["rows"] if r["name"].startswith("seed")]
            short += f"\n{sec['title']}:\n\n{table(rows, sec['columns'])}\n"
        elif sec["name"] == "bench_linear_bn_softmax":
            short += f"\n{sec['title']}:\n\n{table(sec['rows'], sec['columns'])}\n"
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
