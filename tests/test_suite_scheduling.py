"""The suite's parallel runs (tests/conftest.py): a module whose tests share a module- or
class-scoped fixture, or a result cached with functools, goes to one pytest-xdist worker
whole, so it is built once; other tests are scheduled one by one."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import worker_unit

ROOT = Path(__file__).resolve().parents[1]


SHARED = {"module": "@pytest.fixture(scope='module')", "class": "@pytest.fixture(scope='class')",
          "lru_cache": "@functools.lru_cache(maxsize=1)", "cache": "@cache"}


@pytest.mark.parametrize("kind", SHARED)
def test_a_module_with_a_shared_fixture_goes_to_one_worker_whole(tmp_path, kind):
    tests = tmp_path / "tests"
    tests.mkdir()
    (tests / "test_shared.py").write_text(
        "import functools\nfrom functools import cache\nimport pytest\n"
        f"{SHARED[kind]}\n"
        "def run():\n    return 1\n"
        "def test_a(run):\n    pass\n"
        "def test_b():\n    pass\n")
    (tests / "test_alone.py").write_text(  # names a cache, caches nothing
        "import functools\nimport pytest\n@pytest.fixture\ndef each():\n"
        "    return functools.lru_cache, {'scope': 'module'}\n"
        "def test_a(each):\n    pass\n")
    shared: dict[str, bool] = {}
    assert worker_unit("tests/test_shared.py::test_a", tmp_path, shared) == "tests/test_shared.py"
    assert worker_unit("tests/test_shared.py::test_b", tmp_path, shared) == "tests/test_shared.py"
    alone = "tests/test_alone.py::test_a"
    assert worker_unit(alone, tmp_path, shared) == alone
    assert shared == {"tests/test_shared.py": True, "tests/test_alone.py": False}


def test_the_suites_own_modules_are_split_as_their_fixtures_say():
    shared: dict[str, bool] = {}
    bench = "tests/cli/test_bench.py::test_quick_writes_the_json_and_png_it_prints"
    assert worker_unit(bench, ROOT, shared) == "tests/cli/test_bench.py"  # quick_run
    ema = "tests/test_ema.py::test_anything"
    assert worker_unit(ema, ROOT, shared) == ema


def test_every_test_process_runs_one_intra_op_thread():
    assert torch.get_num_threads() == 1
