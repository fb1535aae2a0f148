"""Compile check and cache warm-up: ``python -m cupy_attn.compile [--arch sm_80,sm_90,sm_90a] [-j N] [-v]``;
``python -m cupy_attn.compile --info`` prints where the compile cache is and what it holds.

Compiles every variant of every kernel family for each arch into the compile cache (see
``cupy_attn.runtime.compile.cache_dir``), in parallel processes, with NVRTC directly (no GPU, no driver needed), then
prints per family and arch the variant count, the most registers, the variants that spill and ptxas performance
warnings. Variants already in the cache are read, not compiled. Without ``--arch`` it warms the cache for the GPU
present (its ``sm_XY``, plus ``sm_90a`` on compute capability 9.0), so first calls load instead of compiling.

Exit status: 0 when every variant compiles, 1 when one does not (or CuPy is missing), 2 for a bad ``--arch`` or no
GPU and no ``--arch``.
"""
from __future__ import annotations

import argparse
import re
import sys
from collections import defaultdict

from .runtime import compile as _compile, compile_check

# Oldest arch the kernels support: cp.async, bf16 mma.sync and ldmatrix need Ampere.
MIN_SM = 80

_ARCH = re.compile(r"sm_(\d+)(a?)")


def parse_archs(text: str) -> list[str]:
    """``"sm_80, sm_90a"`` -> ``["sm_80", "sm_90a"]``; ValueError naming the first value that is not an ``sm_XY[a]``
    that this NVRTC supports, at least sm_80 (``a``, arch-specific features such as wgmma, from sm_90)."""
    archs = [a.strip() for a in text.split(",") if a.strip()]
    if not archs:
        raise ValueError("--arch: no architecture given; e.g. --arch sm_80,sm_90,sm_90a")
    for arch in archs:
        m = _ARCH.fullmatch(arch)
        if m is None:
            raise ValueError(f"--arch: {arch!r} is not an architecture; use sm_XY names such as sm_80, sm_90, sm_90a")
        sm = int(m.group(1))
        if sm < MIN_SM:
            raise ValueError(f"--arch: {arch} is too old: cupy_attn's kernels need sm_{MIN_SM} (Ampere) or newer")
        if sm not in _compile.nvrtc_archs() or (m.group(2) and sm < 90):
            known = ", ".join(f"sm_{a}" for a in _compile.nvrtc_archs() if a >= MIN_SM)
            raise ValueError(f"--arch: {arch} is not supported by NVRTC {'.'.join(map(str, _compile.nvrtc_version()))}"
                             f" (it knows {known}; 'a' only from sm_90)")
    return list(dict.fromkeys(archs))


def gpu_archs() -> list[str]:
    """The archs to warm for the GPUs present (current-device first): ``sm_XY``, plus ``sm_90a`` on compute capability
    9.0 for the wgmma family; [] when there is no usable GPU."""
    import cupy

    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except cupy.cuda.runtime.CUDARuntimeError:  # no driver or no device
        return []
    archs = []
    for device_id in range(count):
        cc = cupy.cuda.Device(device_id).compute_capability
        archs += [f"sm_{cc}"] + (["sm_90a"] if cc == "90" else [])
    return list(dict.fromkeys(archs))


def run(archs, families=None, verbose=False, out=sys.stdout, jobs=None, progress=True) -> bool:
    """Compile every variant of ``families`` (default: all) for each arch a family covers into the cache; print the
    summary; True when all compile. ``progress``: a bar per variant (tqdm, on stderr) or, without tqdm or a terminal,
    one line per compiled variant on ``out``. ``verbose``: one line per variant in the summary."""
    families = families or _compile.all_families()
    variants = [(f, expr, arch) for f in families for arch in archs if f.covers(arch) for expr in f.name_expressions()]
    print(f"{len(variants)} variants for {', '.join(archs)}; cache {_compile.cache_dir()}", file=out, flush=True)
    with _Progress(len(variants), out, enabled=progress) as bar:
        results = compile_check.compile_all(variants, jobs=jobs, progress=bar.update)

    by_pair = defaultdict(list)
    for r in results:
        by_pair[(r.family.name, r.arch)].append(r)
    ok = True
    for (name, arch), rs in by_pair.items():
        failed = [r for r in rs if r.error is not None]
        if failed:  # the first log in full; the others usually repeat it (a broken header fails every variant)
            ok = False
            print(f"FAIL {name} {arch} {failed[0].expr}\n{failed[0].error}", file=out)
            for r in failed[1:]:
                print(f"FAIL {name} {arch} {r.expr}", file=out)
            continue
        reports = [r.report for r in rs]
        spills = [r for r in reports if r.spill_bytes]
        for r in reports:
            if r.perf_warnings:
                print(f"warn {name} {arch} {r.name_expression}: ptxas {', '.join(r.perf_warnings)}", file=out)
        print(f"ok   {name:26s} {arch:7s} {len(reports):3d} variants, "
              f"max {max((r.registers or 0) for r in reports)} registers, {len(spills)} with spills, "
              f"{sum(1 for r in reports if r.perf_warnings)} with ptxas perf warnings", file=out)
        if verbose:
            for r in reports:
                print(f"     {r.name_expression:70s} regs={r.registers} spill={r.spill_bytes} "
                      f"stack={r.stack_bytes} smem={r.smem_bytes}", file=out)
    compiled = [r for r in results if r.source == "compiled" and r.error is None]
    print(f"{len(compiled)} compiled ({sum(r.seconds for r in compiled):.0f} s of NVRTC), "
          f"{sum(1 for r in results if r.source == 'cache')} from the cache, "
          f"{sum(1 for r in results if r.error is not None)} failed", file=out, flush=True)
    return ok


