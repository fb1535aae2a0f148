"""Run-time compilation of the kernels in ``cuda_src/``, through one persistent compile cache.

Every kernel family is declared once, as a :class:`KernelFamily`: the source file, a name-expression template, and the
table of template values (a product of named axes, optionally filtered). That one table drives two things:

* the launchers, which ask ``family.kernel(**values)`` for the instantiation they need: compiled for the device's
  arch (or the family's explicit ``arch``, e.g. sm_90a), loaded from the cache's cubin (``cupy.RawModule(path=...)``)
  or, when the cache directory cannot be used, from the cubin's bytes in memory; memoized per device;
* the CPU compile check (``python -m cupy_attn.compile``), which compiles **every** instantiation for the asked archs
  in parallel processes (runtime/compile_check.py).

Both go through :func:`compile_variant`: one NVRTC program per variant (one name expression, one arch) compiled with
``cupy.cuda.nvrtc`` directly (it needs no GPU and no driver, unlike CuPy's own compile helpers), stored as a cubin plus
a JSON with the lowered name and the ptxas report (registers, spills, stack, smem, performance warnings) in
:func:`cache_dir`. The key (:func:`variant_key`) is made of contents only, never of a path on this machine: the name
expression, the family's code, a hash of every file under ``cuda_src/`` (so an edit of a shared header recompiles), a
hash of the CUDA headers the kernels include (:func:`cuda_headers`), the options with their ``-I`` directories left
out, the arch and the NVRTC version. So the main job, the tests and the first call of a kernel on a GPU share compiles,
and so do every checkout and every environment of one user: each variant compiles once per user and machine.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import glob
import hashlib
import importlib
import itertools
import json
import os
import re
import secrets
import site
import sys
import time
import warnings
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, Sequence

from . import env

# Modules that declare kernel families; the compile check imports them all so that none is forgotten (tests/
# test_compile.py checks that every module of cupy_attn/attention/kernels/ is listed).
FAMILY_MODULES = tuple(f"cupy_attn.attention.kernels.{stem}" for stem in (
    "softmax", "flash_fwd", "flash_fwd_sm90", "bwd_rows", "flash_bwd", "flash_bwd_sm90", "flash_decode", "scores_sm90",
    "pv_sm90", "flash_fwd_d512_sm90", "gemm_3xtf32", "merge_states")) + ("cupy_attn.linear_bn_softmax.launch",
                                                          "cupy_attn.linear_bn_softmax.backward")

# Architectures every variant must compile for (the CI compile check): Ampere and Hopper.
DEFAULT_ARCHS = ("sm_80", "sm_90")

# Where compiled variants live; see cache_dir().
ENV_CACHE_DIR = "CUPY_ATTN_CACHE_DIR"

NEEDS_CUPY = "cupy_attn needs CuPy: pip install 'cupy_attn[cuda12]' (or [cuda13])"


def have_cupy() -> bool:
    """True when CuPy imports (the package itself imports without it; compiling and launching need it)."""
    try:
        import cupy  # noqa: F401
    except ImportError:
        return False
    return True


def cache_dir() -> Path:
    """The compile cache: ``$CUPY_ATTN_CACHE_DIR``, else ``$XDG_CACHE_HOME/cupy_attn``, else ``~/.cache/cupy_attn``.

    Read on every call (not memoized), so a test or a benchmark can point it at a temporary directory.
    """
    if d := env.get(ENV_CACHE_DIR):
        return Path(d)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "cupy_attn"


def cache_dir_origin() -> str:
    """What chose :func:`cache_dir`: ``"$CUPY_ATTN_CACHE_DIR"``, ``"$XDG_CACHE_HOME"`` or ``"the default"``."""
    if env.get(ENV_CACHE_DIR):
        return f"${ENV_CACHE_DIR}"
    return "$XDG_CACHE_HOME" if os.environ.get("XDG_CACHE_HOME") else "the default"


def source_dir() -> Path:
    """The kernel sources: ``cupy_attn/cuda_src`` when installed, ``<repo>/cuda_src`` in a source tree."""
    package = Path(__file__).resolve().parent.parent
    for candidate in (package / "cuda_src", package.parent / "cuda_src"):
        if candidate.is_dir():
            return candidate
    raise FileNotFoundError(f"cupy_attn: kernel sources not found next to {package}")


@functools.lru_cache(maxsize=None)
def source_hash() -> str:
    """sha256 (16 hex digits) over every ``.cu``/``.cuh`` file under the source dir, paths included."""
    root = source_dir()
    digest = hashlib.sha256()
    for path in sorted(p for p in root.rglob("*") if p.suffix in (".cu", ".cuh")):
        digest.update(str(path.relative_to(root)).encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


@functools.lru_cache(maxsize=None)
def cuda_include_dirs() -> tuple[str, ...]:
    """Directories holding ``cuda_fp16.h``/``cuda_bf16.h``: the nvidia wheels (CUDA 12 and 13 layouts), then CUDA_PATH.

    The headers come from ``nvidia-cuda-runtime-cu12`` (``nvidia/cuda_runtime/include``) or CUDA 13's
    ``nvidia-cuda-runtime`` (``nvidia/cu13/include``); a toolkit install is found through ``CUDA_PATH``/``CUDA_HOME``.
    """
    roots = list(site.getsitepackages()) + [site.getusersitepackages()] + sys.path
    found: list[str] = []
    for root in roots:
        for pattern in ("nvidia/cuda_runtime/include", "nvidia/cu13/include", "nvidia/cuda_nvrtc/include"):
            for d in glob.glob(os.path.join(root, pattern)):
                if os.path.isdir(d) and d not in found:
                    found.append(d)
    for var in ("CUDA_PATH", "CUDA_HOME"):
        d = os.environ.get(var)
        if d and os.path.isdir(os.path.join(d, "include")):
            found.append(os.path.join(d, "include"))
    if os.path.isdir("/usr/local/cuda/include"):
        found.append("/usr/local/cuda/include")
    return tuple(dict.fromkeys(found))


_INCLUDE = re.compile(rb'#[ \t]*include[ \t]*[<"]([^>"\n]+)[>"]')


@functools.lru_cache(maxsize=None)
def cuda_headers() -> tuple[tuple[str, str | None, str | None], ...]:
    """The CUDA headers the kernels can include, as NVRTC would find them: ``(name, file, sha256)`` for each, sorted.

    Starts from the ``#include``s of ``cuda_src/`` that are not files of ``cuda_src/`` (``cuda_fp16.h``,
    ``cuda_bf16.h``), finds each in :func:`cuda_include_dirs` in order (a quoted include first next to the header that
    includes it), and follows their own includes. Every ``#include`` line counts, whatever ``#if`` it sits under, so
    the set holds at least what NVRTC reads. A name found nowhere (a host header such as ``stdlib.h``, under
    ``#ifndef __CUDACC_RTC__``) is listed with ``None``. The cache key uses the hashes, not the paths: two environments
    whose headers have the same contents share compiled kernels (:func:`cuda_headers_hash`).
    """
    root = source_dir()
    dirs = [Path(d) for d in cuda_include_dirs()]
    todo: list[tuple[str, Path | None]] = []
    for path in sorted(p for p in root.rglob("*") if p.suffix in (".cu", ".cuh")):
        for m in _INCLUDE.finditer(path.read_bytes()):
            name = m.group(1).decode()
            if not (path.parent / name).is_file() and not (root / name).is_file():
                todo.append((name, None))
    found: dict[tuple[str, str | None], str | None] = {}  # (name, file) -> sha256
    while todo:
        name, here = todo.pop()
        file = next((c for c in ([here / name] if here else []) + [d / name for d in dirs] if c.is_file()), None)
        if (name, str(file) if file else None) in found:
            continue
        if file is None:
            found[(name, None)] = None
            continue
        data = file.read_bytes()
        found[(name, str(file))] = hashlib.sha256(data).hexdigest()
        todo.extend((m.group(1).decode(), file.parent) for m in _INCLUDE.finditer(data))
    return tuple(sorted(((name, file, sha) for (name, file), sha in found.items()), key=lambda t: (t[0], t[2] or "")))


@functools.lru_cache(maxsize=None)
def cuda_headers_hash() -> str:
    """sha256 (16 hex digits) over the names and contents of :func:`cuda_headers` (not where they were found)."""
    digest = hashlib.sha256()
    for name, _, sha in cuda_headers():
        digest.update(f"{name}\0{sha}\0".encode())
    return digest.hexdigest()[:16]


def base_options() -> tuple[str, ...]:
    """NVRTC options shared by every kernel (built in this one place)."""
    return (
        "-std=c++17",
        f"-I{source_dir()}",
        *(f"-I{d}" for d in cuda_include_dirs()),
        f"-DCUPY_ATTN_SRC_HASH=0x{source_hash()}",
    )


class KernelCompileError(RuntimeError):
    """NVRTC rejected a kernel variant; the message carries the variant's name and the NVRTC log."""


@dataclasses.dataclass(frozen=True, eq=False)  # hashed by identity: one declared object per family
class KernelFamily:
    """One ``.cu`` file's templates and the declared table of their instantiations.

    name:      short family name (``"softmax"``), used in reports and error messages.
    source:    file under ``cuda_src/``.
    template:  ``str.format`` pattern giving a name expression from one row of the table, e.g.
               ``"masked_softmax<{out_t}, {tile[0]}, {tile[1]}>"``.
    axes:      the table: every combination of the axes' values (``itertools.product``) is one instantiation...
    where:     ...unless this predicate on the row returns False.
    archs:     architectures the compile check covers for this family.
    options:   extra NVRTC options for this family.
    structs:   the kernel parameter structs and their NumPy declarations, checked against each other when compiled.
    arch:      None: compiled for the device's own arch (``sm_XY`` from its compute capability). An explicit
               target such as ``"sm_90a"`` (wgmma, which ``-arch=sm_90`` cannot assemble) is always compiled for it.
    """

    name: str
    source: str
    template: str
    axes: Mapping[str, Sequence[Any]]
    where: Callable[[dict], bool] | None = None
    archs: tuple[str, ...] = DEFAULT_ARCHS
    options: tuple[str, ...] = ()
    arch: str | None = None
    structs: tuple = ()  # (C++ struct name, NumPy structured dtype): layouts asserted at compile time (runtime.structs)

    def variants(self) -> Iterator[dict]:
        keys = list(self.axes)
        for values in itertools.product(*(self.axes[k] for k in keys)):
            row = dict(zip(keys, values))
            if self.where is None or self.where(row):
                yield row

    def name_expression(self, **row: Any) -> str:
        return self.template.format(**row)

    def name_expressions(self) -> list[str]:
        return [self.name_expression(**row) for row in self.variants()]

    def code(self) -> str:
        """The source, with static_asserts that each declared parameter struct matches its NumPy declaration."""
        from .structs import layout_asserts
        asserts = "".join(f"\n{layout_asserts(ctype, dtype)}\n" for ctype, dtype in self.structs)
        return (source_dir() / self.source).read_text() + asserts

    def covers(self, arch: str) -> bool:
        """Whether ``python -m cupy_attn.compile --arch <arch>`` compiles this family: a family with an explicit
        ``arch`` only for that arch; the others for every plain ``sm_XY`` (not the arch-specific ``sm_XYa``)."""
        return arch == self.arch if self.arch else not arch.endswith("a")

    def kernel(self, **row: Any):
        """The compiled ``cupy.RawKernel`` for one row of the table, on the current device (memoized)."""
        import cupy

        expr = self.name_expression(**row)
        if expr not in _declared(self):
            raise KeyError(f"{self.name}: {expr} is not in the declared table of {self.source}")
        return _load(self, expr, cupy.cuda.Device().id)


@functools.lru_cache(maxsize=None)
def _declared(family: KernelFamily) -> frozenset:
    return frozenset(family.name_expressions())


@functools.lru_cache(maxsize=None)
def _load(family: KernelFamily, expr: str, device_id: int):
    return load_variant(compile_variant(family, expr, target_arch(family, device_id)))


def load_variant(variant: CachedVariant):
    """Load a compiled cubin (or PTX) on the current device and return its kernel, a ``cupy.RawKernel``: from the
    cache's file, or from the bytes when the variant lives in memory (:func:`image_kernel`)."""
    import cupy

    if variant.image is None:
        return image_kernel(variant.data, variant.lowered_name)
    module = cupy.RawModule(path=str(variant.image))
    _CUBIN_MODULES.append(module)  # the module owns the loaded cubin: keep it as long as its kernels may run
    return module.get_function(variant.lowered_name)


_CUBIN_MODULES: list = []


def image_kernel(image: bytes, name: str):
    """The kernel ``name`` of a cubin (or PTX) given as bytes, loaded on the current device (cuModuleLoadData through
    ``cupy.cuda.function.Module.load``), as a ``cupy.RawKernel``. CuPy 14's RawModule takes a path or source code but
    no image, and a RawKernel cannot be handed a loaded function; RawKernel reads its function through the ``kernel``
    property only (its launch and its attributes, such as ``max_dynamic_shared_size_bytes``), so a subclass that
    overrides that property is a RawKernel in every other respect."""
    from cupy.cuda import function

    if not image.startswith(b"\x7fELF") and not image.endswith(b"\0"):
        image += b"\0"  # PTX is loaded as a C string
    module = function.Module()
    module.load(image)
    _CUBIN_MODULES.append(module)
    return _image_kernel_class()(module.get_function(name), name)


@functools.lru_cache(maxsize=None)
def _image_kernel_class():
    import cupy

    class ImageKernel(cupy.RawKernel):
        def __init__(self, function, name: str):
            super().__init__(None, name)
            self._function = function

        @property
        def kernel(self):
            return self._function

    return ImageKernel


# ---------------------------------------------------------------------------------------------------------------------
# CPU compile check: every variant of every family, through NVRTC directly (no driver, no GPU).

@dataclasses.dataclass
class VariantReport:
    family: str
    arch: str
    name_expression: str
    registers: int | None = None
    spill_bytes: int | None = None   # spill stores + spill loads
    stack_bytes: int | None = None
    smem_bytes: int | None = None
    perf_warnings: tuple[str, ...] = ()  # ptxas "Potential Performance Loss" codes, e.g. C7514 (serialized wgmma)


_ENTRY = re.compile(r"Compiling entry function '(\S+)' for '(\w+)'")
_PERF = re.compile(r"\((C\d+)\) Potential Performance Loss:.*in the function '(\S+)'")
_FRAME = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_REGS = re.compile(r"Used (\d+) registers(?:.*?(\d+) bytes smem)?")


def _parse_ptxas(log: str) -> dict[str, dict[str, int]]:
    out: dict[str, dict[str, int]] = {}
    current = None
    for line in log.splitlines():
        if m := _ENTRY.search(line):
            current = out.setdefault(m.group(1), {})
        elif current is not None and (m := _FRAME.search(line)):
            current["stack"] = int(m.group(1))
            current["spill"] = int(m.group(2)) + int(m.group(3))
        elif current is not None and (m := _REGS.search(line)):
            current["registers"] = int(m.group(1))
            current["smem"] = int(m.group(2) or 0)
        if m := _PERF.search(line):
            entry = out.setdefault(m.group(2), {})
            entry["perf"] = entry.get("perf", ()) + (m.group(1),)
    return out


@contextlib.contextmanager
def nvrtc_program(code: str, source: str, exprs, options, what: str):
    """An NVRTC program with ``exprs`` compiled under ``options`` (``-arch`` included), destroyed on exit; raises
    KernelCompileError with the NVRTC log (``what`` names the variant or file)."""
    from cupy.cuda import nvrtc

    prog = nvrtc.createProgram(code, source, (), ())
    try:
        for expr in exprs:
            nvrtc.addNameExpression(prog, expr)
        try:
            nvrtc.compileProgram(prog, list(options))
        except nvrtc.NVRTCError as exc:
            arch = next((o for o in options if o.startswith("-arch=")), "-arch=?")[6:]
            raise KernelCompileError(f"{what} for {arch} failed ({exc}):\n{nvrtc.getProgramLog(prog)}") from exc
        yield prog
    finally:
        nvrtc.destroyProgram(prog)


def all_families() -> list[KernelFamily]:
    """Every declared family, found by importing FAMILY_MODULES."""
    families: list[KernelFamily] = []
    for mod_name in FAMILY_MODULES:
        mod = importlib.import_module(mod_name)
        families.extend(v for v in vars(mod).values() if isinstance(v, KernelFamily))
    return families


# ---------------------------------------------------------------------------------------------------------------------
# The compile cache: one cubin and one JSON report per (name expression, arch), shared by every process on the machine.

@functools.lru_cache(maxsize=None)
def nvrtc_version() -> tuple[int, int]:
    from cupy.cuda import nvrtc
    return tuple(nvrtc.getVersion())


@functools.lru_cache(maxsize=None)
def nvrtc_archs() -> tuple[int, ...]:
    """The ``sm_XY`` numbers this NVRTC can target, e.g. (50, ..., 90, 100, 120) for NVRTC 12.9."""
    from cupy.cuda import nvrtc
    return tuple(nvrtc.getSupportedArchs())


def device_arch(device_id: int | None = None) -> str:
    """The target for a device: ``sm_XY`` from its compute capability, or ``compute_XY`` (PTX, which the driver
    compiles at load time) for the newest arch this NVRTC knows when the device is newer than NVRTC."""
    import cupy

    cc = int(cupy.cuda.Device(device_id).compute_capability)
    if cc in nvrtc_archs():
        return f"sm_{cc}"
    older = [a for a in nvrtc_archs() if a <= cc]
    if not older:
        raise KernelCompileError(f"NVRTC {nvrtc_version()} cannot target compute capability {cc}")
    return f"compute_{max(older)}"


def target_arch(family: KernelFamily, device_id: int | None = None) -> str:
    """The arch a family's kernels are compiled for on a device: the family's explicit ``arch``, else the device's."""
    return family.arch or device_arch(device_id)


# Bumped when an entry's layout changes, so that entries of another layout are never read.
CACHE_LAYOUT = "2"


def variant_key(family: KernelFamily, expr: str, arch: str) -> str:
    """sha256 (32 hex digits) of what decides the cubin, and of nothing that names this machine's paths: the cache's
    layout, the name expression, the family's code as compiled (its source file with the parameter-struct asserts
    appended, so a changed NumPy declaration recompiles), every file under ``cuda_src/`` (:func:`source_hash`), the
    CUDA headers the kernels include (:func:`cuda_headers_hash`, which stands for the ``-I`` directories), the other
    options, the arch and the NVRTC version. A second checkout, or a new environment with the same header contents,
    has the same keys and compiles nothing."""
    parts = [CACHE_LAYOUT, expr, family.source, _code_hash(family), source_hash(), cuda_headers_hash(),
             *_key_options(family, arch), str(nvrtc_version())]
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:32]


