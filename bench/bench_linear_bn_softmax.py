"""Benchmark: fused Linear → BatchNorm1d → scale → softmax vs torch, seed workload x (1024, 8192), 8192 → 8192.

Every row, same process, same data: ``ms`` (our op, torch inputs, whole call incl. Python), ``device_ms`` (the same
call's device time alone: enqueued behind a spin kernel, so host time before the GEMM is hidden), ``gemm_ms`` /
``gemm_device_ms`` (our cuBLASLt GEMM alone, prepared plan enqueued with pointers: the floor), ``ratio_to_gemm`` = ms /
min(gemm_ms, torch_gemm_ms), ``post_us`` (device time of our kernels after the GEMM alone, replayed from a CUDA graph;
``first_us`` the statistics / fold kernel of those), ``torch_ms`` (the plain torch module under no_grad),
``torch_gemm_ms`` (torch's Linear alone), ``speedup`` = torch_ms / ms, ``host_us`` / ``torch_host_us`` (host time of
one call, ours / torch's), ``max_err`` / ``torch_err`` (max abs error of our / torch's output vs a float64
computation, torch float64 on the GPU, from the same inputs).
Timing: cupyx.profiler.benchmark, median of GPU-event times after warm-up (ours, torch's module and our GEMM alone in
five alternating rounds: common.interleaved_ms); x rotates over 3 fresh random buffers
(16 MB each in fp16, so L2 does not hold the next call's input from the previous one).

Training-step rows (mode "train step", fp16 and bf16; ``benchmark_training``): one forward + backward,
``torch.autograd.grad`` of the output against a fresh random output gradient, with respect to the five parameters
(name ``… train step``; x is data) or the parameters and x (``… train step +dx``: one more GEMM), our
``cupy_attn.torch.LinearBatchNormSoftmax`` against the plain torch module holding the same values, x and the output
gradient rotating over 3 fresh random buffers. ``ms``, ``device_ms``, ``torch_ms``, ``speedup``, ``host_us`` /
``torch_host_us`` as above for the whole step; ``tflops`` counts the GEMMs (4·N·K·F, 6·N·K·F with dx); ``max_err`` /
``torch_err``: the largest over the gradients (the Linear bias's excepted: it is 0 in training) of max |g − ref| /
max |ref|, ref from torch float64 on the GPU, all from the same starting state. ``ms`` and ``torch_ms`` of these rows
come from five alternating rounds of ours and torch's (``common.interleaved_ms``): the steps are host-bound, and blocks
measured one after the other would compare two moments of the host as much as two libraries. ``loop_ms`` /
``torch_loop_ms``: per step, 20 steps enqueued back to back between two CUDA events (a training loop's steady state:
the host's time of a step is hidden behind the device's queue unless it is the longer of the two), median of 5 such
loops.

    PYTHONPATH=. python3 bench/bench_linear_bn_softmax.py [--quick] [--sweep]
"""
from __future__ import annotations

import argparse
import itertools

import numpy as np

from common import device_ms, interleaved_ms, median_ms
from cupy_attn.runtime.launch import PreparedLaunch, launch_struct
from cupy_attn.runtime.kernel_abi import C_TYPE

N, K, F = 1024, 8192, 8192


def flops(n: int = N, k: int = K, f: int = F) -> float:
    """2·N·K·F for the GEMM; the rest (~15 flops per output) is negligible."""
    return 2.0 * n * k * f


def _loop_ms(fn, steps: int = 20, samples: int = 5) -> float:
    """Per-call ms of ``steps`` calls of ``fn`` enqueued back to back (no synchronization between them) between two
    CUDA events on torch's current stream; median of ``samples`` loops, each started from an idle GPU."""
    import torch
    times = []
    for _ in range(samples):
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(steps):
            fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / steps)
    return float(np.median(times))


