"""MkDocs hooks of the accelfn site (``hooks:`` in mkdocs.yml).

A Python block opened with `` ```python fragment `` is shown like any other but not run by
``tests/test_docs.py``; Markdown does not know the word, so it is dropped here before the page
is rendered. Any other word after ``python`` is refused, so that a misspelt marker cannot
silently leave a block unchecked.

In a table cell, each word of a code span is put in a ``<span class="word">``, which
docs/css/accelfn.css keeps on one line: the cell wraps at the span's spaces only, never inside
a word, where a browser would otherwise break after a hyphen or before a bracket
(``"max-`` ``autotune"``, ``--`` ``nproc_per_node``, ``device_ids=`` ``[rank]``).
"""

from __future__ import annotations

import re
from typing import Any

CELL = re.compile(r"<(t[dh])\b[^>]*>.*?</\1>", re.S)
CODE = re.compile(r"<code>([^<]*)</code>")  # a code span of text only (no link inside)
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


def on_page_content(html: str, **_: Any) -> str:
    """The page with each word of a table cell's code span in a ``<span class="word">``."""

    def words(code: re.Match[str]) -> str:
        inner = re.sub(r"[^ \t\n]+", lambda w: f'<span class="word">{w[0]}</span>', code[1])
        return f"<code>{inner}</code>"

    return CELL.sub(lambda cell: CODE.sub(words, cell[0]), html)
