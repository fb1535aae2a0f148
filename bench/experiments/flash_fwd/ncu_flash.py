"""One fused-kernel launch per case for Nsight Compute (the first launches warm up and compile):

    PYTHONPATH=. ncu --clock-control none -k regex:flash_fwd --launch-skip 2 --launch-count 1 \\
        --section SpeedOfLight --section WarpStateStats --section ComputeWorkloadAnalysis \\
        python3 bench/experiments/flash_fwd/ncu_flash.py [B H L D]
"""
import sys

import cupy
import numpy as np

from cupy_attn.attention import dispatch

B, H, L, D = (int(a) for a in sys.argv[1:5]) if len(sys.argv) > 4 else (8, 16, 2048, 128)
rng = np.random.default_rng(0)
q, k, v = (cupy.asarray(rng.standard_normal((B, H, L, D), dtype=np.float32)).astype(cupy.float16) for _ in range(3))
out = cupy.empty_like(q)
for _ in range(3):
    dispatch.fused_launch(q, k, v, out, scale=D ** -0.5)(q.data.ptr, k.data.ptr, v.data.ptr, out.data.ptr)
cupy.cuda.Device().synchronize()
