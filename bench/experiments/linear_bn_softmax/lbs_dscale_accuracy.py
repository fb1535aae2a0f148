"""CPU study of the Linear-BN-softmax backward's accuracy in 16-bit dtypes (no GPU): the fused kernels' arithmetic
emulated in NumPy float32 on the inputs tests/test_linear_bn_softmax.py builds, against float64 and torch-CPU in the
dtype (which reproduced the GPU torch errors of the failing tests to two digits).

    PYTHONPATH=. python3 bench/experiments/linear_bn_softmax/lbs_dscale_accuracy.py            # the six failing test ids, then 80 random cases
    PYTHONPATH=. python3 bench/experiments/linear_bn_softmax/lbs_dscale_accuracy.py --quick    # the failing ids only

Prints, per case, out's and a one-element scale's gradient error for: ours with delta = rowsum(dout∘out) (v1) and
with delta / rowsum(out) (v2), each in float32 (the kernels' order of operations) and in float64 from the same rounded
y and out; torch's error; the test's bound (2× torch + an ulp) and its y-rounding noise (_y_rounding_noise).
"""
import copy
import os
import sys
import zlib

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
sys.path.insert(0, os.path.join(ROOT, "tests", "_helpers"))  # the tests' helpers
sys.path.insert(0, os.path.join(ROOT, "tests"))  # test_linear_bn_softmax; cupy_attn from PYTHONPATH

import ml_dtypes  # noqa: E402
import torch  # noqa: E402

import test_linear_bn_softmax as T  # noqa: E402

F32 = np.float32
NP_DTYPE = {"bfloat16": np.dtype(ml_dtypes.bfloat16), "float16": np.dtype(np.float16)}


def emulate(model, x, g, training, dtype, normalized, f64=False):
    """(out, dscale) of the fused forward and backward on the model's values: y = fp32 GEMM rounded to the dtype,
    the one-FMA row softmax (a·y + b in log2 units, exp2, · 1/l) rounded to the dtype, then delta, dz, A, B and
    Σ_f γ·B + β·A in float32 (or float64 with f64, from the same rounded y and out)."""
    acc = np.float64 if f64 else F32
    s = {k: T._np(v) for k, v in T._state(model).items()}
    xs, gs = T._np(x), T._np(g)
    n, f = gs.shape
    y = (xs @ s["weight"].T).astype(F32).astype(NP_DTYPE[dtype]).astype(F32)
    bias = np.zeros(f, F32) if s["bias"] is None else s["bias"].astype(F32)
    gamma = np.ones(f, F32) if s["bn_weight"] is None else s["bn_weight"].astype(F32)
    beta = np.zeros(f, F32) if s["bn_bias"] is None else s["bn_bias"].astype(F32)
    sc = np.broadcast_to(s["scale"].reshape(-1).astype(F32), (f,))
    if training or s["running_mean"] is None:
        mu, var = y.astype(np.float64).mean(0).astype(F32), y.astype(np.float64).var(0).astype(F32)
    else:
        mu, var = (s["running_mean"].astype(F32) - bias), s["running_var"].astype(F32)
    invstd = (F32(1) / np.sqrt(var + F32(model.bn.eps))).astype(F32)
    log2e = F32(1.4426950408889634)
    a, d = gamma * invstd * (sc * log2e), beta * (sc * log2e)
    b = (d - a.astype(np.float64) * mu).astype(F32)
    z = (a.astype(np.float64) * y + b).astype(F32)
    e = np.exp2((z - z.max(1, keepdims=True)).astype(np.float64)).astype(F32)
    out = (e * (F32(1) / e.sum(1, keepdims=True, dtype=F32))).astype(NP_DTYPE[dtype]).astype(F32)
    o, gg, yv = out.astype(acc), gs.astype(acc), y.astype(acc)
    delta = (gg * o).sum(1, keepdims=True, dtype=acc)
    if normalized:
        delta = delta / o.sum(1, keepdims=True, dtype=acc)
    dz = o * (gg - delta)
    yh = (yv - mu) * invstd.astype(acc)
    big_a, big_b = dz.sum(0, dtype=acc), (dz * yh).sum(0, dtype=acc)
    return out, (gamma.astype(acc) * big_b + beta.astype(acc) * big_a).sum(dtype=acc)


def case(model, x, g, dtype, training, label):
    ref_model = copy.deepcopy(model).double()
    ref_out, ref = T._model_grads(copy.deepcopy(ref_model), x.double(), g.double())
    t_out, theirs = T._model_grads(copy.deepcopy(model), x, g)
    p = ref_out.detach().numpy()
    use_batch_stats = training or model.bn.running_mean is None
    out_noise, noise = T._y_rounding_noise(ref_model, x, g, p, dtype, use_batch_stats)
    err_t = np.abs(t_out.detach().double().numpy() - p)
    row = {"label": label}
    for name, kw in (("v1", dict(normalized=False)), ("v2", dict(normalized=True)),
                     ("v1 f64", dict(normalized=False, f64=True)), ("v2 f64", dict(normalized=True, f64=True))):
        out, ds = emulate(model, x, g, training, dtype, **kw)
        row[name] = abs(float(ds) - ref["scale"].item()) if model.scale.numel() == 1 else float("nan")
        if name == "v2":
            err = np.abs(out - p)
            bound = 2 * err_t.max() + T.ULP[dtype] * np.abs(p).max()
            row["out"], row["out_t"] = err.max(), err_t.max()
            row["out/bound"], row["out/bound+noise"] = (err / bound).max(), (err / (bound + out_noise)).max()
    if model.scale.numel() == 1:
        row["torch"] = abs(theirs["scale"].double().item() - ref["scale"].item())
        row["bound"] = 2 * row["torch"] + T.ULP[dtype] * abs(ref["scale"].item())
        row["noise"] = noise["scale"]
    return row


