"""Host time of replaying each family's prepared launch, the driver calls replaced by no-ops (CPU; a comparison of two
versions of the launch code on one machine, not a measurement of a GPU call): what a call-cache hit pays on top of
the driver. Builds the launches as tests/_helpers/_launch_capture.py's cases do.

    PYTHONPATH=. python tests/_helpers/_host_replay.py
"""
import sys
import timeit

sys.path.insert(0, __import__("os").path.dirname(__file__))

import _launch_capture as c  # noqa: E402


def noop(*args):
    return 0


def main():
    from _pytest.monkeypatch import MonkeyPatch
    from cupy.cuda import driver

    rows = {}

    def timed(name, fn, n=20000):
        fn()
        best = float("inf")
        for _ in range(7):
            best = min(best, timeit.timeit(fn, number=n) / n * 1e9)
            rec.log.clear()
        rows[name] = best

    mp = MonkeyPatch()
    try:
        rec = c.Recorder(mp)
        mp.setattr(driver, "launchKernel", noop)
        for mod in c._launch_modules():
            if hasattr(mod, "_cu_launch_kernel_ex"):
                mp.setattr(mod, "_cu_launch_kernel_ex", lambda: noop)
        from cupy_attn.attention import checks, dispatch
        from cupy_attn.attention.kernels import (flash_bwd, flash_bwd_sm90, flash_decode, flash_fwd_sm90, gemm_3xtf32,
                                                 pv_sm90, scores_sm90)
        F16 = c.F16
        q, k, v, o = c._qkvo(2, 8, 2, 100, 300, 64, 64, F16)
        lse = c.FakeArray((2, 8, 100), c.F32, c.LSE)
        ptrs = c._ptrs(q, k, v, o, lse, None)
        rec.cc = 90
        run = dispatch.fused_launch(q, k, v, o, lse, scale=0.1).bind(c.FakeStream(c.STREAM))
        timed("flash replay (bound)", lambda: run(*ptrs))
        prob = checks.array_problem(q, k, v, o, lse, scale=0.1, ctx=c.FakeCtx())
        fa3 = flash_fwd_sm90.build(prob, flash_fwd_sm90.choose(prob, "3"), o, lse)
        timed("fa3 replay", lambda: fa3.launch_on(c.STREAM, *ptrs))
        sc = scores_sm90.build(prob, scores_sm90.choose(prob, 3), lse, ld=304)
        timed("scores launch_on", lambda: sc.launch_on(c.STREAM, c.Q, c.K, c.P_BUF, c.LSE, 0))
        pv_prob = checks.array_problem(q, k, v, o, scale=0.1, causal="top_left", ctx=c.FakeCtx())
        pv = pv_sm90.build(pv_prob, c.FakeArray((2, 8, 100, 64), F16, c.O), ld=304)
        timed("pv launch_on", lambda: pv.launch_on(c.STREAM, c.P_BUF, c.V, c.O))
        qd, kd, vd, od = c._qkvo(4, 8, 2, 1, 4096, 128, 128, F16)
        ld_ = c.FakeArray((4, 8, 1), c.F32, c.LSE)
        for env, splits in (("1", 1), ("1", 4), ("2", 3)):
            mp.setenv("CUPY_ATTN_DECODE", env)
            p = checks.SDPAProblem(ctx=c.FakeCtx(), query=qd, key=kd, value=vd, batch_shape=(4, 8), batch=4,
                                   num_heads=8, num_kv_heads=2, seqlen_q=1, seqlen_k=4096, head_dim=128,
                                   head_dim_v=128, dtype=F16, scale=0.1, causal=None)
            choice = flash_decode.choose(p, 90, 132, splits)
            drun = flash_decode.build(p, choice, od, ld_).bind(p.ctx.stream)
            dptrs = c._ptrs(qd, kd, vd, od, ld_, None)
            timed(f"decode {env} splits={splits}", lambda: drun(*dptrs))
        g = gemm_3xtf32.Gemm3xTF32(c_dtype=c.F32, ldc=300, stride_c=30000, a_dtype=c.F32, lda=64, stride_a=6400,
                                   trans_a=False, b_dtype=c.F32, ldb=64, stride_b=19200, trans_b=True, m=100, n=300,
                                   k=64, batch=3)
        timed("gemm_3xtf32 launch_on", lambda: g.launch_on(c.STREAM, c.O, c.Q, c.K))
        p = c._problem(B=2, Hq=4, Hkv=2, L=100, S=130, E=64, Ev=64)
        fb = flash_bwd.FlashBackward(p, 64)
        timed("flash backward call", lambda: fb(c.Q, c.K, c.V, c.O, c.LSE, c.O, c.O, c.K, c.V), n=5000)
        sb = flash_bwd_sm90.Sm90Backward(p, 64)
        timed("sm90 backward call", lambda: sb(c.Q, c.K, c.V, c.O, c.LSE, c.O, c.O, c.K, c.V), n=5000)
    finally:
        mp.undo()
    for name, ns in rows.items():
        print(f"{name:32s} {ns / 1000:7.2f} us")


if __name__ == "__main__":
    main()
