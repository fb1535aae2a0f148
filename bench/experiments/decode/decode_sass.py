"""SASS instruction count of flash_decode's key-tile loop, per warp per tile, by path (CPU only: NVRTC + cuobjdump).

    PYTHONPATH=. python3 bench/experiments/decode/decode_sass.py [sm_90]

Compiles the bf16, unmasked flash_decode tiles of DECODE_TILES and WIDE_TILES (Hopper entries) into one cubin,
disassembles it (cuobjdump, pip install nvidia-cuda-cuobjdump), takes the largest loop holding a BAR.SYNC and HMMAs
(the key-tile loop), and prints, for each (LDGSTS, MUFU, HMMA) count reachable in one trip, the fewest instructions a
trip with those counts issues (predicated-off instructions count: they issue). At D = 128, 16 LDGSTS is a whole tile
copied by TileCopy; MUFU 4 / 8 the fast softmax with rows 8..15 skipped (Fast1) / not (Fast2), 5 Fast1 with the lazy
rescale, 10 the general path. bench/notes/decode.md (session 8) quotes the output.
"""
import os
import re
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
sys.path.insert(0, os.path.join(ROOT, "tests", "_helpers"))  # the tests' helpers
sys.path.insert(0, os.path.join(ROOT, "tests"))  # test_flash_fwd_sm90._cuobjdump; cupy_attn from PYTHONPATH

from cupy_attn.attention.kernels import flash_decode as _decode  # noqa: E402
from cupy_attn.runtime import compile as _compile  # noqa: E402
from cupy_attn.runtime import compile_check  # noqa: E402


def loop_paths(sass: str) -> dict:
    """{kernel: {(ldgsts, mufu, hmma): fewest instructions per trip}} of each function in ``sass``."""
    out = {}
    for f in re.split(r"\n\s*Function : ", sass)[1:]:
        name = f.split("\n", 1)[0].strip()
        ins = [(int(m.group(1), 16), m.group(2).strip()) for m in re.finditer(r"/\*([0-9a-f]{4,})\*/\s+(.*?);", f)]
        at = {a: i for i, (a, _) in enumerate(ins)}
        loop = None
        for i, (a, text) in enumerate(ins):
            m = re.search(r"\bBRA\s.*?(0x[0-9a-f]+)", text)
            if m and int(m.group(1), 16) < a:
                s = at.get(int(m.group(1), 16), 0)
                body = [t for _, t in ins[s:i + 1]]
                if any("BAR.SYNC" in t for t in body) and any("HMMA" in t for t in body):
                    if loop is None or i - s > loop[1] - loop[0]:
                        loop = (s, i)
        s, e = loop

        def op(text):
            return re.sub(r"^@!?U?P\w+\s+", "", text).split()[0].split(".")[0]

        def successors(i):
            text = ins[i][1]
            m = re.search(r"\bBRA\s.*?(0x[0-9a-f]+)", text)
            if m:
                target = at[int(m.group(1), 16)]
                nxt = [target] if i < target <= e else []
                return nxt + ([i + 1] if text.startswith("@") else [])
            return [] if op(text) == "EXIT" else [i + 1]

        best = [dict() for _ in range(e + 2)]  # forward edges only: a DAG in address order
        best[s][(0, 0, 0)] = 0
        for i in range(s, e + 1):
            o = op(ins[i][1])
            for (l, mf, h), d in best[i].items():
                key = (l + (o == "LDGSTS"), mf + (o == "MUFU"), h + (o == "HMMA"))
                for j in ([e + 1] if i == e else successors(i)):
                    if best[j].get(key, 1 << 30) > d + 1:
                        best[j][key] = d + 1
        out[name] = best[e + 1]
    return out


def main():
    from test_flash_fwd_sm90 import _cuobjdump
    arch = sys.argv[1] if len(sys.argv) > 1 else "sm_90"
    tiles = [(d, t) for (d, a), t in (*_decode.TILES.items(), *_decode.WIDE_TILES.items()) if a == 9]
    names = [_decode.FLASH_DECODE.name_expression(dtype="__nv_bfloat16", head_dim=d, tile=t, has_mask="false")
             for d, t in tiles]
    family = _decode.FLASH_DECODE
    options = list(_compile.base_options() + family.options) + [f"-arch={arch}"]
    with _compile.nvrtc_program(family.code(), family.source, names, options, family.source) as prog:
        from cupy.cuda import nvrtc
        cubin = compile_check.whole_cubin(nvrtc.getCUBIN(prog))
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        sass = subprocess.run([_cuobjdump(), "-sass", f.name], capture_output=True, text=True, check=True).stdout
    for name, paths in loop_paths(sass).items():
        print(name)
        for (l, mf, h), d in sorted(paths.items(), key=lambda kv: kv[1]):
            if h and l in (0, max(k[0] for k in paths)):
                print(f"  LDGSTS {l:3d}  MUFU {mf:3d}  HMMA {h:3d}: {d} instructions")


if __name__ == "__main__":
    main()
