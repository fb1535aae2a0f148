"""Every variant of every kernel family compiles with NVRTC for each of its archs — sm_80 and sm_90, and sm_90a for
the wgmma family (no GPU, no driver needed)."""
import io

import pytest

from cupy_attn import compile as compile_cli
from cupy_attn.runtime import compile as _compile

FAMILIES = _compile.all_families()


PAIRS = [(f, arch) for f in FAMILIES for arch in f.archs]


@pytest.mark.parametrize("family,arch", PAIRS, ids=[f"{f.name}-{arch}" for f, arch in PAIRS])
def test_every_variant_compiles(family, arch):
    reports = _compile.compile_family(family, arch)
    assert len(reports) == len(family.name_expressions()) > 0
    assert all(r.registers is not None for r in reports), "ptxas gave no register report"
    spilled = [r.name_expression for r in reports if r.spill_bytes]
    assert not spilled, f"register spills in {spilled}"


def test_cli_reports_and_exit_code():
    out = io.StringIO()
    assert compile_cli.run(["sm_80"], families=FAMILIES[:1], out=out)
    assert "ok" in out.getvalue()


def test_cache_key_tracks_every_source_file():
    h = _compile.source_hash()
    assert len(h) == 16 and f"-DCUPY_ATTN_SRC_HASH=0x{h}" in _compile.base_options()
    names = {p.name for p in _compile.source_dir().rglob("*.cuh")}
    assert {"types.cuh", "reduce.cuh"} <= names


def test_undeclared_variant_is_refused():
    family = FAMILIES[0]
    row = next(family.variants())
    bad = {k: ("not_a_type" if isinstance(v, str) else v) for k, v in row.items()}
    with pytest.raises(KeyError, match="not in the declared table"):
        family.kernel(**bad)