def failing_ids():
    rows = []
    for shape, config, dtype in (((33, 17, 129), "default", "bfloat16"), ((33, 17, 129), "scale_F", "bfloat16"),
                                 ((70, 40, 1000), "default", "bfloat16"), ((70, 40, 1000), "affine=False", "bfloat16")):
        n, k, f = shape
        _, model_kw, scale_shape = T.GRAD_CONFIGS[T._CONFIG_NAMES.index(config)]
        gen = torch.Generator().manual_seed(zlib.crc32(repr((shape, config, dtype, False)).encode()))
        model = T._grad_model(k, f, model_kw, scale_shape, gen).to(T.DTYPES[dtype]).eval()
        x = (torch.randn(n, k, generator=gen) * 2).to(T.DTYPES[dtype])
        g = torch.randn(n, f, generator=gen).to(T.DTYPES[dtype])
        rows.append(case(model, x, g, dtype, False, f"eval-{'x'.join(map(str, shape))}-{config}-{dtype}"))
    for dtype, config in (("bfloat16", "default"), ("float16", "affine=False")):  # five steps: step 0 only
        _, model_kw, scale_shape = T.GRAD_CONFIGS[T._CONFIG_NAMES.index(config)]
        gen = torch.Generator().manual_seed(zlib.crc32(repr((dtype, config)).encode()))
        model = T._grad_model(96, 264, model_kw, scale_shape, gen).to(T.DTYPES[dtype]).train()
        x = torch.randn(48, 96, generator=gen).to(T.DTYPES[dtype])
        g = torch.randn(48, 264, generator=gen).to(T.DTYPES[dtype])
        rows.append(case(model, x, g, dtype, True, f"five steps, step 0, {config}-{dtype}"))
    return rows


def random_cases(count=40):
    rows = []
    configs = ("default", "no_bias", "affine=False", "no_running_stats")
    for seed in range(count):
        for training in (True, False):
            for dtype in ("bfloat16", "float16"):
                n, k, f = ((70, 40, 1000), (33, 17, 129), (48, 96, 264))[seed % 3]
                config = configs[seed % len(configs)]
                _, model_kw, _ = T.GRAD_CONFIGS[T._CONFIG_NAMES.index(config)]
                gen = torch.Generator().manual_seed(5000 + seed)
                model = T._grad_model(k, f, model_kw, "1", gen).to(T.DTYPES[dtype]).train(training)
                x = (torch.randn(n, k, generator=gen) * 2).to(T.DTYPES[dtype])
                g = torch.randn(n, f, generator=gen).to(T.DTYPES[dtype])
                rows.append(case(model, x, g, dtype, training, dtype))
    return rows


def main():
    print("dscale errors (v1: delta = rowsum(dout·out); v2: / rowsum(out)); out: v2's forward")
    print(f"{'case':44s} {'v1':>9s} {'v2':>9s} {'v1 f64':>9s} {'v2 f64':>9s} {'torch':>9s} {'bound':>9s} "
          f"{'noise':>9s} {'out':>9s} {'out_t':>9s} {'o/bnd':>6s} {'o/b+n':>6s}")
    for r in failing_ids():
        print(f"{r['label']:44s} " + " ".join(f"{r.get(k, float('nan')):9.2e}" for k in
              ("v1", "v2", "v1 f64", "v2 f64", "torch", "bound", "noise", "out", "out_t"))
              + f" {r['out/bound']:6.2f} {r['out/bound+noise']:6.2f}")
    if "--quick" in sys.argv:
        return
    rows = random_cases()
    for dtype in ("bfloat16", "float16"):
        a = [r for r in rows if r["label"] == dtype]
        v1, v2, tt, bound, noise = (np.array([r[k] for r in a]) for k in ("v1", "v2", "torch", "bound", "noise"))
        print(f"{dtype}, {len(a)} random cases: median dscale error v1 {np.median(v1):.2e}, v2 {np.median(v2):.2e}, "
              f"torch {np.median(tt):.2e}; over 2x torch + ulp: v1 {np.mean(v1 > bound):.0%}, v2 "
              f"{np.mean(v2 > bound):.0%}; over that + noise: v1 {np.mean(v1 > bound + noise):.0%}, v2 "
              f"{np.mean(v2 > bound + noise):.0%} (v2 at most {np.max(v2 / (bound + noise)):.2f} of it); out over "
              f"its bound: {np.mean([r['out/bound'] > 1 for r in a]):.0%}, with noise "
              f"{np.mean([r['out/bound+noise'] > 1 for r in a]):.0%}")


if __name__ == "__main__":
    main()
