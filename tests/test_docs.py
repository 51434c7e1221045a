"""The docs stay true to the code: the API page is current, the site builds, examples run."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"


def test_api_reference_is_current():
    proc = subprocess.run([sys.executable, str(DOCS / "gen_api.py"), "--check"],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


def test_site_builds_strictly(tmp_path):
    pytest.importorskip("mkdocs")
    proc = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir",
                           str(tmp_path / "site")], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_every_transform_has_a_page_listed_in_the_site():
    import accelfn as af

    nav = (ROOT / "mkdocs.yml").read_text()
    for name in ("with_amp", "with_accumulation", "with_clipping", "compiled", "checkpointed",
                 "distributed", "with_nonfinite"):
        assert getattr(af, name)
        assert (DOCS / "transforms" / f"{name}.md").exists()
        assert f"transforms/{name}.md" in nav


def test_relative_links_resolve():
    broken = []
    for page in DOCS.rglob("*.md"):
        for target in re.findall(r"\]\(([^)#:]+\.(?:md|png))", page.read_text()):
            if not (page.parent / target).resolve().exists():
                broken.append(f"{page.relative_to(ROOT)} -> {target}")
    assert broken == []


def test_getting_started_code_runs():
    text = (DOCS / "index.md").read_text()
    code = re.search(r"## Your first step\n\n```python\n(.*?)```", text, re.S).group(1)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          cwd=ROOT, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    last = proc.stdout.strip().splitlines()[-1].split()
    assert last[0] == "2" and float(last[2]) > 0.5  # accuracy after 3 epochs
