"""The environment variables are declared once (cupy_attn/runtime/env.py): every CUPY_ATTN_ name the package uses is
in the table, read through env.get, keyed by the call cache when it changes the launch, and in the README (CPU)."""
import ast
import pathlib
import re

import pytest

from cupy_attn.runtime import callcache, env

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "cupy_attn"
NAME = re.compile(r"CUPY_ATTN_[A-Z0-9_]+")
# Read directly: compile.py's other variables (XDG_CACHE_HOME, CUDA_PATH, CUDA_HOME: not cupy_attn's; it reads
# CUPY_ATTN_CACHE_DIR through env.get) and callcache.env_values (the call cache's key, reading env.CALL_KEY's names from
# os.environ's own mapping: ~0.4 µs a name less than os.environ.get).
DIRECT_READERS = {"runtime/compile.py", "runtime/callcache.py", "runtime/env.py"}


def test_every_name_the_package_uses_is_declared():
    """Every CUPY_ATTN_ name in cupy_attn/**/*.py (code, strings, comments) is declared, and every declared one is
    used outside env.py; ``-DCUPY_ATTN_...`` are NVRTC macros, not environment variables."""
    used = {}
    for path in PACKAGE.rglob("*.py"):
        if path.name == "env.py" and path.parent.name == "runtime":
            continue
        text = re.sub(r"-D" + NAME.pattern, "", path.read_text())
        for name in NAME.findall(text):
            used.setdefault(name, str(path.relative_to(ROOT)))
    undeclared = {name: where for name, where in used.items() if name not in env.BY_NAME}
    assert not undeclared, f"not in cupy_attn/runtime/env.py's KNOBS: {undeclared}"
    assert set(env.BY_NAME) <= set(used), f"declared but unused: {set(env.BY_NAME) - set(used)}"


def test_modules_read_through_env_get():
    """No module but env.py (and the two direct readers above) calls os.environ or os.getenv."""
    offenders = []
    for path in PACKAGE.rglob("*.py"):
        rel = str(path.relative_to(PACKAGE))
        if rel in DIRECT_READERS:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "os" \
                    and node.attr in ("environ", "getenv", "putenv"):
                offenders.append(f"{rel}:{node.lineno}")
    assert not offenders, f"read CUPY_ATTN_ variables through cupy_attn.runtime.env.get: {offenders}"
    # The direct readers read no CUPY_ATTN_ variable by name (compile.py: CUPY_ATTN_CACHE_DIR through env.get).
    tree = ast.parse((PACKAGE / "runtime" / "compile.py").read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get" \
                and ast.unparse(node.func.value) == "os.environ":
            arg = ast.unparse(node.args[0])
            assert "CUPY_ATTN" not in arg and arg != "ENV_CACHE_DIR", f"compile.py:{node.lineno} reads {arg}"


def test_get_refuses_an_undeclared_name(monkeypatch):
    monkeypatch.setenv("CUPY_ATTN_FA3", "2")
    monkeypatch.delenv("CUPY_ATTN_D512", raising=False)
    assert env.get("CUPY_ATTN_FA3") == "2" and env.get("CUPY_ATTN_D512", "x") == "x"
    with pytest.raises(KeyError, match="not declared"):
        env.get("CUPY_ATTN_NO_SUCH_KNOB")


def test_call_cache_keys_the_launch_knobs(monkeypatch):
    assert callcache.ENV_KEYS == tuple(k.name for k in env.KNOBS if k.launch)
    assert len(set(callcache.ENV_KEYS)) == len(callcache.ENV_KEYS)
    for name in callcache.ENV_KEYS:
        monkeypatch.delenv(name, raising=False)
    before = callcache.env_values()
    monkeypatch.setenv("CUPY_ATTN_SPLIT_PV", "2")
    assert callcache.env_values() != before, "a launch knob changes the key"


def test_readme_table_is_the_declared_one():
    text = (ROOT / "README.md").read_text()
    block = re.search(r"<!-- env:start -->\n(.*?)\n<!-- env:end -->", text, re.S)
    assert block, "README.md has no <!-- env:start --> ... <!-- env:end --> block"
    assert block.group(1) == env.markdown_table(), "regenerate it: python -m cupy_attn.runtime.env"
    for knob in env.KNOBS:
        assert f"`{knob.name}`" in block.group(1)
