"""The environment variables cupy_attn reads, declared once: name, meaning, accepted values, default, and whether a
value changes a call's launch.

Every module reads its variable through :func:`get`, which refuses an undeclared name. The call cache keys each call
on the variables that change the launch (``CALL_KEY``: the checks, the path, the kernel or the launch parameters read
them per call, so a replay must not outlive a change). The README's "Environment variables" table is
:func:`markdown_table`'s output (tests/test_env.py checks both); ``python -m cupy_attn.runtime.env`` prints it.
"""
from __future__ import annotations

import dataclasses
import os


@dataclasses.dataclass(frozen=True)
class Knob:
    """One environment variable: ``values`` the accepted values (unset included), ``launch`` True when its value
    changes what a call launches (part of the call cache's key); False for those read once (at import) or that only
    move files."""
    name: str
    meaning: str
    values: str
    launch: bool


KNOBS = (
    Knob("CUPY_ATTN_BACKEND", "overrides `backend=\"auto\"` on GPU calls (debugging)",
         "`fused`, `split`, `reference`; unset: auto", True),
    Knob("CUPY_ATTN_WGMMA", "Hopper: the FlashAttention-2 kernel's warpgroup-MMA variant",
         "`0`: keep `mma.sync`; unset or other: wgmma where a tile exists", True),
    Knob("CUPY_ATTN_FA3", "Hopper: the FlashAttention-3-design forward kernel",
         "`0` off; `1` ping-pong, `2` intra-warpgroup overlap, `3` persistent, for every call it takes; unset: `3` "
         "for calls of at least 2^34 FLOPs", True),
    Knob("CUPY_ATTN_FA3_M192", "the FA3 kernel's 192-row tile at head dim 64 (modes 2 and 3)",
         "`0` off, `1` causal calls too; unset: non-causal calls", True),
    Knob("CUPY_ATTN_WORKSPACE_BYTES", "the split path's score-buffer budget when `workspace_bytes` is not passed",
         "bytes (an integer); unset: 1 GiB", True),
    Knob("CUPY_ATTN_DECODE", "the decode (split-KV) path and its kernel",
         "`0` off; `1` flash_decode, `2` / `3` the Hopper TMA variant with one / two blocks per SM; unset: `1`",
         True),
    Knob("CUPY_ATTN_DECODE_WARPS", "flash_decode's warps per block", "`4`, `8`; unset: 8 where the launch has at "
         "most 1.5 blocks per SM (Hopper, head dims up to 128)", True),
    Knob("CUPY_ATTN_BWD", "which backward runs", "`split`, `mma`, `sm90`, `auto`; unset: auto", True),
    Knob("CUPY_ATTN_VARLEN_BWD", "varlen_attention's backward on Hopper",
         "`kernel`: the packed Hopper backward (one launch) for every call it can run; `dense`: the dense backward "
         "on padded buckets (causal self-attention) or per sequence; unset or other: the packed kernel for calls "
         "without a window, softcap or ALiBi (the cases its GPU tests cover), the dense backward otherwise", True),
    Knob("CUPY_ATTN_SPLIT_FUSED", "the split path's Hopper scores kernel (Q·Kᵀ with the softmax in its epilogue)",
         "`0` off (cuBLAS + softmax pass), `1` one block per 64 rows, `2` clusters of two, `3` persistent; unset or "
         "other: `3`", True),
    Knob("CUPY_ATTN_FP32_GEMM", "the split path's fp32 GEMMs", "`3xtf32` (default), `sgemm` (cuBLAS)", True),
    Knob("CUPY_ATTN_D512", "Hopper: the head-dim 257-512 fused kernel", "`0` never, `1` every call it can serve; "
         "unset: auto", True),
    Knob("CUPY_ATTN_SPLIT_PV", "the split path's P·V kernel after the scores kernel",
         "`0` cuBLAS, `2` every call it can serve; unset or other: causal calls and the shapes it wins", True),
    Knob("CUPY_ATTN_CUBLASLT", "cuBLASLt for the GEMMs (read at import)", "`0`: classic cuBLAS; unset: cuBLASLt",
         False),
    Knob("CUPY_ATTN_GEMM_TUNE", "time cuBLASLt's candidate algorithms once per large GEMM shape (read at import)",
         "`0`: the heuristic's first choice; unset: tune", False),
    Knob("CUPY_ATTN_CACHE_DIR", "the compile cache's directory", "a path; unset: `$XDG_CACHE_HOME/cupy_attn` or "
         "`~/.cache/cupy_attn`", False),
)
BY_NAME = {knob.name: knob for knob in KNOBS}
CALL_KEY = tuple(knob.name for knob in KNOBS if knob.launch)


def get(name: str, default: str | None = None) -> str | None:
    """``os.environ.get(name, default)`` for a declared variable; KeyError for a name not in KNOBS."""
    if name not in BY_NAME:
        raise KeyError(f"{name} is not declared in cupy_attn.runtime.env.KNOBS")
    return os.environ.get(name, default)


def markdown_table() -> str:
    """The README's table of the variables."""
    rows = ["| variable | what it selects | values | in the call cache's key |", "|---|---|---|---|"]
    rows += [f"| `{k.name}` | {k.meaning} | {k.values} | {'yes' if k.launch else 'no'} |" for k in KNOBS]
    return "\n".join(rows)


if __name__ == "__main__":
    print(markdown_table())
