"""Host µs of each piece of an attention training step through the public API (forward with autograd recording, then
torch.autograd.grad), each piece timed alone from an idle GPU (median of 50): where the step's host time goes.

    PYTHONPATH=. python3 bench/experiments/host_overhead/host_breakdown_bwd.py [B H L D]
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # bench/: common

import torch  # noqa: E402

import cupy_attn  # noqa: E402
from common import device_ms, host_us, median_ms  # noqa: E402
from cupy_attn.attention import autograd, checks, dispatch  # noqa: E402
from cupy_attn.attention.paths import backward  # noqa: E402


def main(B=8, H=16, L=1024, D=256):
    q, k, v = (torch.randn(B, H, L, D, device="cuda", dtype=torch.float16, requires_grad=True) for _ in range(3))
    dout = torch.randn(B, H, L, D, device="cuda", dtype=torch.float16)
    qd, kd, vd = q.detach(), k.detach(), v.detach()

    def step():
        out = cupy_attn.scaled_dot_product_attention(q, k, v)
        torch.autograd.grad(out, (q, k, v), dout)

    out, lse = cupy_attn.scaled_dot_product_attention(q, k, v, return_lse=True)
    p = checks.check_sdpa(qd, kd, vd, None, 0.0, False, None, False, "auto")
    plan = dispatch.plan_backward(p)
    ctx = p.ctx
    grads = [torch.empty_like(t) for t in (qd, kd, vd)]
    launch = backward.prepare(p, plan)

    class Identity(torch.autograd.Function):
        @staticmethod
        def forward(fctx, x):
            return x.view_as(x)

        @staticmethod
        def backward(fctx, g):
            return g

    pieces = {
        "step (forward + autograd.grad)": step,
        "forward, recorded": lambda: cupy_attn.scaled_dot_product_attention(q, k, v),
        "forward, no grad (call cache)": lambda: cupy_attn.scaled_dot_product_attention(qd, kd, vd),
        "autograd.grad of an identity Function": lambda: torch.autograd.grad(Identity.apply(q), (q,), dout),
        "grad_inputs (the backward body)": lambda: autograd.grad_inputs(
            q, k, v, None, out, lse, dout, is_causal=False, scale=None, enable_gqa=False, need_mask_grad=False),
        "check_sdpa": lambda: checks.check_sdpa(qd, kd, vd, None, 0.0, False, None, False, "auto"),
        "plan_backward": lambda: dispatch.plan_backward(p),
        "3 x empty_like": lambda: [torch.empty_like(t) for t in (qd, kd, vd)],
        "6 x as_cupy": lambda: [ctx.as_cupy(t) for t in (out, lse, dout, *grads)],
        "backward.prepare (a new layout's launch)": lambda: backward.prepare(p, plan),
        "prepared backward launch (pointers)": lambda: launch(
            *(t.data_ptr() for t in (qd, kd, vd, out, lse, dout, *grads))),
    }
    rec = cupy_attn.scaled_dot_product_attention(q, k, v)
    pieces["autograd.grad alone (retain_graph)"] = lambda: torch.autograd.grad(rec, (q, k, v), dout, retain_graph=True)

    def timed_split():
        import time
        import cupy
        ts = []
        for _ in range(30):
            cupy.cuda.Device().synchronize()
            t0 = time.perf_counter()
            o = cupy_attn.scaled_dot_product_attention(q, k, v)
            t1 = time.perf_counter()
            torch.autograd.grad(o, (q, k, v), dout)
            t2 = time.perf_counter()
            ts.append((t1 - t0, t2 - t1))
        ts.sort(key=lambda x: x[0] + x[1])
        return ts[len(ts) // 2]
    print(f"({B},{H},{L},{D}) fp16, {plan}")
    print(f"step from idle {median_ms(step, 10, 3):.3f} ms, device {device_ms(step):.3f} ms")
    for name, fn in pieces.items():
        fn()
        print(f"  {name:42s} {host_us(fn, 50):8.1f} us", flush=True)
    f, g = timed_split()
    print(f"  in one step: forward {f * 1e6:.1f} us, then autograd.grad {g * 1e6:.1f} us")
    if "--inside" in sys.argv:  # time the backward's parts where they run (the autograd engine's device thread)
        import time
        spent: dict = {}

        stamps: list = []

        def timed(name, fn):
            def wrapper(*args, **kwargs):
                t = time.perf_counter()
                if name == "Function.backward":
                    stamps.append(t)
                try:
                    return fn(*args, **kwargs)
                finally:
                    spent[name] = spent.get(name, 0.0) + time.perf_counter() - t
                    if name == "Function.backward":
                        stamps.append(time.perf_counter())
            return wrapper
        fn_cls = autograd._function()
        saved = (fn_cls.backward, autograd.backward_key, autograd.BackwardEntry.__call__)
        fn_cls.backward = staticmethod(timed("Function.backward", saved[0]))
        autograd.backward_key = timed("backward_key", saved[1])
        autograd.BackwardEntry.__call__ = timed("BackwardEntry call", saved[2])
        n = 200
        t_grad = 0.0
        before = after = 0.0
        for _ in range(n):
            torch.cuda.synchronize()
            t = time.perf_counter()
            torch.autograd.grad(rec, (q, k, v), dout, retain_graph=True)
            t_end = time.perf_counter()
            t_grad += t_end - t
            before += stamps[-2] - t
            after += t_end - stamps[-1]
        torch.cuda.synchronize()
        print(f"  grad call -> Function.backward starts {before / n * 1e6:.1f} us; its end -> grad returns "
              f"{after / n * 1e6:.1f} us")
        print(f"  autograd.grad {t_grad / n * 1e6:.1f} us: " + ", ".join(f"{k} {v / n * 1e6:.1f} us" for k, v in spent.items()))
        fn_cls.backward = staticmethod(saved[0])
        autograd.backward_key, autograd.BackwardEntry.__call__ = saved[1], saved[2]
    if "--cprofile" in sys.argv:
        import cProfile
        import pstats
        for name in ("prepared backward launch (pointers)", "autograd.grad alone (retain_graph)"):
            prof = cProfile.Profile()
            prof.enable()
            for _ in range(100):
                pieces[name]()
            prof.disable()
            torch.cuda.synchronize()
            print(name)
            pstats.Stats(prof).sort_stats("tottime").print_stats(14)
    if "--profile" in sys.argv:
        from torch.profiler import ProfilerActivity, profile
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(5):
                step()
            torch.cuda.synchronize()
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))


if __name__ == "__main__":
    main(*(int(x) for x in sys.argv[1:5] if x.isdigit()))
