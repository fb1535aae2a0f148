"""The decode combine kernel launched as a programmatic dependent (PDL) of the split kernel, A/B in one process: the call-cache entry of the public call prepared with decode.PDL off and
with it on (replayed directly), device ms (behind a spin kernel) and idle-start ms in alternating rounds, beside
torch's default SDPA; and "loop µs": per step of 50 steps back to back (a small torch kernel writing q, then the
call), between two events, as a decode loop runs. Outputs must be bit-identical.

    PYTHONPATH=. python3 bench/experiments/decode/decode_pdl.py
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # bench/: common

import numpy as np  # noqa: E402

from common import device_ms, interleaved_ms  # noqa: E402

CASES = [(64, 32, 32, 4096), (8, 32, 32, 32768), (8, 32, 8, 32768), (16, 64, 8, 8192), (1, 32, 8, 8192)]


def main():
    import cupy
    import torch
    import torch.nn.functional as F

    import cupy_attn
    from cupy_attn.attention.kernels import flash_decode as decode
    from cupy_attn.runtime import callcache
    print(cupy.cuda.runtime.getDeviceProperties(0)["name"].decode(), flush=True)
    print(f"{'(B, Hq/Hkv, S)':22s} {'splits':>6s} {'dev plain':>10s} {'dev PDL':>8s} {'idle plain':>11s} "
          f"{'idle PDL':>9s} {'torch':>7s} {'loop us plain':>14s} {'loop us PDL':>12s} {'torch':>7s} {'same':>5s}")
    for B, Hq, Hkv, S in CASES:
        q = torch.randn(B, Hq, 1, 128, device="cuda", dtype=torch.bfloat16)
        k, v = (torch.randn(B, Hkv, S, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        gqa = Hq != Hkv
        calls, outs = {}, {}
        for pdl in (False, True):
            decode.PDL = pdl
            callcache.clear()
            outs[pdl] = cupy_attn.scaled_dot_product_attention(q, k, v, enable_gqa=gqa)
            entries = list(callcache._CACHE.values())  # the one call just prepared
            calls[pdl] = entries[0] if len(entries) == 1 else None
        decode.PDL = True
        info = cupy_attn.explain(q, k, v, enable_gqa=gqa)
        launch = getattr(getattr(calls[True], "run", None), "__self__", None)
        splits = str(getattr(launch, "num_splits", "?"))
        same = torch.equal(outs[False], outs[True])
        if calls[False] is None or calls[True] is None:
            print(f"({B}, {Hq}/{Hkv}, {S}): not a cached decode call ({info})")
            continue
        fns = [lambda: calls[False](q, k, v, None), lambda: calls[True](q, k, v, None),
               lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=gqa)]
        dev = [np.median([device_ms(f) for _ in range(3)]) for f in fns]
        idle = interleaved_ms(fns, rounds=5, repeat=20)
        loop = [[] for _ in fns]
        for _ in range(5):
            for i, f in enumerate(fns):
                loop[i].append(loop_us(lambda: (q.mul_(1.0), f())))
        loop = [float(np.median(x)) for x in loop]
        print(f"({B}, {Hq}/{Hkv}, {S}){'':8s} {splits:>6s} {dev[0]:10.4f} {dev[1]:8.4f} {idle[0]:11.4f} "
              f"{idle[1]:9.4f} {idle[2]:7.4f} {loop[0]:14.1f} {loop[1]:12.1f} {loop[2]:7.1f} {str(same):>5s}",
              flush=True)


def loop_us(step, n: int = 50) -> float:
    """µs per step of n steps enqueued back to back (after 5 warm-up steps), between two events on the stream."""
    import cupy
    for _ in range(5):
        step()
    start, stop = cupy.cuda.Event(), cupy.cuda.Event()
    start.record()
    for _ in range(n):
        step()
    stop.record()
    stop.synchronize()
    return cupy.cuda.get_elapsed_time(start, stop) * 1e3 / n


if __name__ == "__main__":
    main()
