"""The merge of two partial attention results by their lse (cuda_src/attention/merge_states.cu), behind
cupy_attn.merge_attention_states.

    lse = log(e^lse_a + e^lse_b),   out = (e^(lse_a − lse)·out_a + e^(lse_b − lse)·out_b)

One warp per row; rows of the three (rows, head_dim_v) arrays at their own pitches, lse arrays contiguous fp32.
"""
from __future__ import annotations

import numpy as np

from ...runtime.compile import KernelFamily
from ...runtime.interop import dtype_name
from ...runtime.kernel_abi import C_TYPE
from ...runtime.launch import launch_struct

# MergeStatesParams in merge_states.cu: every field 8 bytes wide.
PARAMS = np.dtype([(n, np.int64) for n in (
    "out_a", "out_b", "lse_a", "lse_b", "out", "lse", "rows", "head_dim_v", "stride_a", "stride_b", "stride_out",
    "vec")])

MERGE_STATES = KernelFamily(
    name="merge_states",
    source="attention/merge_states.cu",
    template="cupy_attn::merge_states<{dtype}>",
    axes={"dtype": tuple(C_TYPE.values())},
    structs=(("cupy_attn::MergeStatesParams", PARAMS),),
)

ROWS_PER_BLOCK = 8  # one warp per row, 256 threads


def params_for(out_a, lse_a, out_b, lse_b, out, lse) -> np.ndarray:
    """The struct for CuPy arrays: out_a, out_b, out (rows, Ev) with a unit last stride; lse_a, lse_b, lse (rows,)
    contiguous float32 (lse may be None). ``vec`` is set when every row start of the three is 16-byte aligned and Ev
    fills whole 16-byte vectors."""
    rows, ev = out.shape
    isz = out.itemsize
    prm = np.zeros((), dtype=PARAMS)
    prm["out_a"], prm["out_b"], prm["out"] = out_a.data.ptr, out_b.data.ptr, out.data.ptr
    prm["lse_a"], prm["lse_b"] = lse_a.data.ptr, lse_b.data.ptr
    prm["lse"] = 0 if lse is None else lse.data.ptr
    prm["rows"], prm["head_dim_v"] = rows, ev
    strides = [a.strides[0] // isz if rows > 1 else ev for a in (out_a, out_b, out)]
    prm["stride_a"], prm["stride_b"], prm["stride_out"] = strides
    aligned = all(a.data.ptr % 16 == 0 for a in (out_a, out_b, out)) and all(s * isz % 16 == 0 for s in strides)
    prm["vec"] = int(aligned and (ev * isz) % 16 == 0)
    return prm


def launch(stream_ptr: int, out_a, lse_a, out_b, lse_b, out, lse) -> None:
    """Enqueue the merge on ``stream_ptr`` (CuPy arrays as :func:`params_for` takes them; the device current)."""
    rows = out.shape[0]
    if rows == 0 or (out.shape[1] == 0 and lse is None):
        return
    kernel = MERGE_STATES.kernel(dtype=C_TYPE[dtype_name(out.dtype)])
    prm = params_for(out_a, lse_a, out_b, lse_b, out, lse)
    launch_struct(kernel, (-(-rows // ROWS_PER_BLOCK),), (32 * ROWS_PER_BLOCK,), prm, stream_ptr)
