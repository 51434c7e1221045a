"""Findings: the unit every checker in accelfn reports (doctor, monitor, diagnostics).

A :class:`Finding` says what was checked, how bad it is, what was seen and how to fix it;
:func:`format_findings` and :func:`worst_severity` summarise a list of them.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import asdict, dataclass
from typing import Any, Literal

__all__ = ["Finding", "Severity", "format_findings", "worst_severity"]

Severity = Literal["ok", "info", "warning", "error"]
_RANK: dict[str, int] = {"ok": 0, "info": 1, "warning": 2, "error": 3}


@dataclass(frozen=True)
class Finding:
    """One result of a check: ``check`` (a short id), ``severity``, ``message`` and ``fix``.

    ``severity`` is ``"ok"`` (the check passed), ``"info"`` (worth knowing), ``"warning"``
    (costs speed or correctness, training still runs) or ``"error"`` (broken).
    """

    check: str
    severity: Severity
    message: str
    fix: str | None = None

    def __str__(self) -> str:
        head = f"[{self.severity.upper():7}] {self.check}: {self.message}"
        return head + (f"\n          fix: {self.fix}" if self.fix else "")

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict."""
        return asdict(self)


def worst_severity(findings: Iterable[Finding]) -> Severity:
    """The most serious severity among ``findings`` (``"ok"`` when there are none)."""
    worst: Severity = "ok"
    for f in findings:
        if _RANK[f.severity] > _RANK[worst]:
            worst = f.severity
    return worst


def format_findings(findings: Iterable[Finding], *, min_severity: Severity = "ok") -> str:
    """Findings as text, most serious first, dropping those below ``min_severity``."""
    kept = [f for f in findings if _RANK[f.severity] >= _RANK[min_severity]]
    kept.sort(key=lambda f: -_RANK[f.severity])
    return "\n".join(str(f) for f in kept) if kept else "(no findings)"

