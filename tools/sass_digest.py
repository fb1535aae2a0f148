"""SASS digest of every kernel variant, to show that a refactor left the machine code alone.

    python tools/sass_digest.py [--repo PATH] [--arch sm_90a,sm_90,sm_80] [--family NAME ...] --out digest.json
    python tools/sass_digest.py --compare before.json after.json

The first form imports cupy_attn from ``--repo`` (default: this checkout), compiles each declared variant through the
compile cache (NVRTC only: no GPU), disassembles its cubin with ``cuobjdump -sass`` (``$CUOBJDUMP`` or the PATH) and
writes, per (kernel's lowered name, arch), the instruction count and a hash of the instruction text (addresses and
encodings stripped). The second form lists kernels whose SASS differs, with their instruction counts, and kernels
present on one side only. Two revisions that keep every digest equal ran the same machine code.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile

_INSTR = re.compile(r"/\*[0-9a-f]{4,}\*/\s+(.*?)\s*;")


def sass_lines(cubin: str, cuobjdump: str) -> dict[str, list[str]]:
    """Instruction text per function of a cubin (``cuobjdump -sass``), addresses and encodings dropped."""
    text = subprocess.run([cuobjdump, "-sass", cubin], check=True, capture_output=True, text=True).stdout
    out: dict[str, list[str]] = {}
    current = None
    for line in text.splitlines():
        m = re.match(r"\s*Function : (\S+)", line)
        if m:
            current = out.setdefault(m.group(1), [])
            continue
        if current is not None and (m := _INSTR.search(line)):
            current.append(" ".join(m.group(1).split()))
    return out


def digest(repo: str, archs: list[str], families: list[str] | None) -> dict:
    sys.path.insert(0, os.path.abspath(repo))
    from cupy_attn.runtime import compile as _compile
    from cupy_attn.runtime import compile_check

    cuobjdump = os.environ.get("CUOBJDUMP") or shutil.which("cuobjdump")
    if cuobjdump is None:
        raise SystemExit("cuobjdump not found: set CUOBJDUMP or put it on the PATH")
    fams = [f for f in _compile.all_families() if families is None or f.name in families]
    variants = [(f, e, a) for f in fams for a in archs if f.covers(a) for e in f.name_expressions()]
    print(f"{len(variants)} variants from {repo}", file=sys.stderr, flush=True)
    results = compile_check.compile_all(variants)
    out = {}
    for (family, expr, arch), r in zip(variants, results):
        if r.error is not None:
            raise SystemExit(f"{family.name} {expr} {arch} failed:\n{r.error}")
        cached = _compile.compile_variant(family, expr, arch)
        with tempfile.NamedTemporaryFile(suffix=".cubin") as whole:  # the cache's cubin may lack its last byte
            whole.write(compile_check.whole_cubin(cached.image.read_bytes()))
            whole.flush()
            funcs = sass_lines(whole.name, cuobjdump)
        lines = funcs.get(cached.lowered_name, [])
        out[f"{cached.lowered_name}@{arch}"] = {
            "family": family.name, "expr": expr, "instructions": len(lines),
            "sha256": hashlib.sha256("\n".join(lines).encode()).hexdigest()[:16]}
    return out


def compare(before: dict, after: dict) -> int:
    same = [k for k in before if k in after and before[k]["sha256"] == after[k]["sha256"]]
    changed = [k for k in before if k in after and before[k]["sha256"] != after[k]["sha256"]]
    gone = [k for k in before if k not in after]
    new = [k for k in after if k not in before]
    print(f"{len(same)} identical, {len(changed)} changed, {len(gone)} only before, {len(new)} only after")
    for k in changed:
        b, a = before[k], after[k]
        print(f"changed {b['family']} {b['expr']} @{k.rsplit('@', 1)[1]}: {b['instructions']} -> {a['instructions']}")
    for k in gone:
        print(f"only before: {before[k]['family']} {before[k]['expr']} @{k.rsplit('@', 1)[1]}")
    for k in new:
        print(f"only after: {after[k]['family']} {after[k]['expr']} @{k.rsplit('@', 1)[1]}")
    return 0 if not changed and not gone and not new else 1


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repo", default=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    ap.add_argument("--arch", default="sm_90a,sm_90,sm_80")
    ap.add_argument("--family", action="append", help="only these family names (repeatable)")
    ap.add_argument("--out")
    ap.add_argument("--compare", nargs=2, metavar=("BEFORE", "AFTER"))
    args = ap.parse_args(argv)
    if args.compare:
        before, after = (json.load(open(p)) for p in args.compare)
        return compare(before, after)
    if not args.out:
        ap.error("--out is required (or --compare)")
    result = digest(args.repo, [a.strip() for a in args.arch.split(",") if a.strip()], args.family)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1, sort_keys=True)
    print(f"{len(result)} kernels -> {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
