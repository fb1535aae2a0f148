"""Every variant of every kernel family compiles with NVRTC for each of its archs — sm_80 and sm_90, and sm_90a for
the wgmma family (no GPU, no driver needed) — read from the shared compile cache, so that after the main job has
warmed it these tests compile nothing. Also: the cache compiles a variant once per user (a second checkout or an
environment with the same CUDA headers compiles nothing), recompiles damaged entries, compiles in memory with one
warning where its directory cannot be used, takes concurrent writers; the CLI validates --arch and prints --info; and
without CuPy the CLI and the main job say how to install it."""
import io
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from cupy_attn import compile as compile_cli
from cupy_attn.linear_bn_softmax import launch as lbs
from cupy_attn.runtime import compile as _compile
from cupy_attn.runtime import compile_check

FAMILIES = _compile.all_families()
REPO = Path(__file__).resolve().parent.parent


PAIRS = [(f, arch) for f in FAMILIES for arch in f.archs]


@pytest.mark.parametrize("family,arch", PAIRS, ids=[f"{f.name}-{arch}" for f, arch in PAIRS])
def test_every_variant_compiles(family, arch):
    reports = compile_check.compile_family(family, arch)
    assert len(reports) == len(family.name_expressions()) > 0
    assert all(r.registers is not None for r in reports), "ptxas gave no register report"
    spilled = [r.name_expression for r in reports if r.spill_bytes]
    assert not spilled, f"register spills in {spilled}"


def test_family_modules_list_every_kernel_module():
    """Every launcher module of cupy_attn/attention/kernels/ is imported by the compile check (FAMILY_MODULES), declares
    at least one family, and is named as its source (kernels/<stem>.py ↔ cuda_src/attention/<stem>.cu), and its test
    file is tests/test_<stem>.py."""
    import importlib
    kernels = REPO / "cupy_attn" / "attention" / "kernels"
    stems = sorted(p.stem for p in kernels.glob("*.py") if p.stem != "__init__")
    assert {f"cupy_attn.attention.kernels.{s}" for s in stems} <= set(_compile.FAMILY_MODULES)
    for stem in stems:
        module = importlib.import_module(f"cupy_attn.attention.kernels.{stem}")
        families = [v for v in vars(module).values() if isinstance(v, _compile.KernelFamily)]
        assert families, f"kernels/{stem}.py declares no family"
        assert any(f.source == f"attention/{stem}.cu" for f in families), f"kernels/{stem}.py: no {stem}.cu family"
        assert (REPO / "tests" / f"test_{stem}.py").is_file(), f"no tests/test_{stem}.py"


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
    (result,) = compile_check.compile_all([(family, expr, "sm_80")], jobs=2)
    assert result.source == "cache" and result.report == first.report and len(calls) == 1
    _compile.compile_variant(family, expr, "sm_90")
    assert len(calls) == 2, "another arch is another variant"


def test_parallel_compiles_store_reports_for_the_parent(empty_cache):
    root, calls = empty_cache
    family = lbs.SOFTMAX_ROWS_STREAMING
    seen = []
    results = compile_check.compile_all([(family, e, "sm_80") for e in family.name_expressions()], jobs=2,
                                   progress=seen.append)
    assert [r.expr for r in results] == family.name_expressions() and len(seen) == len(results)
    assert all(r.source == "compiled" and r.error is None and r.report.registers is not None for r in results)
    assert not calls, "the worker processes compile; this one only reads the cache"
    assert len(list(root.glob("*.cubin"))) == len(results)
    assert [r.source for r in compile_check.compile_all([(family, e, "sm_80") for e in family.name_expressions()])] == \
        ["cache"] * len(results) and not calls


def test_worker_entry_under_another_key_is_compiled_here(empty_cache, monkeypatch):
    """A worker that reports success but whose cache entry this process cannot find under its own key (a source file
    changed while the pool ran, so the keys differ) does not crash the check: the parent compiles the variant."""
    import concurrent.futures

    class Done:
        def result(self):
            return None, None, None  # "compiled and stored", though nothing was stored under this process's key

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
    results = compile_check.compile_all([(family, e, "sm_80") for e in exprs], jobs=2)
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
    (result,) = compile_check.compile_all([(family, family.name_expression(**row), "sm_90")])
    assert result.source == "cache" and len(calls) == 1, "the compile check reads what the first call compiled"


