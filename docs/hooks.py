"""MkDocs hooks of the accelfn site (``hooks:`` in mkdocs.yml).

A Python block opened with `` ```python fragment `` is shown like any other but not run by
``tests/test_docs.py``; Markdown does not know the word, so it is dropped here before the page
is rendered. Any other word after ``python`` is refused, so that a misspelt marker cannot
silently leave a block unchecked.
"""

from __future__ import annotations

import re
from typing import Any

FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>`{3,}|~{3,})python(?P<rest>[^\n`]*)$", re.M)


def on_page_markdown(markdown: str, page: Any, **_: Any) -> str:
    """The page with `` ```python fragment `` fences turned into plain `` ```python `` ones."""

    def fix(m: re.Match[str]) -> str:
        rest = m["rest"].strip()
        if rest not in ("", "fragment"):
            raise ValueError(f"{page.file.src_path}: a Python block is opened with "
                             f"{m['fence']}python {rest}; write {m['fence']}python (run by the "
                             f"tests) or {m['fence']}python fragment (shown, not run)")
        return f"{m['indent']}{m['fence']}python"

    return FENCE.sub(fix, markdown)