@functools.lru_cache(maxsize=None)
def _code_hash(family: KernelFamily) -> str:
    return hashlib.sha256(family.code().encode()).hexdigest()


def _variant_options(family: KernelFamily, arch: str) -> list[str]:
    # -Xptxas=-v only adds the register/spill report to the log; it is always on so that every cache entry has one.
    return [*base_options(), *family.options, f"-arch={arch}", "-Xptxas=-v"]


def _key_options(family: KernelFamily, arch: str) -> list[str]:
    """The compile options less the ``-I`` directories of base_options (the key holds their contents instead)."""
    machine = {f"-I{source_dir()}", *(f"-I{d}" for d in cuda_include_dirs())}
    return [o for o in _variant_options(family, arch) if o not in machine]


@dataclasses.dataclass(frozen=True)
class CachedVariant:
    """One compiled variant. ``image``: its cubin in the cache (``.ptx`` for a ``compute_XY`` target), or None when
    the cache directory could not be used and ``data`` holds the image in memory; ``compiled``: True when this call ran
    NVRTC, False when it was read from the cache; ``seconds``: NVRTC time when it was compiled (stored, so also given
    for cache hits)."""
    report: VariantReport
    image: Path | None
    lowered_name: str
    compiled: bool
    seconds: float
    data: bytes | None = dataclasses.field(default=None, repr=False)

    def image_bytes(self) -> bytes:
        return self.data if self.image is None else self.image.read_bytes()