def _graph_us(launch, reps: int = 20, samples: int = 15) -> float:
    """Device time of ``launch()`` in µs without host launch gaps: ``reps`` launches captured in a CUDA graph, replayed
    ``samples`` times between events; median per launch."""
    import cupy
    s = cupy.cuda.Stream(non_blocking=True)
    with s:
        launch()
        s.synchronize()
        s.begin_capture()
        for _ in range(reps):
            launch()
        graph = s.end_capture()
        e1, e2 = cupy.cuda.Event(), cupy.cuda.Event()
        times = []
        for _ in range(samples):
            e1.record(s)
            graph.launch(s)
            e2.record(s)
            e2.synchronize()
            times.append(cupy.cuda.get_elapsed_time(e1, e2) * 1e3 / reps)
    return float(np.median(times))


def _model(dtype, seed=0):
    import torch
    from torch import nn

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.gemm = nn.Linear(K, F)
            self.bn = nn.BatchNorm1d(F)
            self.scale = nn.Parameter(torch.ones(1))

        def forward(self, x):
            return torch.softmax(self.scale * self.bn(self.gemm(x)), dim=1)

    torch.manual_seed(seed)
    m = Model()
    with torch.no_grad():
        m.bn.weight.uniform_(0.5, 1.5)
        m.bn.bias.normal_(0, 0.5)
        m.bn.running_mean.normal_(0, 0.2)
        m.bn.running_var.uniform_(0.5, 2.0)
        m.scale.fill_(1.7)
    return m.cuda().to(dtype)


def _errors(plain, fused_call, x, training: bool):
    """(our max err, torch max err) vs torch float64 on the GPU, all from the same parameters and running stats."""
    import copy

    import torch
    ref_model = copy.deepcopy(plain).double().train(training)
    torch_model = copy.deepcopy(plain).train(training)
    with torch.no_grad():
        ref = ref_model(x.double())
        t = torch_model(x).double()
        ours = fused_call(x).double()
    assert not torch.isnan(ours).any(), "NaN in our output"
    return float((ours - ref).abs().max()), float((t - ref).abs().max())