def test_device_arch(fake_gpu):
    Device, _ = fake_gpu
    assert _compile.device_arch() == "sm_90"
    assert _compile.target_arch(FAMILIES[0]) == "sm_90"
    assert _compile.target_arch(next(f for f in FAMILIES if f.arch == "sm_90a")) == "sm_90a"
    Device.compute_capability = "990"  # newer than this NVRTC: PTX for its newest arch, compiled by the driver
    assert _compile.device_arch() == f"compute_{max(_compile.nvrtc_archs())}"


# ---------------------------------------------------------------------------------------------------------------------
# The cache across checkouts and environments, with an unusable directory, damaged entries and concurrent writers

@pytest.fixture
def fresh_memory(monkeypatch):
    """No variant compiled in memory and no cache directory warned about yet, in this process."""
    monkeypatch.setattr(_compile, "_MEMORY", {})
    monkeypatch.setattr(_compile, "_UNUSABLE", {})


def _same_code(a: bytes, b: bytes) -> bool:
    """Two cubins of one variant: NVRTC names internal-linkage symbols (``_INTERNAL_<hash>_<len>_<file>_<hash>_<n>``)
    with a number that changes between compiles; everything else is the same."""
    internal = re.compile(rb"_INTERNAL_[0-9a-f]+_\d+_\w+?_[0-9a-f]{8}_\d+")
    return len(a) == len(b) and internal.sub(b"_INTERNAL_", a) == internal.sub(b"_INTERNAL_", b)


