"""Run-time compilation of the kernels in ``cuda_src/``.

Every kernel family is declared once, as a :class:`KernelFamily`: the source file, a name-expression template, and the
table of template values (a product of named axes, optionally filtered). That one table drives three things:

* the launchers, which ask ``family.kernel(**values)`` for the instantiation they need (compiled lazily through
  ``cupy.RawModule`` with ``name_expressions``, memoized per device);
* the CPU compile check (``python -m cupy_attn.compile``), which compiles **every** instantiation for sm_80 and sm_90
  with ``cupy.cuda.nvrtc`` directly: NVRTC needs no GPU and no driver, unlike CuPy's own compile helpers;
* the cache key. CuPy's disk cache hashes the source string and the options but not the files they ``#include``, so a
  hash of every file under ``cuda_src/`` travels as a ``-D`` option and any edit of a shared header recompiles.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import glob
import hashlib
import importlib
import itertools
import os
import re
import site
import sys
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, Sequence

# Modules that declare kernel families; the compile check imports them all so that none is forgotten.
FAMILY_MODULES = ("cupy_attn.attention.split", "cupy_attn.attention.fused", "cupy_attn.attention.decode",
                  "cupy_attn.linear_bn_softmax.launch")

# Architectures every variant must compile for (the CI compile check): Ampere and Hopper.
DEFAULT_ARCHS = ("sm_80", "sm_90")


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


def base_options() -> tuple[str, ...]:
    """NVRTC options shared by every kernel (built in this one place)."""
    return (
        "-std=c++17",
        f"-I{source_dir()}",
        *(f"-I{d}" for d in cuda_include_dirs()),
        f"-DCUPY_ATTN_SRC_HASH=0x{source_hash()}",
    )


def struct_arg(params):
    """A by-value struct kernel argument from a NumPy structured array (0-d), passed by address.

    CuPy converts a structured NumPy scalar argument field by field through ``__array_interface__`` (~15 µs for a
    36-field struct, every launch); a ``CPointer`` to the array's bytes is taken as is, and cuLaunchKernel copies the
    bytes at launch. ``params`` must stay alive until the launch call returns (the caller holds it).
    """
    from cupy.cuda.function import CPointer
    return CPointer(params.ctypes.data)


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
    arch:      None: ``cupy.RawModule`` compiles for the device (its own ``-arch``). An explicit target such as
               ``"sm_90a"`` (wgmma, which CuPy's ``-arch=sm_90`` cannot assemble) is compiled here with NVRTC to a
               cubin and loaded from CuPy's cache directory (see _load_cubin).
    """

    name: str
    source: str
    template: str
    axes: Mapping[str, Sequence[Any]]
    where: Callable[[dict], bool] | None = None
    archs: tuple[str, ...] = DEFAULT_ARCHS
    options: tuple[str, ...] = ()
    arch: str | None = None

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
        return (source_dir() / self.source).read_text()

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
    import cupy

    if family.arch is not None:
        return _load_cubin(family, expr)
    options = base_options() + family.options
    module = cupy.RawModule(code=family.code(), options=options, name_expressions=(expr,))
    try:
        return module.get_function(expr)
    except cupy.cuda.compiler.CompileException as exc:
        raise KernelCompileError(f"compiling {family.source}: {expr} failed:\n{exc}") from exc


def _load_cubin(family: KernelFamily, expr: str):
    """Compile one instantiation for ``family.arch`` with NVRTC, cache the cubin on disk, load it with RawModule.

    Cache file: ``$CUPY_CACHE_DIR`` (default ``~/.cupy/kernel_cache``) / ``cupy_attn_<sha256>.cubin``, the hash taken
    over the name expression, arch, options (which carry the ``cuda_src/`` hash), the source and the NVRTC version;
    the lowered (mangled) kernel name is stored next to it.
    """
    import cupy
    from cupy.cuda import nvrtc

    options = list(base_options() + family.options) + [f"-arch={family.arch}"]
    code = family.code()
    key = hashlib.sha256("\0".join([expr, code, *options, str(nvrtc.getVersion())]).encode()).hexdigest()[:32]
    cache = Path(os.environ.get("CUPY_CACHE_DIR", Path.home() / ".cupy" / "kernel_cache"))
    cubin_path, name_path = cache / f"cupy_attn_{key}.cubin", cache / f"cupy_attn_{key}.name"
    if not (cubin_path.exists() and name_path.exists()):
        with _nvrtc_program(code, family.source, [expr], options, f"compiling {family.source}: {expr}") as prog:
            cubin, lowered = nvrtc.getCUBIN(prog), nvrtc.getLoweredName(prog, expr)
        cache.mkdir(parents=True, exist_ok=True)
        tmp = cubin_path.with_suffix(f".{os.getpid()}.tmp")  # rename is atomic: concurrent processes never read half
        tmp.write_bytes(cubin)
        os.replace(tmp, cubin_path)
        tmp.write_text(lowered)
        os.replace(tmp, name_path)
    module = cupy.RawModule(path=str(cubin_path))
    _CUBIN_MODULES.append(module)  # the module owns the loaded cubin: keep it as long as its kernels may run
    return module.get_function(name_path.read_text())


_CUBIN_MODULES: list = []


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


def compile_family(family: KernelFamily, arch: str) -> list[VariantReport]:
    """Compile every instantiation of ``family`` for ``arch`` (``"sm_80"``, ``"sm_90"``, ``"sm_90a"``) to a cubin.

    Raises KernelCompileError with the NVRTC log when the program does not compile.
    """
    from cupy.cuda import nvrtc

    exprs = family.name_expressions()
    options = list(base_options() + family.options) + [f"-arch={arch}", "-Xptxas=-v"]
    with _nvrtc_program(family.code(), family.source, exprs, options, family.source) as prog:
        info = _parse_ptxas(nvrtc.getProgramLog(prog))
        nvrtc.getCUBIN(prog)  # the cubin must be produced, not only PTX
        reports = []
        for expr in exprs:
            stats = info.get(nvrtc.getLoweredName(prog, expr), {})
            reports.append(VariantReport(family.name, arch, expr, stats.get("registers"), stats.get("spill"),
                                         stats.get("stack"), stats.get("smem"), stats.get("perf", ())))
        return reports


@contextlib.contextmanager
def _nvrtc_program(code: str, source: str, exprs, options, what: str):
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