def benchmark(quick: bool = False) -> list[dict]:
    """Rows for fp16, bf16, fp32 (exact) and fp32 with TF32, each in training and eval mode."""
    import cupy
    import torch

    from cupy_attn.runtime import blas as _cublas
    from cupy_attn.linear_bn_softmax import checks as lbs_checks, launch as lbs
    from cupy_attn.linear_bn_softmax import linear_batchnorm_softmax

    repeat, warmup = (20, 5) if quick else (100, 20)
    configs = [("float16", False), ("bfloat16", False)]
    if not quick:
        configs += [("float32", False), ("float32", True)]
    rows = []
    old_tf32 = torch.backends.cuda.matmul.allow_tf32
    try:
        for dname, tf32 in configs:
            dt = getattr(torch, dname)
            torch.backends.cuda.matmul.allow_tf32 = tf32
            plain = _model(dt)
            bn = plain.bn
            xs = [torch.randn(N, K, device="cuda").to(dt) for _ in range(3)]
            cyc = itertools.cycle(xs)
            w_c = cupy.from_dlpack(plain.gemm.weight.detach())
            xs_c = [cupy.from_dlpack(x) for x in xs]
            cyc_c = itertools.cycle(xs_c)
            y_c = cupy.empty((N, F), dtype=w_c.dtype)
            # Our GEMM alone as the op runs it: the prepared cuBLASLt plan, enqueued with pointers (least host time).
            gemm_op = lbs._gemm_xwt_op(0, w_c.dtype, tf32, N, F, K, K, K)
            _cublas.gemm(y_c, xs_c[0], w_c, trans_b=True, allow_tf32=tf32)  # plans and tunes, once

            def gemm_only():
                gemm_op(y_c.data.ptr, next(cyc_c).data.ptr, w_c.data.ptr)

            def torch_gemm():
                with torch.no_grad():
                    torch.nn.functional.linear(next(cyc), plain.gemm.weight, plain.gemm.bias)

            gemm_device_ms = device_ms(gemm_only)
            torch_gemm_ms = median_ms(torch_gemm, repeat, warmup)
            initial = {k: v.clone() for k, v in plain.state_dict().items()}
            for mode in ("training", "eval"):
                training = mode == "training"
                plain.load_state_dict(initial)  # eval must not see stats left by the training rows
                plain.train(training)

                def ours(x=None, _training=training):
                    with torch.no_grad():  # the forward-only path, as torch's row (the parameters require grad)
                        return linear_batchnorm_softmax(
                            next(cyc) if x is None else x, plain.gemm.weight, plain.gemm.bias, bn.running_mean,
                            bn.running_var, bn.weight, bn.bias, plain.scale, training=_training,
                            momentum=bn.momentum, eps=bn.eps, num_batches_tracked=bn.num_batches_tracked,
                            allow_tf32=tf32)

                def torch_fwd():
                    with torch.no_grad():
                        plain(next(cyc))

                err, torch_err = _errors(plain, lambda x: ours(x), xs[0], training)
                # Ours, torch's module and our GEMM alone in alternating rounds: the two ratios the row reports
                # compare the same moments of the GPU clock and the host.
                (ms, host_us), (torch_ms, torch_host_us), (gemm_ms, _) = interleaved_ms(
                    (ours, torch_fwd, gemm_only), 5, max(repeat // 5, 4), warmup, host=True)
                dev_ms = device_ms(ours)

                # Our kernels after the GEMM alone, device time only (CUDA graph), on a GEMM result (in place:
                # later repeats see probabilities, same cost); the running stats are restored afterwards.
                saved = {k: v.clone() for k, v in plain.state_dict().items()}
                call = lbs_checks.check(xs[0], plain.gemm.weight, plain.gemm.bias, bn.running_mean, bn.running_var,
                                  bn.weight, bn.bias, plain.scale, training, bn.momentum, bn.eps,
                                  bn.num_batches_tracked)
                gemm_only()
                launches = _post_launches(lbs, call, y_c.data.ptr, bn.momentum, bn.eps)
                try:
                    post_us = _graph_us(lambda: run_launches(launches))
                    first_us = _graph_us(lambda: post_first(launches))
                except Exception as exc:  # graph capture unavailable: report, don't guess
                    print(f"graph timing failed: {exc!r}")
                    post_us = first_us = float("nan")
                plain.load_state_dict(saved)
                name = "linear_bn_softmax" + ("+tf32" if tf32 else "")
                rows.append(dict(name=name, dtype=dname, mode=mode, ms=ms, device_ms=dev_ms, gemm_ms=gemm_ms,
                                 gemm_device_ms=gemm_device_ms, post_us=post_us, torch_ms=torch_ms,
                                 torch_gemm_ms=torch_gemm_ms, speedup=torch_ms / ms,
                                 ratio_to_gemm=ms / min(gemm_ms, torch_gemm_ms), tflops=flops() / ms * 1e-9, max_err=err,
                                 torch_err=torch_err, host_us=host_us, torch_host_us=torch_host_us,
                                 first_us=first_us))
    finally:
        torch.backends.cuda.matmul.allow_tf32 = old_tf32
    return rows + benchmark_training(quick)


def _grads(model, x, dout, with_x: bool) -> dict:
    """{name: gradient} of one forward + backward of ``model`` (torch.autograd.grad: nothing accumulates)."""
    import torch
    x = x.detach().requires_grad_(with_x)
    names, params = zip(*model.named_parameters())
    got = torch.autograd.grad(model(x), params + ((x,) if with_x else ()), dout)
    return dict(zip(names + (("x",) if with_x else ()), got))


def _grad_errors(plain, x, dout, with_x: bool) -> tuple[float, float]:
    """(ours, torch's): the largest over the gradients of max |g − ref| / max |ref|, ref from torch float64 on the GPU,
    each model a fresh copy of ``plain`` (same parameters and running stats). The Linear bias is left out: in
    training its gradient is 0 (the batch mean absorbs the bias), so its relative error is meaningless."""
    import copy

    from cupy_attn.torch import LinearBatchNormSoftmax
    ref = _grads(copy.deepcopy(plain).double(), x.double(), dout.double(), with_x)
    theirs = _grads(copy.deepcopy(plain), x, dout, with_x)
    ours = _grads(LinearBatchNormSoftmax.from_module(plain), x, dout, with_x)

    def worst(g):
        errs = []
        for name, r in ref.items():
            if name == "gemm.bias":
                continue
            assert not g[name].isnan().any(), f"NaN in the gradient of {name}"
            errs.append(float((g[name].double() - r).abs().max() / r.abs().max()))
        return max(errs)
    return worst(ours), worst(theirs)


def benchmark_training(quick: bool = False) -> list[dict]:
    """Training-step rows (fp16, bf16; parameters' gradients, then with x's too): see the module docstring."""
    import torch

    from cupy_attn.torch import LinearBatchNormSoftmax
    repeat, warmup = (20, 5) if quick else (100, 20)
    rows = []
    for dname in ("float16", "bfloat16"):
        dt = getattr(torch, dname)
        plain = _model(dt).train()
        xs = [torch.randn(N, K, device="cuda").to(dt) for _ in range(3)]
        douts = [(torch.randn(N, F, device="cuda") / N).to(dt) for _ in range(3)]
        for with_x in (False, True):
            initial = {k: v.clone() for k, v in plain.state_dict().items()}
            err, torch_err = _grad_errors(plain, xs[0], douts[0], with_x)
            fused = LinearBatchNormSoftmax.from_module(plain)
            inputs = [x.detach().requires_grad_(with_x) for x in xs]

            def step(model, _inputs=inputs, _with_x=with_x):
                params = tuple(model.parameters())
                data = itertools.cycle(list(zip(_inputs, douts)))

                def run():
                    x, dout = next(data)
                    torch.autograd.grad(model(x), params + ((x,) if _with_x else ()), dout)
                return run

            ours, theirs = step(fused), step(plain)
            (ms, host_us), (torch_ms, torch_host_us) = interleaved_ms((ours, theirs), 5, repeat // 5, warmup, host=True)
            dev_ms = device_ms(ours)
            loop_ms, torch_loop_ms = _loop_ms(ours), _loop_ms(theirs)
            plain.load_state_dict(initial)  # the next rows start from the same running stats
            flops = (6.0 if with_x else 4.0) * N * K * F
            rows.append(dict(name="linear_bn_softmax train step" + (" +dx" if with_x else ""), dtype=dname,
                             mode="train step", ms=ms, device_ms=dev_ms, torch_ms=torch_ms, speedup=torch_ms / ms,
                             tflops=flops / ms * 1e-9, max_err=err, torch_err=torch_err, host_us=host_us,
                             torch_host_us=torch_host_us, loop_ms=loop_ms, torch_loop_ms=torch_loop_ms,
                             loop_speedup=torch_loop_ms / loop_ms))
    return rows


def _post_launches(lbs, call, out_ptr: int, momentum, eps) -> list:
    """The kernels after the GEMM, in place on ``out_ptr``, one PreparedLaunch each (the call's Params with its
    pointers filled in; plain or PDL as the call launches them), on CuPy's current stream when run."""
    prepared = lbs.Prepared(call, momentum, eps, False, call.k, call.k)
    vectors = tuple(0 if call.args[name] is None else call.args[name].ptr() for name in lbs.VECTORS)
    affine = lbs.stream_workspace(prepared.device_id, prepared.stream_ptr, "work", prepared.work_bytes)
    params = prepared.launch.params.copy()
    for name, ptr in zip(lbs.POINTERS, (out_ptr, out_ptr, lbs.workspace.pointer(affine), *vectors)):
        params[name] = ptr
    return [PreparedLaunch(params, [step]) for step in prepared.launch.steps]


def run_launches(launches) -> None:
    for launch in launches:
        launch()


def post_first(launches) -> None:
    """Only the first launch after the GEMM (column_stats or fold_running_stats)."""
    run_launches(launches[:1])


def sweep_row_kernels(dname: str = "float16", repeat: int = 50) -> list[dict]:
    """Device time of every declared softmax_rows variant that holds F = 8192, at 1, 2 and 4 resident waves of
    blocks (tile choice data; fp16, Affine from the eval fold)."""
    import cupy
    import torch

    from cupy_attn.linear_bn_softmax import checks as lbs_checks, launch as lbs
    dt = getattr(torch, dname)
    plain = _model(dt).eval()
    bn = plain.bn
    w = cupy.from_dlpack(plain.gemm.weight.detach())
    y = cupy.random.standard_normal((N, F), dtype=np.float32).astype(w.dtype)
    x = torch.randn(N, K, device="cuda").to(dt)
    call = lbs_checks.check(x, plain.gemm.weight, plain.gemm.bias, bn.running_mean, bn.running_var, bn.weight, bn.bias,
                      plain.scale, False, bn.momentum, bn.eps, None)
    launches = _post_launches(lbs, call, y.data.ptr, bn.momentum, bn.eps)
    post_first(launches)  # the Affine workspace the row kernels read
    params = launches[0].params
    out = []
    ctype = C_TYPE[dname]
    for row in lbs.SOFTMAX_ROWS.variants():
        if row["dtype"] != ctype or row["threads"] * row["vec"] * row["chunks"] < F:
            continue
        kernel = lbs.SOFTMAX_ROWS.kernel(**row)
        resident = lbs.interop.device_sms(0) * lbs._blocks_per_sm(kernel, row["threads"])
        for grid in sorted({min(N // row["rows"], resident * m) for m in (1, 2, 4)}):
            us = _graph_us(lambda: launch_struct(kernel, (grid,), (row["threads"],), params,
                                                 cupy.cuda.get_current_stream().ptr))
            out.append(dict(variant=lbs.SOFTMAX_ROWS.name_expression(**row), regs=kernel.num_regs, grid=grid, us=us))
    return out


def sweep_stats_kernels(dname: str = "float16") -> list[dict]:
    """Device time of every declared column_stats tile for this dtype at F = 8192 (training call's Params; the
    running stats it updates are a throwaway model's)."""
    import cupy
    import torch

    from cupy_attn.linear_bn_softmax import checks as lbs_checks, launch as lbs
    plain = _model(getattr(torch, dname)).train()
    bn = plain.bn
    y = cupy.random.standard_normal((N, F), dtype=np.float32).astype(cupy.from_dlpack(plain.gemm.weight.detach()).dtype)
    x = torch.randn(N, K, device="cuda").to(plain.gemm.weight.dtype)
    call = lbs_checks.check(x, plain.gemm.weight, plain.gemm.bias, bn.running_mean, bn.running_var, bn.weight, bn.bias,
                      plain.scale, True, bn.momentum, bn.eps, bn.num_batches_tracked)
    params = _post_launches(lbs, call, y.data.ptr, bn.momentum, bn.eps)[0].params
    out = []
    for row in lbs.COLUMN_STATS.variants():
        if row["dtype"] != C_TYPE[dname] or row["tile"][0] == 1:
            continue
        kernel = lbs.COLUMN_STATS.kernel(**row)
        vec, col_threads, threads = row["tile"]
        grid = -(-F // (vec * col_threads))
        us = _graph_us(lambda: launch_struct(kernel, (grid,), (threads,), params, cupy.cuda.get_current_stream().ptr))
        out.append(dict(variant=lbs.COLUMN_STATS.name_expression(**row), regs=kernel.num_regs, grid=grid, us=us))
    return out


def host_breakdown(dname: str = "float16", reps: int = 300) -> dict:
    """Median host µs of the steps of one training call (torch inputs): a call-cache hit (key, allocation, GEMM
    enqueue, Params and the two launches) and, for comparison, the full path's checks and preparation."""
    import time

    import torch

    from cupy_attn.linear_bn_softmax import api as lbs_api
    from cupy_attn.runtime import callcache as _callcache
    from cupy_attn.linear_bn_softmax import checks as lbs_checks, launch as lbs
    plain = _model(getattr(torch, dname)).train()
    bn = plain.bn
    x = torch.randn(N, K, device="cuda").to(plain.gemm.weight.dtype)
    args = (x, plain.gemm.weight, plain.gemm.bias, bn.running_mean, bn.running_var, bn.weight, bn.bias, plain.scale,
            True, bn.momentum, bn.eps, bn.num_batches_tracked)
    arrays = (x, plain.gemm.weight, plain.gemm.bias, bn.running_mean, bn.running_var, bn.weight, bn.bias, plain.scale,
              bn.num_batches_tracked)

    def whole():
        with torch.no_grad():  # the forward-only path (the parameters require grad)
            return lbs_api.linear_batchnorm_softmax(*args[:8], training=True, momentum=bn.momentum, eps=bn.eps,
                                                    num_batches_tracked=bn.num_batches_tracked)
    whole()
    whole()  # the second call binds the cuBLASLt call
    call = lbs_checks.check(*args)
    prepared = _callcache.get(lbs_api._call_key(arrays, True, bn.momentum, bn.eps, None)).prepared
    vectors = tuple(0 if arrays[i] is None else arrays[i].data_ptr() for i in lbs.VECTOR_ARGS)
    y = torch.empty(N, F, device="cuda", dtype=x.dtype)
    steps = {
        "cache key": lambda: lbs_api._call_key(arrays, True, bn.momentum, bn.eps, None),
        "new_empty": lambda: x.new_empty((N, F)),
        "gemm enqueue": lambda: prepared._matmul(y.data_ptr(), x.data_ptr(), plain.gemm.weight.data_ptr()),
        "post launches": lambda: prepared.enqueue_post(y.data_ptr(), y.data_ptr(), y.data_ptr(), vectors),
        "whole call (hit)": whole,
        "checks (miss)": lambda: lbs_checks.check(*args),
        "prepare (miss)": lambda: lbs.Prepared(call, bn.momentum, bn.eps, False, K, K),
    }
    out = {}
    for name, fn in steps.items():
        ts = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t0)
            if name in ("gemm enqueue", "post launches", "whole call (hit)"):
                torch.cuda.synchronize()
        out[name] = float(np.median(ts) * 1e6)
    # What the GPU sees: idle-start times (µs) of growing prefixes of a cache hit, each ending with the GEMM.
    matmul = prepared._matmul
    w = plain.gemm.weight
    prefixes = {
        "visible: gemm": lambda: matmul(y.data_ptr(), x.data_ptr(), w.data_ptr()),
        "visible: new_empty+gemm": lambda: matmul(x.new_empty((N, F)).data_ptr(), x.data_ptr(), w.data_ptr()),
        "visible: key+new_empty+gemm": lambda: (lbs_api._call_key(arrays, True, bn.momentum, bn.eps, None),
                                                matmul(x.new_empty((N, F)).data_ptr(), x.data_ptr(), w.data_ptr())),
        "visible: whole call": whole,
    }
    for name, fn in prefixes.items():
        out[name] = 1e3 * median_ms(fn, 100, 20)
    return out


def _print_table(rows: list[dict]) -> None:
    cols = ["name", "dtype", "mode", "ms", "device_ms", "gemm_ms", "gemm_device_ms", "post_us", "torch_ms", "torch_gemm_ms", "speedup",
            "ratio_to_gemm", "tflops", "max_err", "torch_err", "host_us", "torch_host_us", "first_us", "loop_ms",
            "torch_loop_ms", "loop_speedup"]
    print("| " + " | ".join(cols) + " |")
    print("|" + "---|" * len(cols))
    for r in rows:
        cells = []
        for c in cols:
            v = r.get(c)  # training-step rows have no GEMM-alone or post-GEMM columns, forward rows no loop
            cells.append("n/a" if v is None else f"{v:.3e}" if c.endswith("err") else
                         f"{v:.4f}" if isinstance(v, float) else str(v))
        print("| " + " | ".join(cells) + " |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--sweep", action="store_true", help="also time every row-kernel tile at F=8192 (fp16, eval)")
    args = ap.parse_args()
    import torch
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}")
    _print_table(benchmark(args.quick))
    print("host µs per step (fp16 training, torch inputs):",
          ", ".join(f"{k} {v:.1f}" for k, v in host_breakdown().items()))
    if args.sweep:
        for dname in ("float16", "bfloat16"):
            for r in sweep_stats_kernels(dname) + sweep_row_kernels(dname):
                print(f"{r['variant']:60s} regs={r['regs']:4d} grid={r['grid']:5d} {r['us']:8.2f} us")


if __name__ == "__main__":
    main()
