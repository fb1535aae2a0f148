"""Programmable attention: score_mod and mask_mod as CUDA C++ snippets that NVRTC compiles into a kernel.

    s_ij <- score_mod(s_ij, b, h, i, j, aux)      after scale, softcap and ALiBi (natural units)
    key j hidden from query i where mask_mod(b, h, i, j, aux) is false

A snippet is the body of a device function (FlexAttention's score_mod / mask_mod, Dong et al. 2024, written in CUDA
C++ instead of Python). :class:`AttentionMod` holds the snippets (and, optionally, their Python forms for the float64
reference and CPU inputs); :func:`bind` checks a call's aux arrays against it; :func:`mod_family` gives a kernel
family's instantiation with the mod appended to its source (cuda_src/common/user_mod.cuh documents the device side).
"""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import types
from typing import Any, Callable

import numpy as np

from ..runtime import interop
from ..runtime.compile import KernelCompileError, KernelFamily, base_options, nvrtc_program

# aux element dtypes -> the C++ pointee type the snippet reads.
AUX_C_TYPES = {"float32": "float", "float64": "double", "float16": "__half", "bfloat16": "__nv_bfloat16",
               "int32": "int", "int64": "long long", "int16": "short", "int8": "signed char", "uint8": "unsigned char",
               "bool": "bool"}

_SIGNATURES = {
    "score_mod": "float score(float score, int b, int h, int q_idx, int kv_idx, const Aux& aux)",
    "mask_mod": "bool mask(int b, int h, int q_idx, int kv_idx, const Aux& aux)",
    "score_mod_grad": "float score_grad(float score, int b, int h, int q_idx, int kv_idx, const Aux& aux)",
    "score_mod_aux_grad": "void score_aux_grad(float grad, float score, int b, int h, int q_idx, int kv_idx, "
                          "const Aux& aux)",
}
# aux dtypes that can get a gradient (aux.<name>_grad: an fp32 accumulator of the array's shape)
GRAD_DTYPES = ("float32", "float64", "float16", "bfloat16")


