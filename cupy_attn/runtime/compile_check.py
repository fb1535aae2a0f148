"""The CPU compile check and the compile cache's tools: every variant of every kernel family through NVRTC (no GPU,
no driver), in parallel processes, with each variant's ptxas report (:func:`compile_all`, :func:`compile_family`);
one family as a whole cubin for disassembly (:func:`family_cubin`); what a cache directory holds
(:func:`cache_contents`); the first-call latency of one variant on a GPU (:func:`timed_load`).

``python -m cupy_attn.compile`` drives it; runtime/compile.py holds the families, the cache and the loading, which
the launchers use.
"""
from __future__ import annotations

import dataclasses
import json
import os
import time
import warnings
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping

from .compile import (CachedVariant, CompileCacheWarning, KernelCompileError, KernelFamily, VariantReport,
                      all_families, base_options, cache_dir, cached, compile_variant, entry_whole, image_suffix,
                      keep_in_memory, load_variant, nvrtc_program, target_arch, unusable_reason)


def compile_family(family: KernelFamily, arch: str, jobs: int | None = None) -> list[VariantReport]:
    """Every instantiation of ``family`` for ``arch`` (``"sm_80"``, ``"sm_90"``, ``"sm_90a"``), one report per row of
    the table in declaration order: read from the compile cache, compiling (``jobs`` processes) what is missing.

    Raises KernelCompileError with the NVRTC log of the first variant that does not compile.
    """
    results = compile_all([(family, expr, arch) for expr in family.name_expressions()], jobs=jobs)
    for r in results:
        if r.error is not None:
            raise KernelCompileError(r.error)
    return [r.report for r in results]


def family_cubin(family: KernelFamily, arch: str) -> bytes:
    """Every instantiation of ``family`` compiled for ``arch`` into one cubin, whole: for disassembly
    (``cuobjdump -sass``), which rejects CuPy 14's ``getCUBIN`` result (see :func:`whole_cubin`)."""
    options = list(base_options() + family.options) + [f"-arch={arch}"]
    with nvrtc_program(family.code(), family.source, family.name_expressions(), options, family.source) as prog:
        from cupy.cuda import nvrtc
        return whole_cubin(nvrtc.getCUBIN(prog))


def whole_cubin(cubin: bytes) -> bytes:
    """CuPy 14's ``nvrtc.getCUBIN`` drops the last byte (it strips a trailing NUL, as for PTX): pad the ELF image back
    to the size its headers give (the end of the section or program header table, whichever is last). The driver
    loads either; cuobjdump/nvdisasm need the whole file."""
    import struct
    if len(cubin) < 64 or cubin[:4] != b"\x7fELF":
        return cubin
    phoff, shoff = struct.unpack_from("<QQ", cubin, 0x20)
    phentsize, phnum, shentsize, shnum = struct.unpack_from("<HHHH", cubin, 0x36)
    size = max(len(cubin), phoff + phentsize * phnum, shoff + shentsize * shnum)
    return cubin + b"\0" * (size - len(cubin))


@dataclasses.dataclass(frozen=True)
class CompileResult:
    """The outcome of one (family, name expression, arch) in compile_all: ``report`` when it compiled, ``error``
    (the NVRTC log) when not; ``source`` is ``"compiled"`` or ``"cache"``; ``seconds`` the NVRTC time."""
    family: KernelFamily
    expr: str
    arch: str
    report: VariantReport | None
    error: str | None
    source: str
    seconds: float


def compile_all(variants: Iterable[tuple[KernelFamily, str, str]], jobs: int | None = None,
                progress: Callable[[CompileResult], None] | None = None) -> list[CompileResult]:
    """Compile (family, name expression, arch) variants into the cache, ``jobs`` NVRTC processes at a time
    (default ``os.cpu_count()``); one result per variant, in input order. ``progress`` is called as each finishes.

    Cache hits are read here without starting a pool. Misses are independent programs, so they compile in parallel
    ``spawn``ed processes (not forked: the caller may hold torch's or CuPy's threads) that only compile and store; this
    process then reads each report back from the cache (or, when the cache directory cannot be used, takes the variant
    the worker sends back). A family that FAMILY_MODULES does not declare (a test's own) compiles in this process.
    """
    variants = list(variants)
    results: list[CompileResult | None] = [None] * len(variants)

    def finish(i: int, variant: CachedVariant | None, error: str | None = None) -> None:
        family, expr, arch = variants[i]
        if variant is None:
            results[i] = CompileResult(family, expr, arch, None, error, "compiled", 0.0)
        else:
            results[i] = CompileResult(family, expr, arch, variant.report, None,
                                       "compiled" if variant.compiled else "cache", variant.seconds)
        if progress is not None:
            progress(results[i])

    missing = []
    for i, (family, expr, arch) in enumerate(variants):
        variant = cached(family, expr, arch)
        if variant is not None:
            finish(i, variant)
        else:
            missing.append(i)
    declared = {f.name: f for f in all_families()} if missing else {}
    pooled = [i for i in missing if declared.get(variants[i][0].name) is variants[i][0]]
    jobs = min(jobs or os.cpu_count() or 1, len(pooled))
    if jobs < 2:
        pooled = []
    for i in sorted(set(missing) - set(pooled)):
            finish(i, *_compile_or_error(*variants[i]))
    if pooled:
        import concurrent.futures
        import multiprocessing

        with concurrent.futures.ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
            futures = {pool.submit(_compile_in_worker, variants[i][0].name, *variants[i][1:]): i for i in pooled}
            for future in concurrent.futures.as_completed(futures):
                i = futures[future]
                error, in_memory, reason = future.result()
                if error is not None:
                    finish(i, None, error)
                elif in_memory is not None:  # the worker could not store it: keep its copy here
                    keep_in_memory(*variants[i], in_memory, reason)
                    finish(i, in_memory)
                else:  # the worker stored it: read the report back, nothing compiles here...
                    variant = cached(*variants[i])
                    if variant is None:  # ...unless its key is not this process's (a source file changed while
                        finish(i, *_compile_or_error(*variants[i]))  # the pool ran): compile it here
                    else:
                        finish(i, dataclasses.replace(variant, compiled=True))
    return results


