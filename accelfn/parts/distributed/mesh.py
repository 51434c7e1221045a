"""The process layout of a distributed step: its mesh's shape, checked before anything changes.

The shape is worked out from the strategy and the world size alone ([`layout`][]), so that
every refusal can be shown without starting processes; [`build_mesh`][] then makes torch's
``DeviceMesh`` of it. Ranks fill the mesh row-major, the last dimension innermost:

    ddp, fsdp          (dp,)                      every process one data shard
    fsdp, tp=k         (dp, tp)                   ranks k*i .. k*i+k-1: one tensor-parallel group
    hsdp, replicate=R  (replicate, shard)         ranks s*j .. s*j+s-1 shard one replica
    hsdp, R, tp=k      (replicate, shard, tp)

so consecutive ranks (one node's, under torchrun) share the innermost, busiest dimension:
tensor parallelism, then sharding; replicas talk across nodes once per update.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["Layout", "build_mesh", "data_mesh", "layout"]


@dataclass(frozen=True, slots=True)
class Layout:
    """How ``world`` processes are arranged: ``replicate`` copies of the model, each sharded
    over ``shard`` processes (1 under DDP: whole copies), each of those a group of ``tp``
    tensor-parallel processes fed the same batch. ``replicate * shard * tp == world``."""

    strategy: str
    world: int
    replicate: int
    shard: int
    tp: int

    @property
    def data_parallel(self) -> int:
        """The number of data shards (distinct batches): ``world // tp``."""
        return self.replicate * self.shard

    @property
    def shape(self) -> tuple[int, ...]:
        """The mesh's shape, outermost dimension first (see [`names`][])."""
        dims = {"replicate": self.replicate, "shard": self.shard, "dp": self.data_parallel,
                "tp": self.tp}
        return tuple(dims[name] for name in self.names)

    @property
    def names(self) -> tuple[str, ...]:
        """The mesh's dimension names: ``("dp",)``, ``("dp", "tp")``,
        ``("replicate", "shard")`` or ``("replicate", "shard", "tp")``."""
        data = ("replicate", "shard") if self.strategy == "hsdp" else ("dp",)
        return (*data, "tp") if self.tp > 1 else data

    def __str__(self) -> str:
        parts = []
        if self.strategy == "hsdp":
            parts.append(f"{self.replicate} replica(s) x {self.shard} shard(s)")
        else:
            parts.append(f"{self.data_parallel} data-parallel process(es)")
        if self.tp > 1:
            parts.append(f"tensor parallel over {self.tp}")
        return ", ".join(parts)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def layout(strategy: str, world: int, *, replicate: int | None = None, tp: int = 1,
           local_world: int | None = None) -> Layout:
    """The layout of ``world`` processes for ``strategy``, or a ``ValueError`` saying how to
    fix the launch or the call. ``replicate=None`` under HSDP: one replica per node (the
    world divided by ``local_world``, torchrun's ``LOCAL_WORLD_SIZE``)."""
    if world < 1:
        raise ValueError(f"the world size must be >= 1, got {world}")
    if world % tp:
        raise ValueError(
            f"distributed(tp={tp}) needs a world size divisible by {tp}, and torchrun started "
            f"{world} process(es): start a multiple of {tp} processes (--nproc_per_node), or "
            f"pick tp among the divisors of {world}: {_divisors(world)}")
    if strategy == "ddp":  # whole copies
        return Layout(strategy, world, world, 1, 1)
    if strategy != "hsdp":
        return Layout(strategy, world, 1, world // tp, tp)
    if replicate is None:
        local = local_world or world
        if world % local or local % tp:
            raise ValueError(
                f"distributed(strategy='hsdp') shards inside a node by default, but "
                f"{local} process(es) per node do not tile {world} processes in groups of "
                f"tp={tp}; pass replicate=R (the number of model copies) explicitly")
        replicate = world // local
    if world % (replicate * tp):
        tp_text = f" x tp={tp}" if tp > 1 else ""
        choices = _divisors(world // tp)
        raise ValueError(
            f"distributed(strategy='hsdp', replicate={replicate}) needs a world size "
            f"divisible by replicate={replicate}{tp_text}, and torchrun started {world} "
            f"process(es): start a multiple of {replicate * tp} processes, or pick replicate "
            f"among {choices} (each replica then shards over world / (replicate * tp) "
            "processes)")
    return Layout("hsdp", world, replicate, world // (replicate * tp), tp)


def build_mesh(plan: Layout, device_type: str) -> Any:
    """torch's ``DeviceMesh`` of ``plan`` (a collective: every process builds it together)."""
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(device_type, plan.shape, mesh_dim_names=plan.names)


def data_mesh(mesh: Any, plan: Layout) -> Any:
    """The part of ``mesh`` that FSDP2 shards (and, under HSDP, replicates) over."""
    if plan.tp == 1:
        return mesh
    return mesh[plan.names[:-1]] if len(plan.names) > 2 else mesh[plan.names[0]]
