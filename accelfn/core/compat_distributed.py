"""The private torch.distributed APIs that name a hung collective, behind one name each.

As :mod:`accelfn.core.compat` for the rest: torch's Flight Recorder (the ring buffer of the
latest collectives each process group ran, which ProcessGroupGloo and ProcessGroupNCCL fill
when ``TORCH_FR_BUFFER_SIZE`` is above 0; gloo's in the CPU recorder, NCCL's in its own) is
dumped by ``torch._C._distributed_c10d._dump_fr_trace`` (``_dump_nccl_trace`` under NCCL:
the pickle that NCCL's watchdog writes to ``TORCH_FR_DUMP_TEMP_FILE<rank>`` on a timeout,
and that torch's analyser ``torchfrtrace`` reads back with
``torch.distributed.flight_recorder.components.loader.read_dump``); the default group's store
(where processes can still leave each other a word once a collective failed) is
``distributed_c10d._get_default_store``. ``tests/observe/test_hang_dumps.py`` and
``test_stragglers.py`` run each of them under gloo.
"""

from __future__ import annotations

import os
import pickle
from typing import Any

from torch._C._distributed_c10d import Store

__all__ = ["default_store", "flight_recorder_dump", "flight_recorder_entries",
           "flight_recorder_trace", "read_dump"]


def _nccl() -> bool:
    """True under an NCCL default group: its collectives are in NCCL's recorder."""
    import torch.distributed as dist

    return dist.is_initialized() and dist.get_backend() == "nccl"


def flight_recorder_dump() -> bytes:
    """This process's Flight Recorder as torch's own writer stores it: a pickled dict with
    ``version``, ``pg_config``, ``pg_status`` and ``entries`` (one per recorded collective:
    ``collective_seq_id``, ``profiling_name`` such as ``"gloo:all_reduce"``, ``state``,
    ``process_group``, sizes, ``timeout_ms``, ``frames``); empty entries when recording is
    off."""
    from torch._C import _distributed_c10d as c10d

    if _nccl():
        return bytes(c10d._dump_nccl_trace())  # type: ignore[attr-defined]
    return bytes(c10d._dump_fr_trace())  # type: ignore[attr-defined]


def flight_recorder_trace() -> dict[str, Any]:
    """[`flight_recorder_dump`][] read back (a dump of this very process: trusted)."""
    trace = pickle.loads(flight_recorder_dump())
    return trace if isinstance(trace, dict) else {}


def read_dump(prefix: str, path: str | os.PathLike[str]) -> dict[str, Any]:
    """One rank's dump file as torch's analyser reads it
    (``flight_recorder.components.loader.read_dump``): ``rank`` (from the file name after
    ``prefix``), ``entries``, ``version`` and ``pg_config``."""
    from torch.distributed.flight_recorder.components.loader import read_dump as torch_read

    return dict(torch_read(prefix, os.fspath(path)))


def default_store() -> Store:
    """The store of the default process group (torchrun's, under a prefix)."""
    from torch.distributed.distributed_c10d import _get_default_store

    return _get_default_store()


def flight_recorder_entries() -> list[dict[str, Any]]:
    """This process's Flight Recorder entries without their stack frames (the cheapest of
    torch's dumps: about 4 ms for 256 entries on a loaded 2-core CPU, the JSON one 4 times
    that): each has ``pg_id``, ``process_group``, ``collective_seq_id``, ``profiling_name``,
    ``time_created_ns`` (the wall clock when the process called the collective)."""
    from torch._C import _distributed_c10d as c10d

    if _nccl():
        data = c10d._dump_nccl_trace(True, False, False)  # type: ignore[attr-defined]
    else:
        data = c10d._dump_fr_trace(True, False, False)  # type: ignore[attr-defined]
    trace = pickle.loads(bytes(data))  # this process's own bytes: trusted
    entries = trace.get("entries", []) if isinstance(trace, dict) else []
    return entries if isinstance(entries, list) else []
