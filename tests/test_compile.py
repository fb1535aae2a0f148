"""Every variant of every kernel family compiles with NVRTC for each of its archs — sm_80 and sm_90, and sm_90a for
the wgmma family (no GPU, no driver needed) — read from the shared compile cache, so that after the main job has
warmed it these tests compile nothing. Also: the cache compiles a variant once, the CLI validates --arch, and without
CuPy the CLI and the main job say how to install it."""
import io
import os
import subprocess
import sys
from pathlib import Path

import pytest

from cupy_attn import compile as compile_cli
from cupy_attn.linear_bn_softmax import launch as lbs
from cupy_attn.runtime import compile as _compile

FAMILIES = _compile.all_families()
REPO = Path(__file__).resolve().parent.parent


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
    assert compile_cli.run(["sm_80"], families=FAMILIES[:1], out=out, progress=False)
    assert "ok" in out.getvalue()


def test_cache_key_tracks_every_source_file():
    h = _compile.source_hash()
    assert len(h) == 16 and f"-DCUPY_ATTN_SRC_HASH=0x{h}" in _compile.base_options()
    names = {p.name for p in _compile.source_dir().rglob("*.cuh")}
    assert {"types.cuh", "reduce.cuh"} <= names
    expr = lbs.FOLD_RUNNING_STATS.name_expressions()[0]
    keys = {_compile.variant_key(lbs.FOLD_RUNNING_STATS, expr, arch) for arch in ("sm_80", "sm_90", "sm_90a")}
    assert len(keys) == 3, "the arch is part of the key"


def test_undeclared_variant_is_refused():
    family = FAMILIES[0]
    row = next(family.variants())
    bad = {k: ("not_a_type" if isinstance(v, str) else v) for k, v in row.items()}
    with pytest.raises(KeyError, match="not in the declared table"):
        family.kernel(**bad)


# ---------------------------------------------------------------------------------------------------------------------
# The cache: each variant compiles once per machine


@pytest.fixture
def empty_cache(tmp_path, monkeypatch):
    """A fresh cache directory, and a count of NVRTC compiles in this process."""
    from cupy.cuda import nvrtc

    monkeypatch.setenv(_compile.ENV_CACHE_DIR, str(tmp_path))
    calls = []
    compile_program = nvrtc.compileProgram

    def counting(prog, options):
        calls.append(options)
        return compile_program(prog, options)

    monkeypatch.setattr(nvrtc, "compileProgram", counting)
    return tmp_path, calls


def test_cache_dir_follows_environment(tmp_path, monkeypatch):
    monkeypatch.setenv(_compile.ENV_CACHE_DIR, str(tmp_path / "a"))
    assert _compile.cache_dir() == tmp_path / "a"
    monkeypatch.delenv(_compile.ENV_CACHE_DIR)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert _compile.cache_dir() == tmp_path / "xdg" / "cupy_attn"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert _compile.cache_dir() == Path.home() / ".cache" / "cupy_attn"


def test_second_request_compiles_nothing(empty_cache):
    root, calls = empty_cache
    family, expr = lbs.FOLD_RUNNING_STATS, lbs.FOLD_RUNNING_STATS.name_expressions()[0]
    first = _compile.compile_variant(family, expr, "sm_80")
    assert first.compiled and len(calls) == 1
    assert sorted(p.suffix for p in root.iterdir()) == [".cubin", ".json"], "one cubin and one report, no temp files"
    second = _compile.compile_variant(family, expr, "sm_80")
    assert not second.compiled and len(calls) == 1
    assert second.report == first.report and second.report.registers is not None
    assert second.lowered_name == first.lowered_name and second.image.read_bytes() == first.image.read_bytes()
    (result,) = _compile.compile_all([(family, expr, "sm_80")], jobs=2)
    assert result.source == "cache" and result.report == first.report and len(calls) == 1
    _compile.compile_variant(family, expr, "sm_90")
    assert len(calls) == 2, "another arch is another variant"


def test_parallel_compiles_store_reports_for_the_parent(empty_cache):
    root, calls = empty_cache
    family = lbs.SOFTMAX_ROWS_STREAMING
    seen = []
    results = _compile.compile_all([(family, e, "sm_80") for e in family.name_expressions()], jobs=2,
                                   progress=seen.append)
    assert [r.expr for r in results] == family.name_expressions() and len(seen) == len(results)
    assert all(r.source == "compiled" and r.error is None and r.report.registers is not None for r in results)
    assert not calls, "the worker processes compile; this one only reads the cache"
    assert len(list(root.glob("*.cubin"))) == len(results)
    assert [r.source for r in _compile.compile_all([(family, e, "sm_80") for e in family.name_expressions()])] == \
        ["cache"] * len(results) and not calls


def test_worker_entry_under_another_key_is_compiled_here(empty_cache, monkeypatch):
    """A worker that reports success but whose cache entry this process cannot find under its own key (a source file
    changed while the pool ran, so the keys differ) does not crash the check: the parent compiles the variant."""
    import concurrent.futures

    class Done:
        def result(self):
            return None  # "compiled and stored", though nothing was stored under this process's key

    class Pool:
        def __init__(self, *a, **k):
            pass

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def submit(self, fn, *args):
            return Done()

    monkeypatch.setattr(concurrent.futures, "ProcessPoolExecutor", Pool)
    monkeypatch.setattr(concurrent.futures, "as_completed", lambda futures: list(futures))
    root, calls = empty_cache
    family = lbs.SOFTMAX_ROWS_STREAMING
    exprs = family.name_expressions()[:2]
    results = _compile.compile_all([(family, e, "sm_80") for e in exprs], jobs=2)
    assert [r.error for r in results] == [None, None] and all(r.report is not None for r in results)
    assert len(calls) == 2, "compiled in this process"