@dataclasses.dataclass(frozen=True, eq=False)
class AttentionMod:
    """A score_mod and/or mask_mod as CUDA C++ snippets, compiled once per aux layout and reused across calls.

    Each snippet is the body of a ``__device__`` function (``return ...;``) with these parameters in scope:

    - score_mod: ``float score`` (the scaled score s = scale·q·k after softcap and ALiBi, natural units), ``int b``
      (the flat batch index over the query's leading axes), ``int h`` (query head), ``int q_idx`` (query row),
      ``int kv_idx`` (key), ``const Aux& aux``; returns the new score.
    - mask_mod: ``b, h, q_idx, kv_idx, aux``; returns true where key kv_idx takes part (combined with attn_mask,
      is_causal and window_size: a key is visible only where all allow it).
    - score_mod_grad: as score_mod, returns d score_mod / d score (the backward's chain factor; a mod with
      score_mod and no score_mod_grad runs forward only).
    - score_mod_aux_grad: the gradients of aux arrays that require grad (a trainable bias table): the body of
      ``void score_aux_grad(float grad, float score, b, h, q_idx, kv_idx, const Aux& aux)``, called in the backward
      for every visible score with ``grad`` = d loss / d score_mod(score); it adds grad · d score_mod / d aux into
      ``aux.<name>_grad`` (float*, an fp32 array of aux.<name>'s shape, zeroed; nullptr for arrays that need no
      gradient), e.g. ``atomicAdd(&aux.table_grad[i], grad);``.
    - aux: the call's ``aux=`` arrays (a dict name -> array, or a tuple: names aux0, aux1, ...), each a pointer
      ``aux.<name>`` to its contiguous elements (float, __half, __nv_bfloat16, int, long long, ...) and, for
      arrays of n ≥ 1 axes, ``aux.<name>_shape[n]`` (int).

    reference_score_mod(score, b, h, q_idx, kv_idx, aux) and reference_mask_mod(b, h, q_idx, kv_idx, aux) are the
    same mods in Python on broadcast NumPy (or torch) arrays, aux a namespace of the host arrays: the float64
    reference and CPU inputs run them (a CPU call without them raises ValueError).

    fast_math (default True): the mod's kernels compile with NVRTC's ``-use_fast_math``, so the snippets' tanhf,
    expf, division and sqrt run as the hardware's approximations (tanhf as one ``tanh.approx.f32``, about 2^-11
    relative error; a division as a reciprocal and a multiply), as FlexAttention's Triton kernels divide, and denormals
    flush to zero. An accurate ``tanhf(score / 50.f)`` costs a division and a 20-instruction tanh per score: measured
    1.72 ms against 0.40 ms for the built-in softcap at (2, 16/8, 4096, 128) bf16 causal on an H200. The kernels' own
    arithmetic already uses the approximate exponentials; fp16/bf16 results stay within the suite's error rule.
    False: the snippets' math is IEEE-accurate.

    Example (ALiBi from a slope table): ``AttentionMod(score_mod="return score - aux.slopes[h] * fabsf(float(q_idx -
    kv_idx));")`` with ``aux={"slopes": slopes}``.

    Raises ValueError when neither snippet is given, a snippet is not a non-empty string, or score_mod_grad comes
    without score_mod; NVRTC errors in a snippet are raised by :meth:`validate` and by the first call, as ValueError
    with the compiler's log (line numbers within the snippet). Reading aux out of its bounds is the snippet's bug,
    not checked at run time: ``compute-sanitizer --tool memcheck python your_script.py`` names the kernel and the
    address.
    """

    score_mod: str | None = None
    mask_mod: str | None = None
    score_mod_grad: str | None = None
    score_mod_aux_grad: str | None = None
    reference_score_mod: Callable | None = None
    reference_mask_mod: Callable | None = None
    fast_math: bool = True

    def __post_init__(self):
        for name in ("score_mod", "mask_mod", "score_mod_grad", "score_mod_aux_grad"):
            text = getattr(self, name)
            if text is not None and (not isinstance(text, str) or not text.strip()):
                raise ValueError(f"{name} must be a non-empty string of CUDA C++ (a function body), got {text!r}")
        if self.score_mod is None and self.mask_mod is None:
            raise ValueError("AttentionMod needs score_mod, mask_mod or both")
        for name in ("score_mod_grad", "score_mod_aux_grad"):
            if getattr(self, name) is not None and self.score_mod is None:
                raise ValueError(f"{name} without score_mod")
        for name in ("reference_score_mod", "reference_mask_mod"):
            if getattr(self, name) is not None and not callable(getattr(self, name)):
                raise TypeError(f"{name} must be callable")

    @property
    def key(self) -> str:
        """A digest of the snippets (what the compiled code depends on besides the aux layout)."""
        text = "\0".join(x or "" for x in (self.score_mod, self.mask_mod, self.score_mod_grad,
                                          self.score_mod_aux_grad)) + ("" if self.fast_math else "\0accurate")
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    def validate(self, aux: Any = None) -> None:
        """Compile the snippets (for sm_80, no GPU needed) with the layout of ``aux`` (arrays of any kind, or None);
        ValueError with NVRTC's log when they do not compile."""
        _probe(self, _spec_of(named_aux(aux)))


@dataclasses.dataclass(frozen=True)
class BoundMod:
    """A mod with one call's aux arrays: ``arrays`` in the call's kind (contiguous CuPy on the GPU, NumPy on the
    CPU), ``spec`` their (name, dtype name, ndim) layout."""

    mod: AttentionMod
    names: tuple
    arrays: tuple
    spec: tuple
    block_mask: Any = None  # a BlockMask of the mod's mask_mod (create_block_mask), or None
    grads: tuple = ()  # the backward's: per aux array its fp32 gradient accumulator's address, or 0 (none)
    originals: tuple = ()  # the caller's aux objects (CPU torch tensors keep their autograd graph through them)
    mask_source: Any = None  # an attn_mask run as this mod (mask_as_mod): (the broadcast view, its kept axes)

    def host_aux(self, to_host: Callable, originals: bool = False) -> types.SimpleNamespace:
        arrays = self.originals if originals else self.arrays
        return types.SimpleNamespace(**{n: to_host(a) for n, a in zip(self.names, arrays)})


def as_mod(score_mod, mask_mod) -> AttentionMod | None:
    """The call's mods as one AttentionMod: ``score_mod`` may be an AttentionMod (then mask_mod must be None) or a
    snippet; ``mask_mod`` a snippet. Snippet strings are wrapped once per text (the compiled code is reused)."""
    if isinstance(score_mod, AttentionMod):
        if mask_mod is not None:
            raise ValueError("score_mod is an AttentionMod: put mask_mod into it, not beside it")
        return score_mod
    if score_mod is None and mask_mod is None:
        return None
    for name, x in (("score_mod", score_mod), ("mask_mod", mask_mod)):
        if x is not None and not isinstance(x, str):
            raise TypeError(f"{name} must be a CUDA C++ snippet (str) or cupy_attn.AttentionMod, got "
                            f"{type(x).__name__}")
    return _wrap(score_mod, mask_mod)


