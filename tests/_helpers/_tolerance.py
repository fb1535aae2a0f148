"""Accuracy rule shared by the GPU tests.

A low-precision result passes when its max error against the float64 reference is at most about twice the error of
the same computation done by torch in the same precision, plus rounding noise of the output dtype; NaN never passes
(unless the reference is NaN at exactly the same places).
"""
import numpy as np

EPS = {"float16": 2.0 ** -11, "bfloat16": 2.0 ** -8, "float32": 2.0 ** -24}


def as_f64(x) -> np.ndarray:
    if hasattr(x, "detach"):  # torch
        return x.detach().double().cpu().numpy()
    if type(x).__module__.startswith("cupy"):
        import cupy
        return cupy.asnumpy(x.astype(cupy.float64))
    return np.asarray(x, dtype=np.float64)


def max_err(out, ref) -> float:
    d = np.abs(as_f64(out) - ref)
    return float(np.nanmax(d)) if d.size else 0.0


def assert_close(out, ref, dtype: str, torch_out=None, what: str = "") -> None:
    out = as_f64(out)
    assert out.shape == ref.shape, f"{what}: shape {out.shape} != reference {ref.shape}"
    nan_out, nan_ref = np.isnan(out), np.isnan(ref)
    if (nan_out != nan_ref).any():
        idx = np.argwhere(nan_out != nan_ref)[:5].tolist()
        raise AssertionError(f"{what}: NaN where the reference has none (or the reverse) at {idx}")
    ok = ~nan_ref
    if not ok.any():
        return
    err = np.abs(out - ref)[ok]
    noise = 4 * EPS[dtype] * max(1.0, float(np.abs(ref[ok]).max()))
    torch_err = max_err(torch_out, ref) if torch_out is not None else 4 * EPS[dtype]
    bound = 2 * torch_err + noise
    if err.max() > bound:
        bad = np.argwhere(np.abs(out - ref) > bound)[:5].tolist()
        raise AssertionError(f"{what}: max err {err.max():.3g} (mean {err.mean():.3g}) > bound {bound:.3g} "
                             f"(torch err {torch_err:.3g}); first mismatches at {bad}")