def info(out=None) -> None:
    """Print where the compile cache is and what it holds: entries and megabytes per family and arch, and how many of
    this checkout's declared variants for that arch are there ("current": what a call here would load)."""
    out = out or sys.stdout
    c = compile_check.cache_contents()
    print(f"compile cache: {c.root} (from {_compile.cache_dir_origin()}; {_compile.ENV_CACHE_DIR} moves it)", file=out)
    if c.error is not None:
        print(f"  cannot be listed ({c.error}): kernels are compiled in memory", file=out)
        return
    print(f"  {len(c.entries)} entries, {c.bytes / 1e6:.1f} MB in all; {c.stale} stale (older layout or damaged, "
          f"not read), {c.other_files} other files", file=out)
    version = ".".join(map(str, _compile.nvrtc_version()))
    print(f"  keys here: sources {_compile.source_hash()}, CUDA headers {_compile.cuda_headers_hash()}, "
          f"NVRTC {version}", file=out)
    if not c.entries:
        return
    families = {f.name: f for f in _compile.all_families()}
    keys = {e[0] for e in c.entries}
    rows = defaultdict(lambda: [0, 0])
    for _, family, arch, _, size in c.entries:
        rows[(family, arch)][0] += 1
        rows[(family, arch)][1] += size
    print(f"  {'family':26s} {'arch':8s} {'entries':>7s} {'MB':>7s}  current", file=out)
    for (family, arch), (count, size) in sorted(rows.items()):
        f = families.get(family)
        if f is not None and f.covers(arch):
            exprs = f.name_expressions()
            current = f"{sum(_compile.variant_key(f, e, arch) in keys for e in exprs)}/{len(exprs)}"
        else:
            current = "-"
        print(f"  {family:26s} {arch:8s} {count:7d} {size / 1e6:7.1f}  {current}", file=out)


class _Progress:
    """tqdm's bar on a terminal when tqdm is installed (imported here, lazily: it is optional), else one printed line
    per variant that NVRTC compiled (cache hits are instant and only counted). Not a terminal (a CI log): lines too,
    as a bar's carriage-return redraws would pile up into one long line."""

    def __init__(self, total: int, out, enabled: bool = True):
        self.total, self.out, self.enabled, self.done, self.bar = total, out, enabled, 0, None
        if enabled and sys.stderr.isatty():
            try:
                from tqdm import tqdm
            except ImportError:
                return
            self.bar = tqdm(total=total, unit="variant", dynamic_ncols=True)

    def update(self, r: compile_check.CompileResult) -> None:
        self.done += 1
        if self.bar is not None:
            self.bar.set_postfix_str(f"{r.family.name} {r.arch}", refresh=False)
            self.bar.update()
        elif self.enabled and (r.source == "compiled" or r.error is not None):
            status = "FAIL" if r.error is not None else f"{r.seconds:5.1f} s"
            print(f"[{self.done:{len(str(self.total))}d}/{self.total}] {status} {r.arch} {r.expr}",
                  file=self.out, flush=True)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        if self.bar is not None:
            self.bar.close()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m cupy_attn.compile", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arch", help="comma-separated targets, e.g. sm_80,sm_90,sm_90a (default: the GPU present)")
    parser.add_argument("-j", "--jobs", type=int, default=None, help="parallel NVRTC processes (default: CPU count)")
    parser.add_argument("-v", "--verbose", action="store_true", help="one line per variant in the summary")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar or per-variant lines")
    parser.add_argument("--info", action="store_true", help="print where the compile cache is and what it holds")
    args = parser.parse_args(argv)
    if not _compile.have_cupy():
        print(_compile.NEEDS_CUPY, file=sys.stderr)
        return 1
    if args.info:
        info()
        return 0
    text = args.arch
    if text is None:
        found = gpu_archs()
        if not found:
            parser.error("no CUDA GPU found: pass the targets to compile for, e.g. --arch sm_80,sm_90,sm_90a")
        print(f"warming the compile cache for the GPU present: {', '.join(found)}")
        text = ",".join(found)
    try:
        archs = parse_archs(text)
    except ValueError as exc:
        parser.error(str(exc))
    return 0 if run(archs, verbose=args.verbose, jobs=args.jobs, progress=not args.no_progress) else 1


if __name__ == "__main__":
    sys.exit(main())