@functools.lru_cache(maxsize=256)
def _wrap(score_mod, mask_mod) -> AttentionMod:
    return AttentionMod(score_mod=score_mod, mask_mod=mask_mod)


def named_aux(aux) -> list:
    """The call's aux arrays as (name, array) pairs: a dict's items, a tuple's as aux0, aux1, ...; ValueError for
    names that are not C++ identifiers or that collide with another's _shape / _grad; TypeError for other kinds."""
    if aux is None:
        return []
    if isinstance(aux, dict):
        items = list(aux.items())
    elif isinstance(aux, (tuple, list)):
        items = [(f"aux{i}", a) for i, a in enumerate(aux)]
    else:
        raise TypeError(f"aux must be a dict of arrays or a tuple of arrays, got {type(aux).__name__}")
    for name, _ in items:
        if not isinstance(name, str) or not name.isidentifier() or name.startswith("_"):
            raise ValueError(f"aux names must be C++ identifiers without a leading underscore, got {name!r}")
    names = {n for n, _ in items}
    for name in names:
        for suffix in ("_shape", "_grad"):
            if name.endswith(suffix) and name[:-len(suffix)] in names:
                raise ValueError(f"aux name {name!r} collides with aux[{name[:-len(suffix)]!r}]'s {suffix[1:]} "
                                 f"field")
    return items


def _spec_of(items) -> tuple:
    spec = []
    for name, a in items:
        kind = interop.kind_of(a, f"aux[{name!r}]")
        dt = interop.dtype_of(a, kind)
        if dt.name not in AUX_C_TYPES:
            raise TypeError(f"aux[{name!r}] must be one of {', '.join(AUX_C_TYPES)}, got {dt}")
        spec.append((name, dt.name, len(a.shape)))
    return tuple(spec)


def bind(mod: AttentionMod, aux, ctx) -> BoundMod:
    """Check a call's aux arrays (kind and device as the query's) and hold them as the kernels read them."""
    items = named_aux(aux)
    spec = _spec_of(items)
    arrays = []
    for name, a in items:
        interop.check_like_query(f"aux[{name!r}]", a, ctx)
        if any(int(n) >= 1 << 31 for n in a.shape):
            raise ValueError(f"aux[{name!r}]: every axis must be < 2^31 (its shape reaches the snippet as int), got "
                             f"{tuple(a.shape)}")
        if ctx.on_gpu:
            with ctx.activate():
                c = ctx.as_cupy(a)
                arrays.append(c if c.flags.c_contiguous else ctx.contiguous(c))
        else:
            arrays.append(interop.to_numpy(a, interop.kind_of(a, name)))
    return BoundMod(mod, tuple(n for n, _ in items), tuple(arrays), spec, originals=tuple(a for _, a in items))


# ---------------------------------------------------------------------------------------------------------------------
# Code generation

def struct_name(mod: AttentionMod, spec: tuple) -> str:
    digest = hashlib.sha256(repr((mod.key, spec)).encode()).hexdigest()[:16]
    return f"Mod_{digest}"