def test_failing_variant_fails_the_check(empty_cache):
    root, _ = empty_cache
    broken = _compile.KernelFamily(name="broken", source=lbs.FOLD_RUNNING_STATS.source,
                                   template="cupy_attn::lbs::no_such_kernel<{n}>", axes={"n": (1,)})
    out = io.StringIO()
    assert not compile_cli.run(["sm_80"], families=[broken], out=out, progress=False)
    assert "FAIL broken sm_80 cupy_attn::lbs::no_such_kernel<1>" in out.getvalue()
    assert "1 failed" in out.getvalue() and not list(root.iterdir()), "failures are not cached"


@pytest.fixture
def fake_gpu(monkeypatch):
    """family.kernel's path without a GPU: a device of compute capability 9.0 and a RawModule that records what it
    loads; the per-device memo is emptied before and after."""
    import cupy

    class Device:
        compute_capability = "90"

        def __init__(self, device_id=None):
            self.id = device_id or 0

    loaded = []

    class RawModule:
        def __init__(self, path):
            loaded.append(Path(path))

        def get_function(self, name):
            return ("kernel", name)

    monkeypatch.setattr(cupy.cuda, "Device", Device)
    monkeypatch.setattr(cupy, "RawModule", RawModule)
    _compile._load.cache_clear()
    yield Device, loaded
    _compile._load.cache_clear()


def test_first_call_shares_the_compile_check_cache(empty_cache, fake_gpu):
    root, calls = empty_cache
    _, loaded = fake_gpu
    family = lbs.FOLD_RUNNING_STATS
    row = next(family.variants())
    kernel = family.kernel(**row)
    assert len(calls) == 1 and "-arch=sm_90" in calls[0], "compiled for the device's sm_XY"
    assert loaded == [p for p in root.iterdir() if p.suffix == ".cubin"]
    assert kernel[1].startswith("_ZN9cupy_attn3lbs18fold_running_stats"), "looked up by its lowered name"
    assert family.kernel(**row) is kernel and len(loaded) == 1, "memoized per device"
    (result,) = _compile.compile_all([(family, family.name_expression(**row), "sm_90")])
    assert result.source == "cache" and len(calls) == 1, "the compile check reads what the first call compiled"


def test_device_arch(fake_gpu):
    Device, _ = fake_gpu
    assert _compile.device_arch() == "sm_90"
    assert _compile.target_arch(FAMILIES[0]) == "sm_90"
    assert _compile.target_arch(next(f for f in FAMILIES if f.arch == "sm_90a")) == "sm_90a"
    Device.compute_capability = "990"  # newer than this NVRTC: PTX for its newest arch, compiled by the driver
    assert _compile.device_arch() == f"compute_{max(_compile.nvrtc_archs())}"


# ---------------------------------------------------------------------------------------------------------------------
# The CLI: --arch validation, the GPU default, no CuPy


@pytest.mark.parametrize("arch,message", [
    ("foo", "'foo' is not an architecture"),
    ("sm_80,bar", "'bar' is not an architecture"),
    ("sm_75", "sm_75 is too old: cupy_attn's kernels need sm_80"),
    ("sm_80,sm_999", "sm_999 is not supported by NVRTC"),
    ("sm_86a", "sm_86a is not supported by NVRTC"),
    (",", "no architecture given"),
])
def test_cli_rejects_bad_arch(arch, message, capsys):
    with pytest.raises(SystemExit) as exc:
        compile_cli.main(["--arch", arch])
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_cli_accepts_supported_archs():
    assert compile_cli.parse_archs("sm_80, sm_90,sm_90a,sm_90") == ["sm_80", "sm_90", "sm_90a"]


def test_cli_without_arch_needs_a_gpu(monkeypatch, capsys):
    monkeypatch.setattr(compile_cli, "gpu_archs", lambda: [])
    with pytest.raises(SystemExit) as exc:
        compile_cli.main([])
    assert exc.value.code == 2
    assert "no CUDA GPU found" in capsys.readouterr().err


def test_cli_without_arch_warms_the_gpu_present(monkeypatch):
    asked = []
    monkeypatch.setattr(compile_cli, "gpu_archs", lambda: ["sm_90", "sm_90a"])
    monkeypatch.setattr(compile_cli, "run", lambda archs, **kw: asked.append(archs) or True)
    assert compile_cli.main([]) == 0 and asked == [["sm_90", "sm_90a"]]


@pytest.mark.parametrize("argv,entry", [
    (["--arch", "sm_80"], "runpy.run_module('cupy_attn.compile', run_name='__main__')"),
    ([], "runpy.run_path('bench/main.py', run_name='__main__')"),
], ids=["cli", "main_job"])
def test_without_cupy_says_how_to_install_it(argv, entry):
    # sys.modules['cupy'] = None makes every "import cupy" fail as if CuPy were not installed.
    code = f"import runpy, sys; sys.modules['cupy'] = None; sys.argv = ['x'] + {argv!r}; {entry}"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1, proc.stderr
    assert "cupy_attn needs CuPy: pip install 'cupy_attn[cuda12]' (or [cuda13])" in proc.stderr
    assert "Traceback" not in proc.stderr
