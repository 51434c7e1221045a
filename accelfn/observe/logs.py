"""accelfn's log records: a logger per package, silent unless configured, rank 0 by default.

Each package logs with the standard ``logging`` module to ``accelfn.<package>``
(``accelfn.observe``, ``accelfn.checkpointing``, ...), so an application routes and filters
accelfn's messages like any library's:

    import logging
    logging.basicConfig(level=logging.INFO)             # everything, accelfn included
    logging.getLogger("accelfn").setLevel(logging.WARNING)   # or accelfn's warnings only

or in one call, [`configure_logging`][]. Until the application configures logging, accelfn
prints nothing: the ``accelfn`` logger has a ``NullHandler`` (so not even Python's
last-resort handler writes its warnings). Under ``torchrun`` only rank 0's records pass the
accelfn loggers (a record carries its ``rank``); ``configure_logging(all_ranks=True)`` lets
every rank's through. Warnings (``warnings.warn``: a deprecated option, a costly setting)
stay warnings, filtered with the ``warnings`` module.

What a user asks for explicitly is no log record: the [`Monitor`][accelfn.Monitor]'s progress
bar is its own console output (``Monitor(progress=False)`` turns it off, ``file=`` sends
it elsewhere), and its report is printed by the script (``print(monitor.report())``).
"""

from __future__ import annotations

import logging
import os
import sys
from typing import IO

import torch.distributed as dist

__all__ = ["LOGGER", "RankFilter", "configure_logging", "get_logger"]

#: The name of the logger above every accelfn package's.
LOGGER = "accelfn"

DEFAULT_FORMAT = "%(asctime)s %(name)s %(levelname)s: %(message)s"
RANKS_FORMAT = "%(asctime)s %(name)s [rank %(rank)s] %(levelname)s: %(message)s"


def _rank() -> int:
    """This process's rank: torch.distributed's once initialised, else torchrun's ``RANK``."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    try:
        return int(os.environ.get("RANK", "0") or 0)
    except ValueError:
        return 0


class RankFilter(logging.Filter):
    """Passes the records of rank 0 only (all ranks' when ``all_ranks``); sets
    ``record.rank`` on each record it sees."""

    def __init__(self, all_ranks: bool = False) -> None:
        super().__init__()
        self.all_ranks = all_ranks

    def filter(self, record: logging.LogRecord) -> bool:
        rank = _rank()
        record.rank = rank
        return self.all_ranks or rank == 0


#: The filter on every accelfn logger and on the handler of configure_logging.
_FILTER = RankFilter()
_HANDLER: logging.Handler | None = None
logging.getLogger(LOGGER).addHandler(logging.NullHandler())


def get_logger(package: str) -> logging.Logger:
    """``logging.getLogger("accelfn." + package)`` with the rank filter on it."""
    log = logging.getLogger(f"{LOGGER}.{package}" if package else LOGGER)
    if _FILTER not in log.filters:
        log.addFilter(_FILTER)
    return log


def configure_logging(level: int | str = logging.INFO, *, all_ranks: bool = False,
                      stream: IO[str] | None = None, fmt: str | None = None,
                      ) -> logging.Handler:
    """Print accelfn's records of ``level`` and above to ``stream`` (default ``sys.stderr``).

    Equivalent to adding a ``logging.StreamHandler(stream)`` to the ``accelfn`` logger and
    setting its level; called again, it replaces the handler it added before. ``all_ranks``:
    every rank's records under ``torchrun``, each line naming its rank (default: rank 0's
    only). ``fmt`` is a ``logging.Formatter`` format. Returns the handler (remove it with
    ``logging.getLogger("accelfn").removeHandler(handler)``).
    """
    global _HANDLER
    if isinstance(level, str):
        named = logging.getLevelName(level.upper())
        if not isinstance(named, int):
            raise ValueError(f"configure_logging(level={level!r}): not a logging level; use "
                             "DEBUG, INFO, WARNING, ERROR or CRITICAL")
        level = named
    root = logging.getLogger(LOGGER)
    _FILTER.all_ranks = all_ranks
    if _HANDLER is not None:
        root.removeHandler(_HANDLER)
    handler = logging.StreamHandler(stream if stream is not None else sys.stderr)
    handler.setFormatter(logging.Formatter(
        fmt or (RANKS_FORMAT if all_ranks else DEFAULT_FORMAT)))
    handler.addFilter(_FILTER)
    root.addHandler(handler)
    root.setLevel(level)
    _HANDLER = handler
    return handler
