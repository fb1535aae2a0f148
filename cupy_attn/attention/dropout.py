"""Attention dropout's per-call randomness: the caller's generator checked, and one (seed, offset) pair drawn per call.

A call with ``dropout_p > 0`` draws two int64 values from the caller's generator on the call's device and stream, and
every kernel of the call (forward, then the backward that autograd runs later) reads them from that device array, so:

- torch tensors: ``torch.randint(2**62, (2,), dtype=torch.int64, device=query.device, generator=generator)`` on
  torch's current stream (``generator`` None: torch's default CUDA generator). Hence ``torch.manual_seed`` (or the
  generator's seed) reproduces a call, and under CUDA-graph capture the draw is captured as torch's own RNG ops are:
  each replay draws new values (the graph reads the generator's advancing Philox offset), and the captured kernels
  read them. A custom generator under capture must be registered with the graph, as for any torch RNG op.
- CuPy arrays (and other CUDA DLPack objects): ``cupy.random.randint`` on CuPy's current stream, from CuPy's global
  random state (``cupy.random.seed`` reproduces); ``generator`` must be None.
- CPU torch tensors: the CPU draw of ``generator`` (a CPU torch.Generator) or of torch's default CPU generator;
  NumPy arrays: ``generator`` a numpy.random.Generator, or None for NumPy's global state (``np.random.seed``).

The values are a Philox key and counter word (cupy_attn/philox.py gives the mask they define); they are drawn in
[0, 2^62) (CuPy: a power-of-two range needs no rejection loop, so no host synchronization), 2^62 values each.
"""
from __future__ import annotations

import sys

import numpy as np

from .. import philox
from ..runtime import interop

_HIGH = 1 << 62


def check_generator(generator, ctx) -> None:
    """TypeError/ValueError naming ``generator`` when it cannot serve a call of this context's kind and device."""
    if generator is None:
        return
    torch = sys.modules.get("torch")
    if ctx.kind in (interop.TORCH, interop.TORCH_CPU):
        if torch is None or not isinstance(generator, torch.Generator):
            raise TypeError(f"generator must be a torch.Generator or None for torch tensors, got "
                            f"{type(generator).__name__}")
        dev = generator.device
        want = "cuda" if ctx.kind == interop.TORCH else "cpu"
        if dev.type != want or (want == "cuda" and (dev.index or 0) != ctx.device_id):
            where = f"cuda:{ctx.device_id}" if want == "cuda" else "cpu"
            raise ValueError(f"generator is on {dev} but query is on {where}: pass a generator of the query's device")
    elif ctx.kind == interop.NUMPY:
        if not isinstance(generator, np.random.Generator):
            raise TypeError(f"generator must be a numpy.random.Generator or None for NumPy arrays, got "
                            f"{type(generator).__name__}")
    else:
        raise TypeError(f"generator must be None for CuPy / DLPack inputs (dropout draws from cupy.random's global "
                        f"state), got {type(generator).__name__}")


def draw(ctx, generator=None):
    """One call's rng pair: (native, array) — ``native`` the caller-kind object (a torch int64 tensor of shape (2,) for
    torch callers, the CuPy/NumPy array otherwise), ``array`` its CuPy view (GPU) or a NumPy int64 array (CPU).
    Enqueued on the call's stream; nothing synchronizes."""
    if ctx.kind in (interop.TORCH, interop.TORCH_CPU):
        t = torch_draw(f"cuda:{ctx.device_id}" if ctx.kind == interop.TORCH else "cpu", generator)
        return t, (ctx.as_cupy(t) if ctx.kind == interop.TORCH else t.numpy())
    if ctx.kind == interop.NUMPY:
        a = (generator.integers(0, _HIGH, size=2, dtype=np.int64) if generator is not None
             else np.random.randint(0, _HIGH, size=2, dtype=np.int64))
        return a, a
    import cupy
    with ctx.activate():
        a = cupy.random.randint(0, _HIGH, size=2, dtype=cupy.int64)
    return a, a


def torch_draw(device, generator=None):
    """The torch rule: one ``torch.randint`` of two int64 on ``device`` (torch's current stream), which torch.compile
    traces and CUDA graphs capture like any torch RNG op. TypeError for a generator that is not a torch.Generator."""
    torch = sys.modules["torch"]
    if generator is not None and not isinstance(generator, torch.Generator):
        raise TypeError(f"generator must be a torch.Generator or None for torch tensors, got "
                        f"{type(generator).__name__}")
    return torch.randint(_HIGH, (2,), dtype=torch.int64, device=device, generator=generator)


def as_array(ctx, rng):
    """A given rng pair (torch tensor, CuPy or NumPy array of 2 int64) as the problem's array: a CuPy view on the GPU,
    NumPy on the CPU (autograd's backward and the custom op hand the forward's pair back)."""
    if rng is None:
        raise ValueError("dropout_p > 0 needs the call's rng pair (two int64: seed, offset)")
    if not ctx.on_gpu:
        return np.asarray(rng.detach().numpy() if hasattr(rng, "detach") else rng, dtype=np.int64).reshape(2)
    view = ctx.as_cupy(rng.detach() if hasattr(rng, "detach") else rng)
    if view.dtype != np.int64 or view.size != 2 or not view.flags.c_contiguous:
        raise ValueError(f"rng must be two contiguous int64 values (seed, offset), got {view.dtype} {view.shape}")
    return view.reshape(2)


def values(rng) -> tuple[int, int]:
    """(seed, offset) as Python ints from an rng pair of any kind (a device read: for checks and the reference)."""
    if hasattr(rng, "detach"):
        rng = rng.detach().cpu().numpy()
    elif type(rng).__module__.startswith("cupy"):
        import cupy
        rng = cupy.asnumpy(rng)
    rng = np.asarray(rng).reshape(-1)
    return int(rng[0]), int(rng[1])


def keep_mask(rng, shape: tuple[int, ...], p: float) -> np.ndarray:
    """The keep mask (bool, ``shape`` = (..., Hq, L, S)) that a call with this rng pair and dropout_p applies: the
    test and reference helper (cupy_attn/philox.py computes it; every kernel reproduces it bit for bit)."""
    seed, offset = values(rng)
    return philox.keep_mask(seed, offset, tuple(shape), p)
