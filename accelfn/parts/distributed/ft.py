"""Fault tolerance across replica groups with torchft: ``distributed(fault_tolerance=...)``.

Equivalent to torchft's own loop (``Manager`` + ``OptimizerWrapper``) around accelfn's
update: each *replica group* (one torchrun job, DDP or FSDP2 over its processes: HSDP whose
replicate dimension is torchft's) asks torchft's lighthouse for a quorum of live groups at
the start of every update, heals from a live peer when it is behind (the whole ``TrainState``
sent by torchft's checkpoint transport), sums its gradients and sample counts with the other
live groups after its own reduction (each process' gradients, its shards under FSDP2, with
the same rank's of the other groups), and applies the update only when
``manager.should_commit()`` says every process of the group succeeded. A group that dies
leaves the others training with fewer replicas; it is restarted (torchrun's
``--max-restarts``, or by hand) and heals at its first update.

What it does not promise: the run equals an uninterrupted one only where every group took
part; an update taken with fewer replicas averages fewer samples, and the update in flight
when a group died is not applied by the survivors (at most that one is lost). The record of
which updates ran with how many groups is kept in the state (slot ``fault_tolerance``,
[`fault_tolerance_report`][]) and written as JSON where ``report=`` says.
"""

from __future__ import annotations

import atexit
import dataclasses
import json
import os
import socket
import time
import weakref
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from ...core import compat
from ...core.contexts import UpdateContext
from ...core.state import TrainState

__all__ = ["FaultTolerance", "fault_tolerance_report"]

SLOT = "fault_tolerance"
REPORT_EVERY = 10.0  # seconds: the JSON report is rewritten at least this often
LIGHTHOUSE_ENV = "TORCHFT_LIGHTHOUSE"
_START = ("start one with `torchft_lighthouse --min_replicas 1 --join_timeout_ms 10000` "
          "(installed with accelfn[ft]; it listens on [::]:29510) and pass its address, e.g. "
          "FaultTolerance(lighthouse='http://HOST:29510'), or set TORCHFT_LIGHTHOUSE")