class CompileCacheWarning(RuntimeWarning):
    """The compile cache directory cannot be used: kernels are compiled in memory, for this process only."""


# Variants compiled while the cache directory could not be used, by key, so that a process compiles each once; and the
# directories already warned about (one warning each per process).
_MEMORY: dict[str, CachedVariant] = {}
_UNUSABLE: dict[str, str] = {}


def compile_variant(family: KernelFamily, expr: str, arch: str) -> CachedVariant:
    """One name expression of ``family`` for ``arch``, from the cache or compiled by NVRTC and stored there.

    Entries are written to a temporary name and renamed (atomic), the JSON last, so concurrent processes never read
    half an entry; two processes missing the same variant at once both compile it and store it, the later rename
    winning (the cubins hold the same code; only NVRTC's numbering of internal symbols differs, which can change the
    size). An entry that does not read back whole (a JSON that does not parse or is of another layout, a cubin missing
    or of another size than its JSON records) is compiled again and replaced. When the cache directory cannot be made
    or written (a file, a read-only file system), the variant is kept in memory for this process and a
    :class:`CompileCacheWarning` names the directory, once. Raises KernelCompileError with the NVRTC log.
    """
    from cupy.cuda import nvrtc

    key = variant_key(family, expr, arch)
    if (hit := _lookup(key, arch)) is not None:
        return hit
    t0 = time.perf_counter()
    options = _variant_options(family, arch)
    with nvrtc_program(family.code(), family.source, [expr], options, f"compiling {family.source}: {expr}") as prog:
        log = nvrtc.getProgramLog(prog)
        data = nvrtc.getPTX(prog) if arch.startswith("compute_") else nvrtc.getCUBIN(prog)
        lowered = nvrtc.getLoweredName(prog, expr)
    seconds = time.perf_counter() - t0
    stats = _parse_ptxas(log).get(lowered, {})
    report = VariantReport(family.name, arch, expr, stats.get("registers"), stats.get("spill"), stats.get("stack"),
                           stats.get("smem"), tuple(stats.get("perf", ())))
    meta = {"layout": CACHE_LAYOUT, "lowered_name": lowered, "seconds": seconds, "image_bytes": len(data),
            "nvrtc": nvrtc_version(), "sources": source_hash(), "cuda_headers": cuda_headers_hash(),
            "report": dataclasses.asdict(report)}
    root = cache_dir()
    image = root / f"{key}{image_suffix(arch)}"
    if _store(root, image, root / f"{key}.json", data, json.dumps(meta, indent=1).encode()):
        return CachedVariant(report, image, lowered, True, seconds)
    _MEMORY[key] = CachedVariant(report, None, lowered, False, seconds, data)
    return dataclasses.replace(_MEMORY[key], compiled=True)


