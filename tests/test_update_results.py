"""bench/update_results.py renders the README's results block in words a reader can follow: no internal names, every
column defined, the run's note kept to bench/RESULTS.md (CPU; a synthetic payload shaped like bench/main.py's)."""
import importlib.util
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parent.parent
INTERNAL = ("seed", "session", "spin", "post_us", "first_us", "device_ms", "ratio_to_gemm", "headline", "_ms", "_us")


def _update_results():
    spec = importlib.util.spec_from_file_location("update_results", ROOT / "bench" / "update_results.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _payload(sdpa_columns):
    sdpa = [dict(name=name, dtype="float16", shape=(32, 32, 512, 512, 1024, 1024), backend="split", ms=2.2,
                 tflops=498.0, torch_default_ms=7.4, torch_best="default", speedup_default=3.37, speedup_best=3.37,
                 max_err=1.7e-4, torch_err=1.5e-4) for name in ("seed", "seed causal", "seed x4 batch", "D=64")]
    keys = ["name", "dtype", "mode", "ms", "device_ms", "gemm_ms", "gemm_device_ms", "post_us", "torch_ms",
            "torch_gemm_ms", "speedup", "ratio_to_gemm", "tflops", "max_err", "torch_err", "host_us", "torch_host_us",
            "first_us"]
    lbs = [{k: ("linear_bn_softmax" if k == "name" else "float16" if k == "dtype" else "eval" if k == "mode" else 1.5)
            for k in keys}]
    return {"env": dict(date="2026-11-21", gpu="NVIDIA H200", cuda_runtime=13020, cupy="14.2.0",
                        torch="2.11.0+cu130", python="3.12.3"),
            "command": "python bench/main.py",
            "sections": [
                {"name": "bench_sdpa", "title": "scaled_dot_product_attention (seed shape (32, 32, 512, 1024))",
                 "rows": sdpa, "columns": sdpa_columns},
                {"name": "bench_linear_bn_softmax", "title": "Linear → BatchNorm1d → scale → softmax",
                 "rows": lbs, "columns": [(k, k, "" if k in ("name", "dtype", "mode") else ".3f") for k in keys]}]}


def test_readme_block_has_no_internal_words_and_defines_its_columns():
    ur = _update_results()
    import sys
    sys.path.insert(0, str(ROOT / "bench"))
    from bench_sdpa import COLUMNS
    full, short = ur.render(_payload(COLUMNS), note="Session 9 (internal note)")
    assert "Session 9" in full and "Session" not in short
    lowered = short.lower()
    for word in INTERNAL:
        assert word not in lowered, word
    assert "the torch installed on that GPU machine" in short and "D=64" not in short
    for section, columns in ur.README_COLUMNS.items():
        words = ur.README_WORDS[section]
        for _, header in columns:
            assert header in ("dtype",) or f"*{header}*" in words, (section, header)
    headers = re.findall(r"^\| (case .*) \|$", short, flags=re.M)
    assert len(headers) == 2


def test_readme_block_is_the_generators():
    """The README's block has the generator's form (its definitions are there verbatim)."""
    ur = _update_results()
    readme = (ROOT / "README.md").read_text()
    block = readme[readme.index("<!-- results:start -->"):readme.index("<!-- results:end -->")]
    for words in ur.README_WORDS.values():
        assert words in block