@dataclasses.dataclass(frozen=True)
class FaultTolerance:
    """The options of ``distributed(fault_tolerance=...)``: torchft's ``Manager`` settings.

    ``lighthouse``: the address of torchft's lighthouse (default: ``$TORCHFT_LIGHTHOUSE``);
    ``replica_id``: this group's name (default: ``$REPLICA_GROUP_ID``, else a fresh one);
    ``replicas``: how many groups the run has (the report counts updates with fewer; default:
    the most seen); ``min_replicas``: the fewest groups an update is applied with;
    ``timeout``: seconds for a cross-group collective, the commit vote and the state
    transfer; ``quorum_timeout``: seconds to wait for a quorum; ``connect_timeout``: seconds
    to wait for the lighthouse and the peers' managers; ``report``: a JSON file rewritten by
    the group's rank 0 when a run of updates with one number of groups begins, when an
    update is not applied, and at least every 10 seconds.
    """

    lighthouse: str | None = None
    replica_id: str | None = None
    replicas: int | None = None
    min_replicas: int = 1
    timeout: float = 30.0
    quorum_timeout: float = 60.0
    connect_timeout: float = 10.0
    report: str | os.PathLike[str] | None = None

    def __post_init__(self) -> None:
        for name in ("replicas", "min_replicas"):
            value = getattr(self, name)
            if value is None and name == "replicas":
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"FaultTolerance({name}={value!r}) must be an int >= 1")
        for name in ("timeout", "quorum_timeout", "connect_timeout"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(f"FaultTolerance({name}={value!r}) must be a number of "
                                 "seconds > 0")
        if self.replicas is not None and self.min_replicas > self.replicas:
            raise ValueError(f"FaultTolerance(min_replicas={self.min_replicas}) is more than "
                             f"the run's replicas={self.replicas}")
        for name in ("lighthouse", "replica_id"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"FaultTolerance({name}={value!r}) must be a non-empty str")

    def address(self) -> str:
        """The lighthouse's address: the option, else ``$TORCHFT_LIGHTHOUSE``."""
        address = self.lighthouse or os.environ.get(LIGHTHOUSE_ENV)
        if not address:
            raise ValueError("distributed(fault_tolerance=...) needs torchft's lighthouse and "
                             f"none was given: {_START}")
        return address if "://" in address else f"http://{address}"

    def __repr__(self) -> str:
        fields = [f"{f.name}={getattr(self, f.name)!r}" for f in dataclasses.fields(self)
                  if getattr(self, f.name) != f.default]
        return f"FaultTolerance({', '.join(fields)})"


def check_installed() -> None:
    """Refuse when torchft cannot be imported, naming the extra that installs it."""
    try:
        import torchft  # type: ignore[import-untyped]  # noqa: F401
    except ImportError as error:
        raise ImportError("distributed(fault_tolerance=...) needs the torchft package: "
                          "pip install 'accelfn[ft]'") from error


def check_lighthouse(address: str, connect_timeout: float) -> None:
    """Connect to the lighthouse once, waiting at most ``connect_timeout`` seconds."""
    from torchft.coordination import LighthouseClient  # type: ignore[import-untyped]

    try:
        LighthouseClient(address, connect_timeout=timedelta(seconds=connect_timeout))
    except RuntimeError as error:
        raise ConnectionError(
            f"no torchft lighthouse answered at {address} within {connect_timeout:g} s "
            f"(FaultTolerance(connect_timeout=...)); {_START}") from error


def check_alone() -> None:
    """Refuse a second fault-tolerant state in a process: each process is one member of one
    replica group, whose quorum, heal and commit cover one state."""
    if len(RUNTIMES):
        raise ValueError(
            "distributed(fault_tolerance=...) already trains another TrainState in this "
            "process: a process is a member of one replica group, whose quorum, heal and "
            "commit cover one state (a second would join the lighthouse as another group). "
            "Train one state per process with it (a new model: a new process)")


class Record:
    """Which updates ran with how many replica groups: runs of ``[first, last, replicas]``,
    the updates not applied (``should_commit`` said no) and the updates this group healed
    at. A state slot: it is checkpointed with the state and sent to a healing group with it,
    so every group's record tells the whole run."""

    def __init__(self) -> None:
        self.runs: list[list[int]] = []
        self.uncommitted: list[int] = []
        self.healed: list[int] = []
        self.replicas = 0  # the most groups seen in one update

    def add(self, update: int, replicas: int, committed: bool) -> None:
        last = self.runs[-1] if self.runs else None
        if last is not None and last[2] == replicas and last[1] == update - 1:
            last[1] = update
        else:
            self.runs.append([update, update, replicas])
        if not committed:
            self.uncommitted.append(update)
        self.replicas = max(self.replicas, replicas)

    def state_dict(self) -> dict[str, Any]:
        return {"runs": [list(r) for r in self.runs], "uncommitted": list(self.uncommitted),
                "healed": list(self.healed), "replicas": self.replicas}

    def load_state_dict(self, saved: dict[str, Any]) -> None:
        self.runs = [list(r) for r in saved["runs"]]
        self.uncommitted = list(saved["uncommitted"])
        self.healed = list(saved["healed"])
        self.replicas = int(saved["replicas"])

    def report(self, expected: int | None) -> dict[str, Any]:
        full = expected or self.replicas
        fewer = [r for r in self.runs if r[2] < full]
        return {
            "replicas": full,
            "updates": sum(r[1] - r[0] + 1 for r in self.runs),
            "fewer_replicas": [{"first": a, "last": b, "replicas": n} for a, b, n in fewer],
            "updates_with_fewer_replicas": sum(b - a + 1 for a, b, _ in fewer),
            "not_applied": list(self.uncommitted),
            "healed_at": list(self.healed),
            "runs": [{"first": a, "last": b, "replicas": n} for a, b, n in self.runs],
        }


def fault_tolerance_report(state: TrainState, replicas: int | None = None) -> dict[str, Any]:
    """The fault-tolerance record of ``state`` as plain data: how many updates ran, the runs
    of updates with fewer than ``replicas`` groups (default: the most seen), the updates not
    applied and where this group healed. Empty before the first update."""
    record = state.get_slot(SLOT)
    if not isinstance(record, Record):
        record = Record()
    return record.report(replicas)


class Runtime:
    """One state's torchft manager and the bookkeeping of the update in progress."""

    def __init__(self, options: FaultTolerance, state: TrainState, group: Any,
                 device: torch.device) -> None:
        from torchft import Manager, ProcessGroupGloo

        self.options = options
        self.group = group  # the replica group's own processes (DDP's)
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)
        self.device = device
        self.quorum = False  # start_quorum called for the update in progress
        self.commit = True  # the vote of the update: the engine applies it only when True
        self.healed = False
        self._written = (0, 0.0)  # the record's runs and the time when last written
        self.store = _group_store(group, self.rank)
        timeout = timedelta(seconds=options.timeout)
        replica_id = options.replica_id or os.environ.get("REPLICA_GROUP_ID") or None
        self.manager = Manager(
            pg=ProcessGroupGloo(timeout=timeout),
            load_state_dict=None, state_dict=None,
            min_replica_size=options.min_replicas,
            use_async_quorum=False,  # healed before the forward, in the caller's thread
            timeout=timeout,
            quorum_timeout=timedelta(seconds=options.quorum_timeout),
            connect_timeout=timedelta(seconds=options.connect_timeout),
            rank=self.rank, world_size=self.world,
            store_addr=self.store[0], store_port=self.store[1],
            lighthouse_addr=options.address(), replica_id=replica_id)
        self.manager.register_state_dict_fn("accelfn", self._load(state), state.state_dict)
        atexit.register(self.manager.shutdown, wait=False)

    def _load(self, state: TrainState) -> Callable[[dict[str, Any]], None]:
        def load(saved: dict[str, Any]) -> None:
            state.load_state_dict(saved)
            self.healed = True
        return load

    def start(self) -> None:
        """The quorum of the update about to run (healing this group first if behind)."""
        if not self.quorum:
            self.quorum = True
            self.manager.start_quorum()

    def reduce(self, ctx: UpdateContext, inner_total: Tensor | None) -> Tensor | None:
        """Sum the gradients (and ``inner_total``, the group's sample count) with the live
        groups, vote on the commit; returns the run's sample count (None: not weighted)."""
        self.start()  # a flushed window's update: its quorum starts here
        self.quorum = False
        manager = self.manager
        grads = ctx.local_grads()
        buckets: dict[torch.dtype, list[Tensor]] = {}
        for g in grads:
            buckets.setdefault(g.dtype, []).append(g)
        flats = [torch.cat([g.reshape(-1) for g in gs]) for gs in buckets.values()]
        total = None if inner_total is None else inner_total.to(torch.float32).reshape(1)
        works = [manager.allreduce(t, reduce_op=dist.ReduceOp.SUM)
                 for t in (*flats, *(() if total is None else (total,)))]
        for work in works:
            work.wait()
        commit = bool(manager.should_commit())
        replicas = manager.num_participants()
        if commit:
            for flat, gs in zip(flats, buckets.values()):
                pieces = torch.split(flat, [g.numel() for g in gs])
                compat.foreach_copy_(gs, [p.view_as(g) for p, g in zip(pieces, gs)])
            if total is None and grads:  # unweighted: the mean of the groups' gradients
                compat.foreach_div_(grads, float(replicas))
        else:  # a failed exchange may have left them half-reduced: the update is not applied
            for g in grads:
                g.zero_()
        self.commit = commit
        record = ctx.state.slot(SLOT, Record)
        if self.healed:
            self.healed = False
            record.healed.append(ctx.state.step)
        record.add(ctx.state.step, replicas, commit)
        ctx.metrics["replicas"] = torch.full((), float(replicas), device=ctx.device)
        ctx.metrics["committed"] = torch.full((), float(commit), device=ctx.device)
        if self.rank == 0 and self.options.report is not None and (
                not commit or len(record.runs) != self._written[0]
                or time.monotonic() - self._written[1] > REPORT_EVERY):
            self._write(record)
        if total is None or not commit:
            return inner_total
        return total.reshape(())

    def _write(self, record: Record) -> None:
        path = os.fspath(self.options.report)  # type: ignore[arg-type]
        temporary = f"{path}.tmp"
        with open(temporary, "w") as f:
            json.dump(record.report(self.options.replicas), f, indent=1)
        os.replace(temporary, path)
        self._written = (len(record.runs), time.monotonic())

    def abort(self) -> None:
        """A failed call: the next update starts a new quorum (torchft's errors cleared)."""
        self.quorum = False