def _compile_or_error(family: KernelFamily, expr: str, arch: str) -> tuple[CachedVariant | None, str | None]:
    try:
        return compile_variant(family, expr, arch), None
    except KernelCompileError as exc:
        return None, str(exc)


def _compile_in_worker(family_name: str, expr: str, arch: str) -> tuple[str | None, CachedVariant | None, str | None]:
    """Pool worker: compile one variant into the cache. Returns (the NVRTC log when it fails, the variant itself when
    the cache directory could not be used, why); the parent warns, not the worker."""
    family = next(f for f in all_families() if f.name == family_name)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CompileCacheWarning)
        variant, error = _compile_or_error(family, expr, arch)
    if variant is not None and variant.image is None:
        return None, variant, unusable_reason()
    return error, None, None


@dataclasses.dataclass(frozen=True)
class CacheContents:
    """What a cache directory holds (:func:`cache_contents`). ``entries``: one (key, family, arch, name expression,
    bytes of image and JSON) per whole entry of this layout; ``stale``: entries that will not be read (of another
    layout, damaged, or a JSON without its image); ``other_files``: anything else (a cubin without its JSON, temporary
    files of a writer that was killed); ``bytes``: the size of every file; ``error``: why the directory could not be
    listed, if so."""
    root: Path
    entries: tuple[tuple[str, str, str, str, int], ...] = ()
    stale: int = 0
    other_files: int = 0
    bytes: int = 0
    error: str | None = None


def cache_contents(root: Path | None = None) -> CacheContents:
    """List a compile cache directory (default :func:`cache_dir`): reads each JSON, not the cubins."""
    root = cache_dir() if root is None else root
    try:
        files = {p.name: p.stat().st_size for p in root.iterdir() if p.is_file()}
    except FileNotFoundError:
        return CacheContents(root)
    except OSError as exc:
        return CacheContents(root, error=f"{type(exc).__name__}: {exc.strerror or exc}")
    entries, stale, used = [], 0, set()
    for name in sorted(files):
        if not name.endswith(".json") or name.count(".") != 1:
            continue
        key = name[:-5]
        try:
            info = json.loads((root / name).read_bytes())
            report = info["report"]
            image = f"{key}{image_suffix(report['arch'])}"
            whole = entry_whole(info, files.get(image))
        except (OSError, ValueError, KeyError, TypeError):
            whole, image = False, None
        if whole:
            entries.append((key, report["family"], report["arch"], report["name_expression"],
                            files[name] + files[image]))
            used.update((name, image))
        else:
            stale += 1
            used.update(n for n in (name, f"{key}.cubin", f"{key}.ptx") if n in files)
    return CacheContents(root, tuple(entries), stale, len(set(files) - used), sum(files.values()))


def timed_load(family: KernelFamily, row: Mapping[str, Any], device_id: int | None = None) -> tuple[float, str]:
    """Seconds from asking for one row of ``family`` to a loaded kernel on a GPU, and where it came from:
    ``"compiled"`` (NVRTC ran: the cold first-call latency of a new variant) or ``"cache"`` (warm: read the cubin and
    load it). Bypasses the per-process memo of ``family.kernel``, so every call measures the disk path.

    Cold, then warm, for a variant nothing has compiled yet::

        import tempfile, os; os.environ["CUPY_ATTN_CACHE_DIR"] = tempfile.mkdtemp()
        from cupy_attn.attention.kernels import flash_fwd
        row = next(flash_fwd.FLASH_FWD.variants())
        timed_load(flash_fwd.FLASH_FWD, row)   # (~1 s, 'compiled')
        timed_load(flash_fwd.FLASH_FWD, row)   # (~ms, 'cache')
    """
    import cupy

    t0 = time.perf_counter()
    with cupy.cuda.Device(device_id) as device:
        variant = compile_variant(family, family.name_expression(**row), target_arch(family, device.id))
        load_variant(variant)
        device.synchronize()
    return time.perf_counter() - t0, "compiled" if variant.compiled else "cache"
