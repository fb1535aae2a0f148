"""CPU compile check: ``python -m cupy_attn.compile --arch sm_80,sm_90``.

Compiles every variant of every kernel family with NVRTC directly (no GPU, no driver needed) and prints registers,
spills, stack and static shared memory per variant. Exit status 1 if any variant fails to compile.
"""
from __future__ import annotations

import argparse
import sys

from .runtime import compile as _compile


def run(archs, families=None, verbose=False, out=sys.stdout) -> bool:
    """Compile every variant for each arch; True when all compile. Prints one line per variant when verbose."""
    ok = True
    for family in families or _compile.all_families():
        for arch in archs:
            if arch not in family.archs:  # e.g. sm_90a is asked only of families that use wgmma
                continue
            try:
                reports = _compile.compile_family(family, arch)
            except _compile.KernelCompileError as exc:
                ok = False
                print(f"FAIL {family.name} {arch}\n{exc}", file=out)
                continue
            spills = [r for r in reports if r.spill_bytes]
            for r in reports:
                if r.perf_warnings:
                    print(f"warn {family.name} {arch} {r.name_expression}: ptxas {', '.join(r.perf_warnings)}",
                          file=out)
            print(f"ok   {family.name:18s} {arch:7s} {len(reports):3d} variants, "
                  f"max {max((r.registers or 0) for r in reports)} registers, {len(spills)} with spills", file=out)
            if verbose:
                for r in reports:
                    print(f"     {r.name_expression:70s} regs={r.registers} spill={r.spill_bytes} "
                          f"stack={r.stack_bytes} smem={r.smem_bytes}", file=out)
    return ok


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arch", default=",".join(_compile.DEFAULT_ARCHS),
                        help="comma-separated targets, e.g. sm_80,sm_90,sm_90a (default: %(default)s)")
    parser.add_argument("-v", "--verbose", action="store_true", help="one line per variant")
    args = parser.parse_args(argv)
    return 0 if run([a.strip() for a in args.arch.split(",") if a.strip()], verbose=args.verbose) else 1


if __name__ == "__main__":
    sys.exit(main())