#: each prepared model's runtime (steps built alike share a preparation, hence one runtime)
RUNTIMES: weakref.WeakKeyDictionary[nn.Module, Runtime] = weakref.WeakKeyDictionary()


def _group_store(group: Any, rank: int) -> tuple[str, int]:
    """A TCPStore of this replica group's own, hosted by its rank 0 (the manager's address is
    published there: a restarted group never reads its dead predecessor's)."""
    if rank == 0:
        store = dist.TCPStore(  # type: ignore[attr-defined]
            socket.gethostname(), 0, is_master=True, wait_for_workers=False)
        _STORES.append(store)
        where: list[Any] = [socket.gethostname(), store.port]
    else:
        where = [None, None]
    if dist.get_world_size(group) > 1:
        dist.broadcast_object_list(where, src=dist.get_global_rank(group, 0), group=group)
    return str(where[0]), int(where[1])


_STORES: list[Any] = []  # kept alive with the process


def one_process_group(device: torch.device) -> None:
    """A process group of this process alone (a replica group of one process, run without
    torchrun or with one process per node): the reductions and the guard's agreement run in
    it as in a larger group."""
    backend = "nccl" if device.type == "cuda" else "gloo"
    store = dist.HashStore()  # type: ignore[attr-defined]
    dist.init_process_group(backend=backend, store=store, rank=0, world_size=1,
                            device_id=device if backend == "nccl" else None)

