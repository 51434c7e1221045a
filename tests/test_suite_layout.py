"""The suite's layout: tests mirror the core's modules, and take shared helpers from
tests/helpers.py, not from conftest (which keeps pytest's hooks and fixtures)."""

from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parent
PACKAGE = TESTS.parent / "accelfn"
# the modules named by the engine's sequence, and data's protocols and language-model data:
# each has a test module of its own name
MIRRORED = {"core": ("compat", "optimizers", "plan", "state"),
            "step": ("agreement", "captured", "chain", "checks", "engine", "micro", "spec"),
            "data": ("document_masks", "epochs", "packing", "token_batches", "tokens"),
            # the monitor's wing: the modules with a test module of their own (records,
            # report, verdict... are tested through the monitor's)
            "observe/monitor": ("aggregates", "monitor", "options", "outputs", "plots",
                                "progress_bars", "sinks", "stragglers", "trackers")}
# a built-in's mechanism (accelfn/parts/<module>.py) is tested through its public transform
PARTS = {"accumulation": "transforms/test_accumulation.py",
         "activation_checkpointing": "transforms/test_activation_checkpointing.py",
         "averaging": "test_ema.py",
         "capture": "transforms/test_capture_refusals.py",
         "clipping": "transforms/test_clipping.py", "nonfinite": "transforms/test_nonfinite.py",
         "compilation": "transforms/test_compiled.py",
         "float8": "transforms/test_float8.py",
         "compile_cache": "transforms/test_compiled.py",
         "compile_regions": "transforms/test_compiled_steps.py",
         "precision": "transforms/test_amp.py", "sharding": "transforms/test_distributed.py"}


def test_the_steps_modules_have_test_modules_of_their_names():
    for package, names in MIRRORED.items():
        assert all((PACKAGE / package / f"{name}.py").exists() for name in names), (
            f"a module of {package}/ was renamed: update MIRRORED")
        missing = [name for name in names
                   if not (TESTS / package / f"test_{name}.py").exists()]
        assert not missing, f"add tests/{package}/test_<module>.py for {missing}"


def test_every_part_has_the_test_module_of_its_transform():
    found = {p.stem for p in (PACKAGE / "parts").glob("*.py") if p.stem != "__init__"}
    assert found == set(PARTS), f"name the test module of each of {sorted(found)} in PARTS"
    missing = [test for test in PARTS.values() if not (TESTS / test).exists()]
    assert not missing, f"missing {missing}"


def test_no_test_takes_helpers_from_conftest():
    found = []
    for path in TESTS.rglob("*.py"):
        if path.name in ("conftest.py", "test_suite_scheduling.py"):  # the latter tests it
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and node.module == "conftest":
                found.append(f"{path.relative_to(TESTS)}:{node.lineno}")
    assert not found, f"import shared helpers from helpers, not conftest: {found}"


def test_test_modules_have_unique_names():
    """pytest imports a test module by its file name (tests/ has no __init__.py): two files
    of one name in different folders make the second an import error."""
    seen: dict[str, Path] = {}
    clashes = []
    for path in sorted(TESTS.rglob("test_*.py")):
        if path.name in seen:
            clashes.append(f"{seen[path.name].relative_to(TESTS)} and {path.relative_to(TESTS)}")
        seen.setdefault(path.name, path)
    assert not clashes, f"rename one of each: {clashes}"
