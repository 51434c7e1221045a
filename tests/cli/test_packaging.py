"""The package's metadata as an installer sees it: built by setuptools from pyproject.toml."""

from __future__ import annotations

import email
import shutil
import subprocess
import sys
from email.message import Message
from pathlib import Path

import pytest

import accelfn

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def metadata(tmp_path_factory: pytest.TempPathFactory) -> Message:
    """METADATA of the wheel setuptools would build (from a copy: the tree is not touched)."""
    src = tmp_path_factory.mktemp("src")
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy(ROOT / name, src / name)
    (src / "accelfn").mkdir()
    (src / "accelfn" / "__init__.py").write_text("")
    out = src / "meta"
    out.mkdir()
    code = ("import sys, warnings; warnings.simplefilter('error');"
            "from setuptools import build_meta;"
            "print(build_meta.prepare_metadata_for_build_wheel(sys.argv[1]))")
    proc = subprocess.run([sys.executable, "-c", code, str(out)], cwd=src,
                          capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    dist_info = out / proc.stdout.strip().splitlines()[-1]
    assert (dist_info / "licenses" / "LICENSE").read_text() == (ROOT / "LICENSE").read_text()
    return email.message_from_string((dist_info / "METADATA").read_text())


def test_license_is_an_spdx_expression_with_its_file(metadata: Message) -> None:
    assert metadata["License-Expression"] == "BSD-3-Clause"
    assert metadata.get_all("License-File") == ["LICENSE"]
    assert metadata["License"] is None  # the deprecated table form is gone
    text = (ROOT / "LICENSE").read_text()
    assert text.startswith("BSD 3-Clause License")
    assert "Copyright (c) 2026, accelfn developers" in text


def test_version_matches_the_package(metadata: Message) -> None:
    assert metadata["Version"] == accelfn.__version__


def test_classifiers_are_known_and_say_what_is_supported(metadata: Message) -> None:
    classifiers = metadata.get_all("Classifier")
    for expected in ("Programming Language :: Python :: 3.10",
                     "Programming Language :: Python :: 3.11",
                     "Programming Language :: Python :: 3.12",
                     "Operating System :: OS Independent", "Typing :: Typed"):
        assert expected in classifiers
    # PEP 639: the license is the expression, never a classifier as well
    assert not [c for c in classifiers if c.startswith("License ::")]
    import trove_classifiers as trove  # the test extra installs it

    assert set(classifiers) <= trove.classifiers, set(classifiers) - trove.classifiers


def test_typed_marker_ships() -> None:
    assert (Path(accelfn.__file__).parent / "py.typed").exists()
    assert '"py.typed"' in (ROOT / "pyproject.toml").read_text()