def image_suffix(arch: str) -> str:
    """The file suffix of a cached image: ``.ptx`` for a ``compute_XY`` target, ``.cubin`` otherwise."""
    return ".ptx" if arch.startswith("compute_") else ".cubin"


def _lookup(key: str, arch: str) -> CachedVariant | None:
    """The entry under ``key``, read from the cache (only when whole) or from this process's memory; else None."""
    root = cache_dir()
    image = root / f"{key}{image_suffix(arch)}"
    try:
        info = json.loads((root / f"{key}.json").read_bytes())
        if entry_whole(info, image.stat().st_size):
            report = VariantReport(**{**info["report"], "perf_warnings": tuple(info["report"]["perf_warnings"])})
            return CachedVariant(report, image, info["lowered_name"], False, info["seconds"])
    except (OSError, ValueError, KeyError, TypeError):
        pass  # missing, unreadable, damaged or of another layout: compile again
    return _MEMORY.get(key)


def entry_whole(info: dict, image_size: int | None) -> bool:
    """Whether a cache entry's JSON (``info``) and its image (``image_size`` bytes, None when missing) make a whole
    entry of this layout, the only kind that is read."""
    return info["layout"] == CACHE_LAYOUT and image_size == info["image_bytes"]


def _store(root: Path, image: Path, meta: Path, data: bytes, info: bytes) -> bool:
    """Write one entry, the image first; False (and the warning, once per directory) when the directory cannot be
    made or written."""
    try:
        root.mkdir(parents=True, exist_ok=True)
        _write_atomic(image, data)
        _write_atomic(meta, info)
    except OSError as exc:
        warn_unusable(root, f"{type(exc).__name__}: {exc.strerror or exc}")
        return False
    return True


