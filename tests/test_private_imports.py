"""No module of the package reads another module's private names (CPU): what one module offers another is public, so
a reader finds the package's internal interfaces by their names, and a private name can change without a search."""
import ast
import pathlib

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "cupy_attn"


def _module(path: pathlib.Path) -> str:
    return ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts).removesuffix(".__init__")


def _resolve(module: str, is_package: bool, level: int, name: str | None) -> str:
    """The absolute module a ``from ... import`` names."""
    if level == 0:
        return name or ""
    parts = module.split(".") if is_package else module.split(".")[:-1]
    parts = parts[:len(parts) - (level - 1)]
    return ".".join(parts + ([name] if name else []))


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def private_uses() -> list[str]:
    """``from cupy_attn.x import _name`` and ``alias._name`` where alias is a cupy_attn module or name imported into
    another module, as "module:line: what"."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        module, is_package = _module(path), path.name == "__init__.py"
        tree = ast.parse(path.read_text())
        aliases = {}
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                source = _resolve(module, is_package, node.level, node.module)
                if not source.startswith("cupy_attn") or source == module:
                    continue
                for alias in node.names:
                    if _private(alias.name):
                        found.append(f"{module}:{node.lineno}: from {source} import {alias.name}")
                    aliases[alias.asname or alias.name] = f"{source}.{alias.name}"
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name.startswith("cupy_attn"):
                        aliases[alias.asname or alias.name.split(".")[0]] = alias.name
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases
                    and _private(node.attr)):
                found.append(f"{module}:{node.lineno}: {node.value.id}.{node.attr} ({aliases[node.value.id]})")
    return found


def test_no_module_reads_another_modules_private_names():
    assert not private_uses(), "\n".join(private_uses())


def test_the_scan_sees_private_names(tmp_path, monkeypatch):
    """The scan itself: both forms are found in a throwaway package."""
    pkg = tmp_path / "cupy_attn"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "sub" / "a.py").write_text("_x = 1\ny = 2\n")
    (pkg / "sub" / "b.py").write_text("from .a import _x, y\nfrom . import a as mod\nprint(mod._x, mod.y, y)\n")
    monkeypatch.setattr(__import__(__name__), "PACKAGE", pkg)
    assert private_uses() == ["cupy_attn.sub.b:1: from cupy_attn.sub.a import _x",
                              "cupy_attn.sub.b:3: mod._x (cupy_attn.sub.a)"]