def aux_dtype(spec: tuple) -> np.dtype:
    """The Aux struct's NumPy declaration, laid out as the C++ struct: per array a pointer (8 bytes, 8-aligned), for a
    floating array its gradient's pointer (``<name>_grad``, float*), and, with axes, its shape as int32s (32-bit
    index arithmetic in the snippets: 64-bit products per score cost the fused kernels registers); size a multiple
    of 8."""
    names, formats, offsets, at = [], [], [], 0
    for name, dt, ndim in spec:
        at = -(-at // 8) * 8
        names.append(name), formats.append(np.dtype(np.int64)), offsets.append(at)
        at += 8
        if dt in GRAD_DTYPES:
            names.append(f"{name}_grad"), formats.append(np.dtype(np.int64)), offsets.append(at)
            at += 8
        if ndim:
            names.append(f"{name}_shape"), formats.append(np.dtype((np.int32, (ndim,)))), offsets.append(at)
            at += 4 * ndim
    if not names:  # an empty C++ struct has size 1; keep one 8-byte placeholder on both sides
        names, formats, offsets, at = ["_unused"], [np.dtype(np.int64)], [0], 8
    return np.dtype({"names": names, "formats": formats, "offsets": offsets, "itemsize": -(-at // 8) * 8})


def source(mod: AttentionMod, spec: tuple) -> str:
    """The C++ struct ``cupy_attn::mods::<struct_name>`` appended to a kernel's source (common/user_mod.cuh)."""
    members = []
    for name, dt, ndim in spec:
        members.append(f"    const {AUX_C_TYPES[dt]}* {name};")
        if dt in GRAD_DTYPES:
            members.append(f"    float* {name}_grad;")
        if ndim:
            members.append(f"    int {name}_shape[{ndim}];")
    if not spec:
        members.append("    long long _unused;")
    parts = [f"namespace cupy_attn {{ namespace mods {{\nstruct {struct_name(mod, spec)} {{",
             f"  static constexpr bool kScore = {str(mod.score_mod is not None).lower()}, "
             f"kMask = {str(mod.mask_mod is not None).lower()}, "
             f"kScoreGrad = {str(mod.score_mod_grad is not None).lower()}, "
             f"kScoreAuxGrad = {str(mod.score_mod_aux_grad is not None).lower()};",
             "  struct Aux {", *members, "  };"]
    for field, default in (("score_mod", "return score;"), ("mask_mod", "return true;"),
                           ("score_mod_grad", "return 1.f;"), ("score_mod_aux_grad", "")):
        body = getattr(mod, field)
        parts.append(f"  static __device__ __forceinline__ {_SIGNATURES[field]} {{")
        if body is None:
            parts.append(f"    {default}")
        else:
            parts.append(f'#line 1 "{field}"')
            parts.append(body)
        parts.append("  }")
    parts.append("};\n}}  // namespace cupy_attn::mods\n")
    return "\n".join(parts)


def qualified(mod: AttentionMod, spec: tuple) -> str:
    return f"cupy_attn::mods::{struct_name(mod, spec)}"


@dataclasses.dataclass(frozen=True, eq=False)
class ModKernelFamily(KernelFamily):
    """A family whose source has one mod's struct appended (its name expressions name the struct)."""

    appendix: str = ""

    def code(self) -> str:
        from ..runtime.compile import source_dir
        from ..runtime.structs import layout_asserts
        asserts = "".join(f"\n{layout_asserts(ctype, dtype)}\n" for ctype, dtype in self.structs)
        return (source_dir() / self.source).read_text() + "\n" + self.appendix + asserts


_FAMILIES: dict = {}


def mod_family(base: KernelFamily, template: str, params_ctype: str, params_dtype: np.dtype, mod: AttentionMod,
               spec: tuple, axes: dict, name: str, where=None) -> ModKernelFamily:
    """The family of ``base``'s source with ``mod`` appended: ``template`` formats the rows of ``axes`` with
    ``{mod}`` = the struct's qualified name; the parameter struct ``params_ctype`` (ModParams<Base, Mod>) is
    checked against ``params_dtype``. One object per (base, mod, aux layout): its kernels are loaded once."""
    key = (base.name, name, mod.key, spec)
    fam = _FAMILIES.get(key)
    if fam is None:
        q = qualified(mod, spec)
        fam = ModKernelFamily(name=f"{name}[{struct_name(mod, spec)}]", source=base.source,
                              template=template.replace("{mod}", q), axes=axes, where=where, archs=base.archs,
                              options=base.options + (("-use_fast_math",) if mod.fast_math else ()), arch=base.arch,
                              structs=((params_ctype.replace("{mod}", q), params_dtype),),
                              appendix=source(mod, spec))
        _FAMILIES[key] = fam
    return fam


# KeyRanges (common/user_mod.cuh): a BlockMask's ranges as the fused kernels read them.
KEY_RANGES = np.dtype([("ranges", np.int64), ("stride_b", np.int64), ("stride_h", np.int64), ("block_rows", np.int64)])
# KeyRangeParams: the pre-pass's own fields.
KEY_RANGE_PARAMS = np.dtype([(n, np.int64) for n in ("ranges", "batch", "heads", "seqlen_q", "seqlen_k", "row_blocks",
                                                    "block_rows")])


def mod_params_dtype(base: np.dtype, spec: tuple, align: int = 8) -> np.dtype:
    """ModParams<Base, Mod>'s declaration: the base's fields at their offsets, then at sizeof(Base) mod_num_heads,
    the two KeyRanges (the forward's, the backward's) and the Aux struct; the size rounded up to the struct's
    alignment ``align`` (the base's: 64 for one holding tensor maps)."""
    aux = aux_dtype(spec)
    names = list(base.names) + ["mod_num_heads", "key_ranges", "query_ranges", "aux"]
    formats = [base.fields[n][0] for n in base.names] + [np.dtype(np.int64), KEY_RANGES, KEY_RANGES, aux]
    at, kr = base.itemsize, KEY_RANGES.itemsize
    offsets = [base.fields[n][1] for n in base.names] + [at, at + 8, at + 8 + kr, at + 8 + 2 * kr]
    size = -(-(offsets[-1] + aux.itemsize) // align) * align
    return np.dtype({"names": names, "formats": formats, "offsets": offsets, "itemsize": size})


def fill_aux(params: np.ndarray, bound: BoundMod, num_heads: int, key_ranges: bool = False,
             query_ranges: bool = False) -> None:
    """Write the call's aux pointers and shapes, the head count that splits the flat (batch, head) index and, with
    ``key_ranges`` (the fused forward kernels) / ``query_ranges`` (the Hopper backward), the BlockMask's tables when
    the call has one."""
    params["mod_num_heads"] = num_heads
    for i, ((name, dt, ndim), a) in enumerate(zip(bound.spec, bound.arrays)):
        params["aux"][name] = a.data.ptr
        if ndim:
            params["aux"][f"{name}_shape"] = a.shape
        if dt in GRAD_DTYPES and i < len(bound.grads):
            params["aux"][f"{name}_grad"] = bound.grads[i]
    bm = bound.block_mask
    for wanted, field, table, blocks, rows in (
            (key_ranges, "key_ranges", bm and bm.ranges, bm and bm.row_blocks, bm and bm.block_rows),
            (query_ranges, "query_ranges", bm and bm.query_ranges, bm and bm.key_blocks, bm and bm.key_block)):
        if wanted and bm is not None and table is not None:
            kr = params[field]
            kr["ranges"] = bm.as_cupy(table).data.ptr
            kr["stride_b"] = 0 if bm.batch == 1 else bm.heads * blocks
            kr["stride_h"] = 0 if bm.heads == 1 else blocks
            kr["block_rows"] = rows


def _probe(mod: AttentionMod, spec: tuple) -> None:
    """NVRTC-compile the mod's struct with a kernel that calls each function (sm_80: any NVRTC targets it)."""
    q = qualified(mod, spec)
    code = ('#include "common/user_mod.cuh"\n' + source(mod, spec) +
            f"\nextern \"C\" __global__ void cupy_attn_mod_probe(float* out, {q}::Aux aux) {{\n"
            f"  const int i = threadIdx.x;\n"
            f"  out[i] = {q}::score(out[i], 0, 0, i, i, aux) * {q}::score_grad(out[i], 0, 0, i, i, aux)"
            f" + ({q}::mask(0, 0, i, i, aux) ? 1.f : 0.f);\n"
            f"  {q}::score_aux_grad(out[i], out[i], 0, 0, i, i, aux);\n}}\n")
    try:
        with nvrtc_program(code, "user_mod", [], [*base_options(), "-arch=sm_80"], "the mod's snippets"):
            pass
    except KernelCompileError as exc:
        raise ValueError(f"score_mod / mask_mod do not compile: {exc}") from None


@functools.lru_cache(maxsize=256)
def checked(mod: AttentionMod, spec: tuple) -> bool:
    """Compile-check a (mod, aux layout) once per process: ValueError with NVRTC's log before any launch."""
    _probe(mod, spec)
    return True


# ---------------------------------------------------------------------------------------------------------------------
# The float64 reference's form

def reference_forms(bound: BoundMod | None, to_host: Callable, originals: bool = False):
    """(score_mod, mask_mod) Python callables for cupy_attn.reference with the call's aux bound (host arrays; with
    ``originals`` the caller's own objects, to_host applied), or (None, None) without a mod. ValueError when the mod
    has a snippet without its Python form."""
    if bound is None:
        return None, None
    mod = bound.mod
    missing = [n for n, snip, form in (("reference_score_mod", mod.score_mod, mod.reference_score_mod),
                                       ("reference_mask_mod", mod.mask_mod, mod.reference_mask_mod))
               if snip is not None and form is None]
    if missing:
        raise ValueError(f"the float64 reference (CPU inputs, backend='reference') runs a mod's Python form: pass an "
                         f"AttentionMod with {' and '.join(missing)}")
    aux = bound.host_aux(to_host, originals)
    score = None if mod.score_mod is None else functools.partial(_call_score, mod.reference_score_mod, aux)
    mask = None if mod.mask_mod is None else functools.partial(_call_mask, mod.reference_mask_mod, aux)
    return score, mask


def _call_score(fn, aux, score, b, h, q_idx, kv_idx):
    return fn(score, b, h, q_idx, kv_idx, aux)


def _call_mask(fn, aux, b, h, q_idx, kv_idx):
    return fn(b, h, q_idx, kv_idx, aux)


# ---------------------------------------------------------------------------------------------------------------------
# Block masks: where a mask_mod lets each block of query rows see keys, for the fused kernels to skip the rest

BLOCK_ROWS = 128  # the FA3-design kernel's mod tiles (flash_fwd_sm90.PERSISTENT_TILES: block_m)
KEY_BLOCK = 64    # the backward's table: query rows per 64 keys (the Hopper backward's key blocks are 64 or 128)


@dataclasses.dataclass(frozen=True, eq=False)
class BlockMask:
    """The keys a mask_mod lets each block of 128 query rows see: ``ranges`` (batch, heads, row_blocks, 4) int32 of the
    caller's kind, per block (first, last) visible key, (S, -1) for none, then the full run (full_first, full_last):
    the first key every row of the block sees and the last of the unbroken run of such keys from it, (S, -1) for
    none; ``query_ranges`` (batch, heads, key_blocks, 4), the same for each 64-key block with the roles swapped (the
    query rows that see some key of it, then the run of rows that see all of it; the backward's, None when made with
    backward=False). batch / heads 1: one entry for all (the mask does not depend on b / h). Made by
    :func:`create_block_mask`; passed as ``block_mask=`` with the same mask_mod and aux, the fused forward kernels
    visit only the key blocks from first to last and call the mask_mod only on those not inside the full run
    (FlexAttention's BlockMask idea, its partial and full blocks kept as two intervals per row block: blocks between
    first and last that the mask hides are still computed, and masked)."""

    ranges: Any
    batch: int
    heads: int
    seqlen_q: int
    seqlen_k: int
    mask_mod: str
    kind: str
    device_id: int | None
    query_ranges: Any = None  # (batch, heads, key_blocks, 4): the query rows that see some / all of each 64-key block
    block_rows: int = BLOCK_ROWS
    key_block: int = KEY_BLOCK

    @property
    def row_blocks(self) -> int:
        return -(-self.seqlen_q // self.block_rows)

    @property
    def key_blocks(self) -> int:
        return -(-self.seqlen_k // self.key_block)

    def as_cupy(self, table):
        return interop.CallContext(self.kind, self.device_id).as_cupy(table)

    def check(self, mod: AttentionMod, ctx, batch: int, heads: int, seqlen_q: int, seqlen_k: int) -> None:
        """ValueError unless this mask fits a call: its mask_mod, kind, device and sizes (batch and heads equal or
        broadcast)."""
        if mod.mask_mod is None or mod.mask_mod != self.mask_mod:
            raise ValueError("block_mask was made from another mask_mod than the call's (create_block_mask with the "
                             "call's mask_mod)")
        if (self.kind, self.device_id) != (ctx.kind, ctx.device_id):
            raise ValueError(f"block_mask lives on {self.kind} device {self.device_id}, the query on {ctx.kind} "
                             f"device {ctx.device_id}")
        if (self.seqlen_q, self.seqlen_k) != (seqlen_q, seqlen_k):
            raise ValueError(f"block_mask is for (L, S) = ({self.seqlen_q}, {self.seqlen_k}), the call has "
                             f"({seqlen_q}, {seqlen_k})")
        for name, table in (("ranges", self.ranges), ("query_ranges", self.query_ranges)):
            if table is not None and (len(table.shape) != 4 or int(table.shape[-1]) != 4):
                raise ValueError(f"block_mask.{name} must be (batch, heads, blocks, 4) int32 (create_block_mask's), "
                                 f"got shape {tuple(table.shape)}")
        if self.batch not in (1, batch) or self.heads not in (1, heads):
            raise ValueError(f"block_mask has batch {self.batch} and heads {self.heads}; the call needs 1 or {batch} "
                             f"and 1 or {heads}")


def create_block_mask(mask_mod, batch, heads, seqlen_q: int, seqlen_k: int, *, aux=None, like=None,
                      backward: bool = True) -> BlockMask:
    """The key range each block of 128 query rows sees under ``mask_mod`` (a snippet or an AttentionMod with one):

        first[b, h, r] = min { j : mask_mod(b, h, i, j) for some i in rows 128r ... 128r + 127 }, last = the max
        full_first[b, h, r] = min { j : mask_mod(b, h, i, j) for every i of those rows }, full_last = the last key
        of the unbroken run of such keys from full_first (the kernels skip the mask_mod on key blocks inside it)

    and, with ``backward`` (for calls that train: the Hopper backward's table, ``query_ranges``), the query rows that
    see some key of each block of 64 keys, the same way transposed. backward=False skips that second pre-pass.

    evaluated for b < batch, h < heads, i < seqlen_q, j < seqlen_k (batch or heads None: 1, the mask must then not
    depend on b or h). On the GPU a pre-pass kernel (mod_key_ranges, common/user_mod.cuh) tests keys from both ends of
    each row block until some row sees one, then walks the full run (each key's test stopping at the first row that
does not see it), so a band costs about its visible keys; CPU inputs evaluate the mod's
    Python form (reference_mask_mod). ``aux``: the arrays the mask_mod reads; ``like``: an array of the calls' kind
    and device (needed when aux is None). Reuse the result across calls with the same mask and the same aux
    *contents* (only the mask_mod's text is checked: ranges from other aux values skip keys they should not). The
    pre-pass runs on the current stream of ``like`` (torch's current stream, or CuPy's); calls on another stream
    must wait for it (the kernels' producer and consumers each read the ranges: unfinished ranges could hang them).

    Returns a :class:`BlockMask`. Raises ValueError for a mod without mask_mod, sizes < 0 (batch, heads < 1), no
    ``like`` and no aux, and the snippet's compile errors; TypeError as the call's aux checks.
    """
    mod = mask_mod if isinstance(mask_mod, AttentionMod) else as_mod(None, mask_mod)
    if mod is None or mod.mask_mod is None:
        raise ValueError("create_block_mask needs a mask_mod (a snippet or an AttentionMod with mask_mod)")
    B, H = 1 if batch is None else int(batch), 1 if heads is None else int(heads)
    if B < 1 or H < 1 or int(seqlen_q) < 0 or int(seqlen_k) < 0:
        raise ValueError(f"create_block_mask: batch and heads must be >= 1 (or None), lengths >= 0; got {batch}, "
                         f"{heads}, {seqlen_q}, {seqlen_k}")
    items = named_aux(aux)
    anchor = like if like is not None else (items[0][1] if items else None)
    if anchor is None:
        raise ValueError("create_block_mask: pass like= (an array of the calls' kind and device) when aux is None")
    ctx = interop.context_for(anchor, "like")
    bound = bind(mod, aux, ctx)
    checked(mod, bound.spec)
    L, S = int(seqlen_q), int(seqlen_k)
    tables = [None, None]
    for transposed in (False, True) if backward else (False,):
        if not ctx.on_gpu:
            tables[transposed] = interop.from_numpy(_host_ranges(bound, B, H, L, S, transposed), ctx.kind,
                                                    np.dtype(np.int32))
        else:
            tables[transposed] = _device_ranges(bound, ctx, B, H, L, S, transposed)
    return BlockMask(tables[0], B, H, L, S, mod.mask_mod, ctx.kind, ctx.device_id, query_ranges=tables[1])


def _host_ranges(bound: BoundMod, B: int, H: int, L: int, S: int, transposed: bool = False) -> np.ndarray:
    """The ranges from the mask_mod's Python form (CPU inputs; the tests' definition of the kernel's result):
    keys per 128 query rows, or ``transposed`` query rows per 64 keys; (first, last, full_first, full_last) as
    BlockMask says."""
    from .. import reference
    _, mask = reference_forms(bound, lambda a: a)
    block, rows, cols_n = (KEY_BLOCK, S, L) if transposed else (BLOCK_ROWS, L, S)
    nb = -(-rows // block)
    out = np.empty((B, H, nb, 4), np.int32)
    out[..., 0], out[..., 1], out[..., 2], out[..., 3] = cols_n, -1, cols_n, -1
    if L == 0 or S == 0:
        return out
    b, h, i, j = reference.mod_indices((B, H, L, S))
    seen = np.broadcast_to(np.asarray(mask(b, h, i, j), dtype=bool), (B, H, L, S))
    if transposed:
        seen = np.swapaxes(seen, 2, 3)
    for r in range(nb):
        block_seen = seen[:, :, r * block:(r + 1) * block]
        cols, every = block_seen.any(axis=2), block_seen.all(axis=2)  # (B, H, cols_n)
        has = cols.any(axis=-1)
        out[..., r, 0] = np.where(has, cols.argmax(axis=-1), cols_n)
        out[..., r, 1] = np.where(has, cols_n - 1 - cols[..., ::-1].argmax(axis=-1), -1)
        for x in np.ndindex(B, H):
            run = np.flatnonzero(every[x])
            if run.size:
                gaps = np.flatnonzero(~every[x][run[0]:])
                out[x + (r, 2)], out[x + (r, 3)] = run[0], run[0] + (gaps[0] if gaps.size else cols_n - run[0]) - 1
    return out


def key_range_family(bound: BoundMod):
    """mod_key_ranges<Mod, transposed> (common/user_mod.cuh) in a mod's own program (softmax.cu's source includes the
    header)."""
    from .kernels import softmax
    return mod_family(softmax.SOFTMAX_VARIANTS, "cupy_attn::mod_key_ranges<{mod}, {transposed}>",
                      "cupy_attn::ModParams<cupy_attn::KeyRangeParams, {mod}>",
                      mod_params_dtype(KEY_RANGE_PARAMS, bound.spec), bound.mod, bound.spec,
                      {"transposed": ("false", "true")}, "mod_key_ranges")


def _device_ranges(bound: BoundMod, ctx, B: int, H: int, L: int, S: int, transposed: bool = False):
    """The pre-pass's table on the call's stream: keys per 128 query rows, or ``transposed`` query rows per 64
    keys."""
    from ..runtime.launch import launch_struct
    block = KEY_BLOCK if transposed else BLOCK_ROWS
    nb = -(-(S if transposed else L) // block)
    with ctx.activate():
        native, ranges = ctx.empty((B, H, nb, 4), np.dtype(np.int32))
        if nb == 0:
            return native
        fam = key_range_family(bound)
        prm = np.zeros((), fam.structs[0][1])
        prm["ranges"], prm["batch"], prm["heads"], prm["seqlen_q"], prm["seqlen_k"] = ranges.data.ptr, B, H, L, S
        prm["row_blocks"], prm["block_rows"] = nb, block
        fill_aux(prm, bound, H)
        launch_struct(fam.kernel(transposed="true" if transposed else "false"), (nb, H, B), (256,), prm,
                      ctx.stream.ptr)
    return native


# ---------------------------------------------------------------------------------------------------------------------
# attn_mask as a mod: masked calls in the FA3-design kernel

_AXES = ("b", "h", "q_idx", "kv_idx")


@functools.lru_cache(maxsize=64)
def _mask_mod(kept: tuple, kind: str) -> AttentionMod:
    """The built-in mod reading a mask stored as its kept axes ``kept`` (of b, h, q_idx, kv_idx; the broadcast ones
    dropped), contiguous: bool -> mask_mod, float -> score_mod adding it."""
    terms = []
    for k, axis in enumerate(kept):
        name = _AXES[axis]
        terms.append(name if not terms else f"i * aux.mask_shape[{k}] + {name}")
    lines = ["long long i = 0;"] + [f"i = {t};" for t in terms]
    if kind == "bool":
        return AttentionMod(mask_mod="\n".join(lines + ["return aux.mask[i];"]))
    return AttentionMod(score_mod="\n".join(lines + ["return score + float(aux.mask[i]);"]),
                        score_mod_grad="return 1.f;")


def mask_as_mod(mask4, kind: str) -> BoundMod:
    """A call's attn_mask (a CuPy view broadcast to (B, H, L, S): stride 0 on broadcast axes) as a BoundMod for the
    fused kernels, without touching its data (the plan's; :func:`materialize` gives the arrays at launch): the
    built-in snippet indexing the mask's kept axes as one contiguous aux array. Bool masks hide keys (mask_mod),
    float masks add to the scores (score_mod); rows that see no key give 0, as on the split path."""
    kept = tuple(a for a in range(4) if mask4.shape[a] > 1 and mask4.strides[a] != 0) or (3,)
    mod = _mask_mod(kept, kind)
    spec = (("mask", interop.dtype_name(mask4.dtype), len(kept)),)
    checked(mod, spec)
    return BoundMod(mod, ("mask",), (), spec, mask_source=(mask4, kept))


def materialize(bound: BoundMod, p, ranges: str = "forward") -> BoundMod:
    """A mask_as_mod BoundMod with its aux array (the mask's kept axes: a view where contiguous, else a copy on the
    caller's allocator) and, for a bool mask, its BlockMask from the ranges pre-pass (:func:`create_block_mask`'s
    kernel over the kept batch and head axes): the forward's table (``ranges`` "forward") or the backward's
    ("backward"), all enqueued on the call's stream ``p.ctx``."""
    mask4, kept = bound.mask_source
    compact = mask4[tuple(slice(None) if a in kept else 0 for a in range(4))]
    ctx = p.ctx
    if not compact.flags.c_contiguous:
        with ctx.activate():
            compact = ctx.contiguous(compact)
    out = dataclasses.replace(bound, arrays=(compact,), mask_source=None)
    if bound.mod.mask_mod is None:  # a float mask: its -inf entries are not looked for
        return out
    B, H = (p.batch if 0 in kept else 1), (p.num_heads if 1 in kept else 1)
    L, S = p.seqlen_q, p.seqlen_k
    backward = ranges == "backward"
    table = _device_ranges(out, ctx, B, H, L, S, transposed=backward)
    bm = BlockMask(None if backward else table, B, H, L, S, bound.mod.mask_mod, ctx.kind, ctx.device_id,
                   query_ranges=table if backward else None)
    return dataclasses.replace(out, block_mask=bm)