def warn_unusable(root: Path, reason: str) -> None:
    """One CompileCacheWarning per process and directory: ``root`` cannot be used, for ``reason``."""
    if str(root) in _UNUSABLE:
        return
    _UNUSABLE[str(root)] = reason
    warnings.warn(f"cupy_attn: the compile cache {root} (from {cache_dir_origin()}) cannot be used ({reason}); "
                  f"kernels are compiled in memory, again in every process. Set {ENV_CACHE_DIR} to a writable "
                  f"directory to keep them.", CompileCacheWarning, stacklevel=3)


def _write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(f"{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    try:
        tmp.write_bytes(data)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise


def cached(family: KernelFamily, expr: str, arch: str) -> CachedVariant | None:
    """The cache entry (or this process's in-memory copy) of one variant when there is one (no compile), else None."""
    return _lookup(variant_key(family, expr, arch), arch)


def keep_in_memory(family: KernelFamily, expr: str, arch: str, variant: CachedVariant, reason: str | None) -> None:
    """Keep a variant that a compile worker could not store (its cache directory unusable, for ``reason``) for this
    process, and warn once about the directory."""
    warn_unusable(cache_dir(), reason or "a compile worker could not write there")
    _MEMORY[variant_key(family, expr, arch)] = dataclasses.replace(variant, compiled=False)


def unusable_reason() -> str | None:
    """Why this process found the cache directory unusable, or None."""
    return _UNUSABLE.get(str(cache_dir()))