def _child(code: str, pythonpath: Path, cache: Path, *args: str, wait: bool = True):
    """``python -c code args`` in a new process importing cupy_attn from ``pythonpath``, with the cache at ``cache``."""
    env = {**os.environ, "PYTHONPATH": str(pythonpath), _compile.ENV_CACHE_DIR: str(cache)}
    proc = subprocess.Popen([sys.executable, "-c", code, *args], cwd=pythonpath, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    return proc.communicate(timeout=300) + (proc.returncode,) if wait else proc


SECOND_CHECKOUT = """
import json
from cupy_attn.runtime import compile as c
from cupy_attn.runtime import compile_check
from cupy_attn.linear_bn_softmax import launch as lbs
family = lbs.SOFTMAX_ROWS_STREAMING
results = compile_check.compile_all([(family, e, "sm_80") for e in family.name_expressions()[:2]], jobs=1)
print(json.dumps({"source_dir": str(c.source_dir()), "options": c.base_options(),
                  "sources": [r.source for r in results]}))
"""


def test_second_checkout_compiles_nothing(empty_cache, tmp_path):
    """A copy of the package and cuda_src/ in another directory (a second clone) compiles with other -I paths but has
    the same keys: in a new process, what this checkout compiled is read from the cache."""
    import shutil

    root, calls = empty_cache
    family = lbs.SOFTMAX_ROWS_STREAMING
    variants = [(family, e, "sm_80") for e in family.name_expressions()[:2]]
    assert [r.source for r in compile_check.compile_all(variants, jobs=1)] == ["compiled"] * 2
    clone = tmp_path / "clone"
    for tree in ("cupy_attn", "cuda_src"):
        shutil.copytree(REPO / tree, clone / tree, ignore=shutil.ignore_patterns("__pycache__"))
    out, err, rc = _child(SECOND_CHECKOUT, clone, root)
    assert rc == 0, err
    seen = json.loads(out.splitlines()[-1])
    assert seen["source_dir"] == str(clone / "cuda_src")
    assert f"-I{clone / 'cuda_src'}" in seen["options"] and f"-I{_compile.source_dir()}" not in seen["options"]
    assert seen["sources"] == ["cache", "cache"], "a second checkout compiles 0 variants"
    assert len(list(root.glob("*.cubin"))) == 2


@pytest.fixture
def header_caches():
    def clear():
        _compile.cuda_headers.cache_clear()
        _compile.cuda_headers_hash.cache_clear()
    clear()
    yield clear
    clear()


def test_new_environment_with_the_same_headers_shares_the_cache(tmp_path, monkeypatch, header_caches):
    """A new virtual environment finds the CUDA headers under other directories: the same contents give the same key,
    and one changed header another key."""
    import shutil

    family, expr = lbs.FOLD_RUNNING_STATS, lbs.FOLD_RUNNING_STATS.name_expressions()[0]
    before = _compile.variant_key(family, expr, "sm_80")
    headers = _compile.cuda_headers()
    assert {"cuda_fp16.h", "cuda_fp16.hpp", "cuda_bf16.h", "cuda_bf16.hpp"} <= {name for name, file, _ in headers
                                                                                if file}
    include = tmp_path / "venv2" / "include"
    for name, file, _ in headers:
        if file is not None:
            (include / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(file, include / name)
    monkeypatch.setattr(_compile, "cuda_include_dirs", lambda: (str(include),))
    header_caches()
    assert f"-I{include}" in _compile.base_options()
    assert _compile.variant_key(family, expr, "sm_80") == before
    with open(include / "cuda_fp16.hpp", "a") as f:
        f.write("\n// another release of the header\n")
    header_caches()
    assert _compile.variant_key(family, expr, "sm_80") != before


@pytest.mark.parametrize("where", ["a file", "under a file"])
def test_unusable_cache_dir_compiles_in_memory_and_warns_once(where, empty_cache, fresh_memory, tmp_path, monkeypatch):
    """CUPY_ATTN_CACHE_DIR where no directory can be made: the variant compiles in memory, the same cubin as in a
    usable cache, a second request is served from memory, and one warning names the directory and the variable."""
    _, calls = empty_cache
    family, expr = lbs.FOLD_RUNNING_STATS, lbs.FOLD_RUNNING_STATS.name_expressions()[0]
    good = _compile.compile_variant(family, expr, "sm_80")
    blocker = tmp_path / "blocker"
    blocker.write_text("a file, not a directory")
    bad = blocker if where == "a file" else blocker / "cupy_attn"
    monkeypatch.setenv(_compile.ENV_CACHE_DIR, str(bad))
    with pytest.warns(_compile.CompileCacheWarning) as record:
        first = _compile.compile_variant(family, expr, "sm_80")
        second = _compile.compile_variant(family, expr, "sm_80")
        (result,) = compile_check.compile_all([(family, expr, "sm_80")], jobs=2)
    assert len(record) == 1
    message = str(record[0].message)
    assert str(bad) in message and _compile.ENV_CACHE_DIR in message
    assert first.compiled and first.image is None and _same_code(first.image_bytes(), good.image.read_bytes())
    assert first.report == good.report and first.lowered_name == good.lowered_name
    assert not second.compiled and second.image_bytes() == first.image_bytes() and len(calls) == 2
    assert result.source == "cache" and result.report == good.report
    assert blocker.read_text() == "a file, not a directory"


def test_unusable_cache_dir_in_the_parallel_check(empty_cache, fresh_memory, tmp_path, monkeypatch):
    """The compile check's workers cannot store either: they send their variants back, and the parent warns once."""
    _, calls = empty_cache
    blocker = tmp_path / "blocker"
    blocker.write_text("")
    monkeypatch.setenv(_compile.ENV_CACHE_DIR, str(blocker))
    family = lbs.SOFTMAX_ROWS_STREAMING
    variants = [(family, e, "sm_80") for e in family.name_expressions()[:2]]
    with pytest.warns(_compile.CompileCacheWarning) as record:
        results = compile_check.compile_all(variants, jobs=2)
    assert len(record) == 1 and str(blocker) in str(record[0].message)
    assert all(r.error is None and r.source == "compiled" and r.report.registers is not None for r in results)
    assert not calls, "compiled in the workers"
    assert [r.source for r in compile_check.compile_all(variants, jobs=2)] == ["cache"] * 2 and not calls


def test_first_call_with_an_unusable_cache_loads_the_image_from_memory(fake_gpu, fresh_memory, tmp_path,
                                                                       monkeypatch):
    """family.kernel without a cache directory: the cubin's bytes are loaded (cuModuleLoadData, faked here) and the
    kernel is a cupy.RawKernel that launches the loaded function."""
    import cupy
    from cupy.cuda import function

    _, paths = fake_gpu
    blocker = tmp_path / "blocker"
    blocker.write_text("")
    monkeypatch.setenv(_compile.ENV_CACHE_DIR, str(blocker))
    images, launches = [], []

    class Function:
        def __init__(self, name):
            self.name, self.ptr = name, 1234

        def __call__(self, grid, block, args, **kwargs):
            launches.append((self.name, grid, block, args, kwargs.get("shared_mem")))

    class Module:
        def load(self, image):
            images.append(image)

        def get_function(self, name):
            return Function(name)

    monkeypatch.setattr(function, "Module", Module)
    family = lbs.FOLD_RUNNING_STATS
    row = next(family.variants())
    with pytest.warns(_compile.CompileCacheWarning):
        kernel = family.kernel(**row)
    (variant,) = _compile._MEMORY.values()
    assert images == [variant.data] and images[0][:4] == b"\x7fELF" and not paths, "loaded from memory, no file"
    assert isinstance(kernel, cupy.RawKernel) and kernel.kernel.name == variant.lowered_name
    kernel((3,), (128,), ("params",), shared_mem=64)
    assert launches == [(variant.lowered_name, (3,), (128,), ("params",), 64)]
    assert family.kernel(**row) is kernel and len(images) == 1, "memoized per device"


UNUSABLE_ON_A_GPU = """
import json, warnings
import cupy, numpy as np
import cupy_attn
from cupy_attn import reference
from cupy_attn.runtime.compile import CompileCacheWarning
rng = np.random.default_rng(0)
q, k, v = (rng.standard_normal((1, 2, 128, 64)) for _ in range(3))
errors = {}
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    for dtype, backend in (("float16", "fused"), ("float32", "split")):
        out = cupy_attn.scaled_dot_product_attention(*(cupy.asarray(x.astype(dtype)) for x in (q, k, v)),
                                                     is_causal=True, backend=backend)
        ref = reference.scaled_dot_product_attention(*(x.astype(dtype).astype(np.float64) for x in (q, k, v)),
                                                     is_causal=True)
        errors[dtype] = float(np.abs(cupy.asnumpy(out).astype(np.float64) - ref).max())
print(json.dumps({"warnings": [str(w.message) for w in caught if issubclass(w.category, CompileCacheWarning)],
                  "errors": errors}))
"""


@pytest.mark.gpu
def test_unusable_cache_dir_on_a_gpu(tmp_path):
    """A process whose cache directory is a file runs the fused and the split path from kernels loaded out of memory
    (cuModuleLoadData), with one warning, and matches the reference."""
    blocker = tmp_path / "blocker"
    blocker.write_text("")
    out, err, rc = _child(UNUSABLE_ON_A_GPU, REPO, blocker)
    assert rc == 0, err
    seen = json.loads(out.splitlines()[-1])
    assert len(seen["warnings"]) == 1 and str(blocker) in seen["warnings"][0]
    assert seen["errors"]["float16"] < 2e-3 and seen["errors"]["float32"] < 1e-5, seen["errors"]


@pytest.mark.parametrize("damage", ["truncated cubin", "empty cubin", "cubin missing", "JSON cut short",
                                    "JSON of another layout", "JSON without its report"])
def test_damaged_entry_is_recompiled(damage, empty_cache):
    root, calls = empty_cache
    family, expr = lbs.FOLD_RUNNING_STATS, lbs.FOLD_RUNNING_STATS.name_expressions()[0]
    first = _compile.compile_variant(family, expr, "sm_80")
    cubin, meta = first.image, first.image.with_suffix(".json")
    image, info = cubin.read_bytes(), json.loads(meta.read_text())
    if damage == "truncated cubin":
        cubin.write_bytes(image[: len(image) // 2])
    elif damage == "empty cubin":
        cubin.write_bytes(b"")
    elif damage == "cubin missing":
        cubin.unlink()
    elif damage == "JSON cut short":
        meta.write_text(meta.read_text()[:40])
    elif damage == "JSON of another layout":
        meta.write_text(json.dumps({**info, "layout": "1"}))
    else:
        meta.write_text(json.dumps({k: v for k, v in info.items() if k != "report"}))
    assert compile_check.cache_contents(root).stale == 1 and not compile_check.cache_contents(root).entries
    again = _compile.compile_variant(family, expr, "sm_80")
    assert again.compiled and len(calls) == 2 and again.report == first.report
    assert _same_code(cubin.read_bytes(), image) and json.loads(meta.read_text())["image_bytes"] == len(image)
    assert not _compile.compile_variant(family, expr, "sm_80").compiled and len(calls) == 2
    contents = compile_check.cache_contents(root)
    assert len(contents.entries) == 1 and contents.stale == 0 and contents.other_files == 0


RACE = """
import json, sys, time
from pathlib import Path
from cupy_attn.runtime import compile as c
from cupy_attn.runtime import compile_check
from cupy_attn.linear_bn_softmax import launch as lbs
family = lbs.FOLD_RUNNING_STATS
expr = family.name_expressions()[0]
c.variant_key(family, expr, "sm_80")  # imported and hashed before the start
Path(sys.argv[1]).touch()
while not Path(sys.argv[2]).exists():
    time.sleep(0.005)
v = c.compile_variant(family, expr, "sm_80")
print(json.dumps({"compiled": v.compiled, "lowered_name": v.lowered_name, "report": v.report.registers}))
"""


def test_two_processes_compiling_one_variant_into_an_empty_cache_both_succeed(tmp_path):
    """Two processes miss the same variant at the same moment, in a cache directory that does not exist yet: both
    compile and store it (atomic renames), both succeed, and the cache holds one whole entry and no temporary file."""
    import time

    root, go = tmp_path / "cache", tmp_path / "go"
    ready = [tmp_path / f"ready{i}" for i in range(2)]
    procs = [_child(RACE, REPO, root, str(r), str(go), wait=False) for r in ready]
    deadline = time.monotonic() + 300
    while not all(r.exists() for r in ready) and time.monotonic() < deadline and all(p.poll() is None for p in procs):
        time.sleep(0.01)
    go.touch()
    outs = [p.communicate(timeout=300) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [err for _, err in outs]
    seen = [json.loads(out.splitlines()[-1]) for out, _ in outs]
    assert seen[0]["lowered_name"] == seen[1]["lowered_name"] and seen[0]["report"] == seen[1]["report"] > 0
    contents = compile_check.cache_contents(root)
    assert len(contents.entries) == 1 and contents.stale == 0 and contents.other_files == 0
    assert sorted(p.suffix for p in root.iterdir()) == [".cubin", ".json"]


def test_cli_info(empty_cache, capsys):
    root, _ = empty_cache
    family = lbs.SOFTMAX_ROWS_STREAMING
    compile_check.compile_all([(family, e, "sm_80") for e in family.name_expressions()[:2]], jobs=1)
    (root / "left.by.a.killed.writer.tmp").write_bytes(b"x")
    assert compile_cli.main(["--info"]) == 0
    out = capsys.readouterr().out
    assert f"compile cache: {root} (from ${_compile.ENV_CACHE_DIR}" in out
    assert "2 entries" in out and "0 stale" in out and "1 other files" in out
    assert f"CUDA headers {_compile.cuda_headers_hash()}" in out
    (row,) = [line.split() for line in out.splitlines() if family.name in line]
    assert row[:3] == [family.name, "sm_80", "2"] and row[-1] == f"2/{len(family.name_expressions())}"


@pytest.mark.parametrize("where", ["missing", "a file"])
def test_cli_info_without_a_usable_cache(where, tmp_path, monkeypatch, capsys):
    path = tmp_path / "cache"
    if where == "a file":
        path.write_text("")
    monkeypatch.setenv(_compile.ENV_CACHE_DIR, str(path))
    assert compile_cli.main(["--info"]) == 0
    out = capsys.readouterr().out
    assert str(path) in out
    assert ("cannot be listed (NotADirectoryError" in out) if where == "a file" else ("0 entries" in out)


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
