"""The package layout: imports point inward only (DESIGN.md section 7), checked on the source."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2] / "accelfn"

# package -> the other accelfn packages its modules may import
ALLOWED: dict[str, set[str]] = {
    "core": set(),
    "parts": {"core"},
    "step": {"core", "parts"},
    "transforms": {"core", "parts", "step"},
    "data": {"core"},
    "observe": {"core", "step"},
    # the monitor's wing (observe/monitor/): stands on the rest of observe, which never
    # imports it
    "observe.monitor": {"core", "step", "observe"},
    "checkpointing": {"core", "step"},
    "recipes": {"core", "data"},
    "testing": {"core", "parts", "step", "transforms", "observe"},
    "cli": {"core", "step", "transforms", "data", "observe", "checkpointing", "recipes",
            "__init__"},
    "assets": set(),
}
PACKAGES = set(ALLOWED)
MAX_LINES = 500


def _modules() -> list[Path]:
    return sorted(p for p in ROOT.rglob("*.py") if p.name != "__main__.py")


def _package(path: Path) -> str:
    rel = path.relative_to(ROOT)
    if rel.parts[:2] == ("observe", "monitor"):
        return "observe.monitor"
    return rel.parts[0].removesuffix(".py") if len(rel.parts) > 1 or rel.stem != "__init__" \
        else "__init__"


def _target(name: str) -> str:
    """The entry of ALLOWED the module ``name`` (dotted, below accelfn) belongs to."""
    return "observe.monitor" if name.split(".")[:2] == ["observe", "monitor"] \
        else name.split(".")[0]


def _imported(path: Path) -> list[tuple[str, int]]:
    """The accelfn modules ``path`` imports, as dotted names below accelfn, with line numbers."""
    tree = ast.parse(path.read_text(), str(path))
    here = path.relative_to(ROOT).with_suffix("").parts
    package = here[:-1]  # the package relative imports start from
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(a.name.removeprefix("accelfn."), node.lineno) for a in node.names
                     if a.name == "accelfn" or a.name.startswith("accelfn.")]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - node.level + 1]
                name = ".".join([*base, *(node.module.split(".") if node.module else [])])
            elif node.module and (node.module == "accelfn" or node.module.startswith("accelfn.")):
                name = node.module.removeprefix("accelfn").removeprefix(".")
            else:
                continue
            if not name:  # `from . import x` at the top: x is the package
                out += [(a.name, node.lineno) for a in node.names]
            else:
                out.append((name, node.lineno))
    return out


@pytest.mark.parametrize("path", _modules(), ids=lambda p: str(p.relative_to(ROOT)))
def test_imports_point_inward(path: Path) -> None:
    package = _package(path)
    if package == "__init__":
        return  # the public re-exports may name every layer
    allowed = ALLOWED[package] | {package}
    for name, line in _imported(path):
        target = _target(name)
        if name == "accelfn" or target not in PACKAGES:  # the top-level public API
            target = "__init__"
        assert target in allowed, (
            f"{path.relative_to(ROOT)}:{line} imports accelfn.{name}: {package} may import "
            f"only {sorted(allowed)}")
        if package == "transforms" and target == "transforms":
            # a transform's own module, or the modules of its own package (transforms/x/*.py)
            own = path.relative_to(ROOT).with_suffix("").parts
            mine = ".".join(own[:2]) if len(own) > 2 else ".".join(own)
            assert name in ("transforms", mine) or name.startswith(mine + "."), (
                f"{path.relative_to(ROOT)}:{line} imports accelfn.{name}: a transform never "
                "imports another transform")


def _module_name(path: Path) -> str:
    """``path``'s dotted name below accelfn (a package's ``__init__.py`` is the package)."""
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_module(name: str) -> bool:
    base = ROOT.joinpath(*name.split("."))
    return base.with_suffix(".py").exists() or (base / "__init__.py").exists()


def _imported_modules(path: Path) -> set[str]:
    """The accelfn modules ``path`` imports (``from .x import name`` resolved to the module
    ``x.name`` where that is one), wherever the import stands: at the top, under
    ``TYPE_CHECKING`` or in a function, so none of these can hide a circle."""
    tree = ast.parse(path.read_text(), str(path))
    package = path.relative_to(ROOT).with_suffix("").parts[:-1]
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out |= {a.name.removeprefix("accelfn.") for a in node.names
                    if a.name.startswith("accelfn.")}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = ".".join([*package[: len(package) - node.level + 1],
                                 *(node.module.split(".") if node.module else [])])
            elif node.module and node.module.startswith("accelfn."):
                base = node.module.removeprefix("accelfn.")
            else:
                continue
            for alias in node.names:
                name = f"{base}.{alias.name}" if base else alias.name
                out.add(name if _is_module(name) else base)
    return {name for name in out if name and _is_module(name)}


def _cycles(packages: tuple[str, ...]) -> list[list[str]]:
    """The import circles among the modules of ``packages`` (one path per circle found)."""
    graph = {_module_name(p): _imported_modules(p) for package in packages
             for p in (ROOT / package).rglob("*.py")}
    found: list[list[str]] = []
    done: set[str] = set()
    path: list[str] = []

    def visit(name: str) -> None:
        path.append(name)
        for target in sorted(graph.get(name, ())):
            if target in path:
                found.append([*path[path.index(target):], target])
            elif target not in done and target in graph:
                visit(target)
        path.pop()
        done.add(name)

    for name in sorted(graph):
        if name not in done:
            visit(name)
    return found


def test_data_and_core_have_no_import_circle() -> None:
    # a module imports only modules below it: a piece two modules need lives in a leaf
    # (data/epochs.py: the epoch protocol and reading_state) or with its owner
    cycles = _cycles(("core", "data"))
    assert not cycles, "import circles: " + "; ".join(" -> ".join(c) for c in cycles) + (
        ": move what both modules need into a leaf module, or to the module that owns it")


def test_observe_has_no_import_circle() -> None:
    # the monitor's plot draws any report with the fields it reads (a protocol), so
    # observe/monitor/plots.py never imports the report it is called from
    cycles = _cycles(("observe",))
    assert not cycles, "import circles: " + "; ".join(" -> ".join(c) for c in cycles)


@pytest.mark.parametrize("path", _modules(), ids=lambda p: str(p.relative_to(ROOT)))
def test_modules_stay_small(path: Path) -> None:
    lines = len(path.read_text().splitlines())
    assert lines <= MAX_LINES, f"{path.relative_to(ROOT)} has {lines} lines (at most {MAX_LINES})"


def test_no_public_name_shadows_a_submodule() -> None:
    import importlib
    import pkgutil

    import accelfn

    for info in pkgutil.walk_packages(accelfn.__path__, "accelfn."):
        if info.name == "accelfn.__main__":
            continue
        parent_name, _, leaf = info.name.rpartition(".")
        parent = importlib.import_module(parent_name)
        module = importlib.import_module(info.name)
        value = getattr(parent, leaf, module)
        assert value is module, (
            f"{parent_name}.{leaf} is {type(value).__name__}, shadowing the submodule "
            f"{info.name}; rename one of them")


def test_the_reference_oracle_imports_nothing_from_accelfn() -> None:
    # the plain update every step is checked against cannot share a mistake with the engine
    path = ROOT / "testing" / "reference.py"
    assert _imported(path) == []
    tree = ast.parse(path.read_text())
    roots = {alias.name.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.Import)
             for alias in node.names}
    roots |= {node.module.split(".")[0] for node in ast.walk(tree)
              if isinstance(node, ast.ImportFrom) and node.module and not node.level}
    assert roots <= {"__future__", "collections", "contextlib", "typing", "torch"}, roots
