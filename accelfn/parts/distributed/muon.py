"""Muon over sharded parameters: ``torch.optim.Muon``'s update with each matrix orthogonalised
whole, on one process (its owner), under FSDP2, HSDP and FSDP2 x tensor parallel.

Newton-Schulz needs whole matrices, and under FSDP2 each process holds a shard of each. As
torchtitan's and nanochat's distributed Muon do, every matrix gets an owner among the
processes that hold its shards (here balanced by Newton-Schulz's cost rather than taken
round-robin: the largest matrices first, each to the least loaded process), and each update:

1. updates the momentum of this process' shards (``buf.lerp_(grad, 1 - momentum)``, then the
   Nesterov mix): element-wise, so torch's maths on the whole matrix, piece by piece;
2. sends every shard of that update to its matrix's owner, one ``all_to_all`` per process
   group for all the matrices together, in bfloat16 (Newton-Schulz starts by casting to it:
   the same numbers, half the bytes), every group's started before any computation;
3. orthogonalises, on each owner, its whole matrices with torch's Newton-Schulz, those of
   one shape stacked into one batched iteration (as Dion's Muon and nanochat's batch them:
   the same numbers per matrix, fewer and larger kernels);
4. sends each process its shards of the results (one ``all_to_all`` again, started as soon
   as the group's matrices are done), which it applies with torch's decoupled weight decay
   and shape-adjusted rate (the whole matrix's shape).

So the update is one-process Muon's (up to the order in which the gradients were reduced) and
each process does 1/n of the Newton-Schulz work. A HSDP replica does its own exchange (its
replicas hold the same gradients); a matrix no process holds a shard of (replicated) is
orthogonalised where it is.

Why the plain optimizer rather than an ``af.ShardedMuon``: the user passes
``torch.optim.Muon(...)``, and the same script runs in one process, under DDP and sharded.
``distributed(strategy="fsdp")`` (``"hsdp"``, ``tp=k``) replaces that optimizer's ``step`` on
the instance with the sharded one (:func:`shard_muon`), inside torch's step hooks and profiler
label and noting the call for an LR scheduler, as the step it replaces did. The state stays
torch's: a ``momentum_buffer`` per parameter, a DTensor sharded as the parameter, so
``state_dict()`` has one-process Muon's keys and shapes and a checkpoint reshards between
layouts and process counts (saved by 2 processes, loaded by a plain Muon in one). A class of
our own would have to be chosen per launch, and its checkpoints would be foreign to torch's
Muon.

Torch's Newton-Schulz and rate adjustment are private (``torch.optim._muon``); their formulas
are written here as they are there (torch 2.9 to 2.14), and the tests compare every update
with ``torch.optim.Muon`` in one process.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

__all__ = ["check_muon", "is_muon", "newton_schulz", "shard_muon"]

_MARK = "_accelfn_sharded_muon"


def is_muon(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer`` is a ``torch.optim.Muon`` (a subclass too)."""
    muon = getattr(torch.optim, "Muon", None)
    return isinstance(muon, type) and isinstance(optimizer, muon)


def check_muon(optimizer: torch.optim.Optimizer, index: int, how: str,
               names: dict[int, str] | None = None) -> None:
    """Refuse, before anything changes, a Muon holding a parameter that is not a 2-D matrix
    (``add_param_group`` does not check what Muon's constructor does; torch's step would fail
    half-way, after updating the matrices before it)."""
    for g, group in enumerate(optimizer.param_groups):
        for i, p in enumerate(group["params"]):
            if p.ndim != 2:
                name = (names or {}).get(id(p))
                what = f"{name!r}" if name else f"parameter {i} of group {g}"
                raise ValueError(
                    f"{how}: optimizer {index} (torch.optim.Muon) holds {what} of shape "
                    f"{tuple(p.shape)}, and Muon orthogonalises 2-D matrices only. Give the "
                    "other parameters (biases, norms, embeddings, the head) to a second "
                    "optimizer in the TrainState: af.TrainState(model, "
                    "[torch.optim.Muon(matrices), torch.optim.AdamW(rest)])")


def newton_schulz(update: Tensor, coefficients: tuple[float, float, float], steps: int,
                  eps: float) -> Tensor:
    """``torch.optim._muon._zeropower_via_newtonschulz(update, coefficients, steps, eps)``:
    the quintic Newton-Schulz iteration in bfloat16, on the wider orientation of the matrix
    (returned in bfloat16, in ``update``'s orientation). A bfloat16 ``update`` is scaled in
    place, as there. A 3-D ``update`` is a stack of equal matrices, each orthogonalised as
    alone (its own norm; ``baddbmm`` for ``addmm``): one batched iteration for the stack, the
    same numbers as one call per matrix (bitwise on the CPU, which the tests check)."""
    if steps >= 100:
        raise ValueError("Number of steps must be less than 100 for computational efficiency")
    if update.ndim not in (2, 3):
        raise ValueError("Input tensor gradient must be a 2D matrix")
    if len(coefficients) != 3:
        raise ValueError("Coefficients must be a tuple of exactly 3 values")
    a, b, c = coefficients
    x = update.bfloat16()
    tall = update.size(-2) > update.size(-1)
    if tall:
        x = x.mT
    if x.ndim == 2:
        x.div_(x.norm().clamp(min=eps))  # spectral norm at most 1
        for _ in range(steps):
            gram = x @ x.T
            x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    else:
        x.div_(torch.linalg.vector_norm(x, dim=(-2, -1), keepdim=True).clamp(min=eps))
        for _ in range(steps):
            gram = x @ x.mT
            x = torch.baddbmm(x, torch.baddbmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.mT if tall else x


def _cost(shape: torch.Size | tuple[int, ...]) -> int:
    """Newton-Schulz's multiply-adds per iteration for a matrix of ``shape`` (m <= n after
    orienting: two m x m x n products and one m x m x m): what owners are balanced by."""
    m, n = sorted(shape[:2])
    return 2 * m * m * n + m ** 3


def _orthogonalise(matrices: list[Tensor], settings: list[dict[str, Any]]) -> list[Tensor]:
    """``newton_schulz`` of each of ``matrices`` (with its group's settings), those of one
    shape and settings stacked into one batched iteration (as Dion's and nanochat's Muon
    batch equal shapes): fewer, larger kernels, the same numbers per matrix."""
    out: list[Tensor | None] = [None] * len(matrices)
    stacks: dict[tuple[Any, ...], list[int]] = {}
    for i, (x, s) in enumerate(zip(matrices, settings)):
        key = (tuple(x.shape), x.device, tuple(s["ns_coefficients"]), s["ns_steps"], s["eps"])
        stacks.setdefault(key, []).append(i)
    for key, indices in stacks.items():
        coefficients, steps, eps = key[2], key[3], key[4]
        if len(indices) == 1:
            out[indices[0]] = newton_schulz(matrices[indices[0]], coefficients, steps, eps)
            continue
        results = newton_schulz(torch.stack([matrices[i] for i in indices]), coefficients,
                                steps, eps)
        for i, result in zip(indices, results.unbind(0)):
            out[i] = result
    return [t for t in out if t is not None]


def _adjust_lr(lr: Any, adjust_lr_fn: str | None, shape: torch.Size) -> Any:
    """``torch.optim._muon._adjust_lr``: the rate scaled for the matrix's shape."""
    rows, cols = shape[:2]
    if adjust_lr_fn is None or adjust_lr_fn == "original":
        ratio = math.sqrt(max(1, rows / cols))
    elif adjust_lr_fn == "match_rms_adamw":
        ratio = 0.2 * math.sqrt(max(rows, cols))
    elif adjust_lr_fn == "spectral_unclamped":
        ratio = math.sqrt(rows / cols)
    else:
        ratio = 1.0
    return lr * ratio


def _local(t: Tensor) -> Tensor:
    """This process' piece of ``t`` (a view: writes reach the DTensor), or ``t``."""
    to_local = getattr(t, "to_local", None)
    return t if to_local is None else to_local()  # type: ignore[no-any-return]


# ------------------------------------------------------------------------------ the plan


@dataclass
class _Matrix:
    """One parameter's part in the exchange. ``group``: the processes holding its shards
    (None: whole here); ``owner``: the group rank that orthogonalises it; on the owner,
    ``sizes`` (each member's number of elements, group-rank order) and ``perm`` (where in the
    flat matrix each received element goes; None: in order, as FSDP2's row shards are)."""

    param: Tensor
    group: Any = None
    owner: int = 0
    sizes: list[int] | None = None
    perm: Tensor | None = None


def _exchange_group(p: Tensor, world: list[Any]) -> Any:
    """The process group over which ``p``'s distinct shards lie (None: none; every process
    holds it whole). ``world`` collects the groups this module created (the plan keeps them;
    nothing module-level holds a group)."""
    from torch.distributed.tensor import DTensor

    if not isinstance(p, DTensor):
        return None
    mesh, placements = p.device_mesh, p.placements
    if any(pl.is_partial() for pl in placements):
        raise ValueError(f"a Muon parameter of shape {tuple(p.shape)} is a partial (unreduced) "
                         f"DTensor ({placements}); Muon needs its values")
    dims = [d for d, pl in enumerate(placements) if not pl.is_replicate() and mesh.size(d) > 1]
    if not dims:
        return None
    if len(dims) == 1:
        return mesh.get_group(dims[0])
    # sharded over several mesh dimensions (FSDP2 over tensor parallel): one group per slice
    # of the other (replicated) dimensions
    ranks = mesh.mesh
    rest = [d for d in range(mesh.ndim) if d not in dims]
    slices = ranks.permute(*rest, *dims).reshape(-1, math.prod(mesh.size(d) for d in dims))
    members = [sorted(row) for row in slices.tolist()]
    size = dist.get_world_size()
    if len(members) == 1 and members[0] == list(range(size)):
        return dist.group.WORLD
    if ranks.numel() != size:
        raise ValueError(
            f"a Muon parameter of shape {tuple(p.shape)} is sharded over mesh dimensions "
            f"{[mesh.mesh_dim_names[d] if mesh.mesh_dim_names else d for d in dims]} of a "
            "mesh that is not the whole world; distributed() builds no such layout")
    for made in world:  # the same slices for another parameter: the same groups
        if made[0] == members:
            return made[1]
    mine, _ = dist.new_subgroups_by_enumeration(members)
    world.append((members, mine))
    return mine


def _indices(p: Tensor) -> Tensor:
    """The flat positions in the whole matrix of this process' elements of ``p``, in its
    local order (DTensor's own sharding of an index tensor: no communication)."""
    from torch.distributed.tensor import distribute_tensor

    positions = torch.arange(p.numel(), dtype=torch.int64).view(p.shape)
    spread = distribute_tensor(positions, p.device_mesh,  # type: ignore[attr-defined]
                               p.placements, src_data_rank=None)  # type: ignore[attr-defined]
    return spread.to_local().reshape(-1)


def _comm_device(group: Any, t: Tensor) -> torch.device:
    """Where ``group``'s collectives take tensors: the GPU for NCCL (CPU-offloaded shards
    travel through it), else ``t``'s device."""
    if t.device.type == "cpu" and dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return t.device


class _AllToAll:
    """One ``all_to_all_single`` over ``group``, started (``async_op``) when made:
    ``send[k]`` (pieces, in order) to member ``k``; ``wait()`` returns ``received[j]``:
    member ``j``'s pieces, of ``recv_sizes[j]`` elements."""

    def __init__(self, group: Any, send: list[list[Tensor]], recv_sizes: list[list[int]],
                 dtype: torch.dtype, device: torch.device) -> None:
        flat = [t.reshape(-1).to(device=device, dtype=dtype) for pieces in send for t in pieces]
        data = torch.cat(flat) if flat else torch.empty(0, dtype=dtype, device=device)
        out_splits = [sum(sizes) for sizes in recv_sizes]
        self.received = torch.empty(sum(out_splits), dtype=dtype, device=device)
        self.recv_sizes = recv_sizes
        self.work = dist.all_to_all_single(
            self.received, data, out_splits, [sum(t.numel() for t in pieces) for pieces in send],
            group=group, async_op=True)

    def wait(self) -> list[list[Tensor]]:
        if self.work is not None:
            self.work.wait()
        sizes = self.recv_sizes
        chunks = iter(torch.split(self.received, [n for row in sizes for n in row]))
        return [[next(chunks) for _ in row] for row in sizes]


def _all_to_all(group: Any, send: list[list[Tensor]], recv_sizes: list[list[int]],
                dtype: torch.dtype, device: torch.device) -> list[list[Tensor]]:
    """:class:`_AllToAll`, waited for."""
    return _AllToAll(group, send, recv_sizes, dtype, device).wait()


def _plan(params: Sequence[Tensor], made: list[Any]) -> dict[int, _Matrix]:
    """Every parameter's owner, and on each owner where its matrices' elements come from:
    the groups first (their creation is collective, in the same order on every process),
    then one exchange of element counts and one of positions per group."""
    matrices = [_Matrix(p, _exchange_group(p, made)) for p in params]
    by_group: dict[int, list[_Matrix]] = {}
    for m in matrices:
        if m.group is not None:
            by_group.setdefault(id(m.group), []).append(m)
    for ms in by_group.values():
        # the largest first, each to the least loaded member (ties: the lowest rank, then
        # the optimizer's order): the same on every process, the slowest owner within one
        # matrix's work of the rest, and equal shapes spread evenly (a stack per owner)
        load = [0] * dist.get_world_size(ms[0].group)
        for m in sorted(ms, key=lambda m: -_cost(m.param.shape)):
            m.owner = min(range(len(load)), key=lambda k: (load[k], k))
            load[m.owner] += _cost(m.param.shape)
    for ms in by_group.values():
        group = ms[0].group
        n, me = dist.get_world_size(group), dist.get_rank(group)
        mine = [m for m in ms if m.owner == me]
        positions = [_indices(m.param) for m in ms]
        device = _comm_device(group, _local(ms[0].param))
        counts = _all_to_all(group, [[torch.tensor([len(x)]) for m, x in zip(ms, positions)
                                      if m.owner == k] for k in range(n)],
                             [[1] * len(mine) for _ in range(n)], torch.int64, device)
        sizes = [[int(c) for c in counts[j]] for j in range(n)]  # once, at the first step
        got = _all_to_all(group, [[x for m, x in zip(ms, positions) if m.owner == k]
                                  for k in range(n)], sizes, torch.int64, device)
        for t, m in enumerate(mine):
            m.sizes = [sizes[j][t] for j in range(n)]
            perm = torch.cat([got[j][t] for j in range(n)])
            in_order = torch.equal(perm, torch.arange(perm.numel(), device=perm.device))
            m.perm = None if in_order else perm
    return {id(m.param): m for m in matrices}


# ------------------------------------------------------------------------------ the step


@dataclass
class _Item:
    """A matrix with a gradient this update: its plan, its group's settings, and this
    process' piece of the (momentum-mixed) update in bfloat16, then of the result."""

    matrix: _Matrix
    settings: dict[str, Any]
    piece: Tensor


def _exchange(items: list[_Item]) -> list[Tensor]:
    """Each item's piece of its orthogonalised whole matrix: per process group, one
    ``all_to_all`` gathers the pieces to the owners, each owner orthogonalises its matrices
    (equal shapes stacked), one ``all_to_all`` sends the results back. Every group's gather
    starts before any computation, and each group's return travels while the next group's
    matrices (and the ones held whole) are computed."""
    out: list[Tensor | None] = [None] * len(items)
    whole: list[int] = []
    by_group: dict[int, list[int]] = {}
    for i, item in enumerate(items):
        if item.matrix.group is None:
            whole.append(i)
        else:
            by_group.setdefault(id(item.matrix.group), []).append(i)
    gathers = []
    for indices in by_group.values():  # start every gather
        group = items[indices[0]].matrix.group
        n, me = dist.get_world_size(group), dist.get_rank(group)
        mine = [i for i in indices if items[i].matrix.owner == me]
        device = _comm_device(group, items[indices[0]].piece)
        sizes = [[items[i].matrix.sizes[j] for i in mine] for j in range(n)]  # type: ignore[index]
        send = [[items[i].piece for i in indices if items[i].matrix.owner == k]
                for k in range(n)]
        gathers.append((indices, mine, n, device,
                        _AllToAll(group, send, sizes, torch.bfloat16, device)))
    for i, result in zip(whole, _orthogonalise([items[i].piece for i in whole],
                                               [items[i].settings for i in whole])):
        out[i] = result
    returns = []
    for indices, mine, n, device, gather in gathers:
        got = gather.wait()
        matrices = []
        for t, i in enumerate(mine):
            m = items[i].matrix
            flat = torch.cat([got[j][t] for j in range(n)])
            if m.perm is not None:
                ordered = torch.empty_like(flat)
                ordered[m.perm] = flat
                flat = ordered
            matrices.append(flat.view(m.param.shape))
        back: list[list[Tensor]] = [[] for _ in range(n)]
        for i, result in zip(mine, _orthogonalise(matrices, [items[i].settings for i in mine])):
            m = items[i].matrix
            flat = result.reshape(-1)
            if m.perm is not None:
                flat = flat[m.perm]
            for j, piece in enumerate(torch.split(flat, m.sizes or [])):
                back[j].append(piece)
        group = items[indices[0]].matrix.group
        sizes = [[items[i].piece.numel() for i in indices if items[i].matrix.owner == k]
                 for k in range(n)]
        returns.append((indices, _AllToAll(group, back, sizes, torch.bfloat16, device)))
    for indices, scatter in returns:
        pieces = scatter.wait()
        returned = {k: iter(p) for k, p in enumerate(pieces)}
        for i in indices:
            piece = next(returned[items[i].matrix.owner])
            out[i] = piece.to(items[i].piece.device).view(items[i].piece.shape)
    return [t for t in out if t is not None]


def _sharded_step(optimizer: torch.optim.Optimizer, plan: dict[int, _Matrix]) -> None:
    """``torch.optim.Muon.step`` (``_single_tensor_muon``'s maths) over the shards: the
    momentum and the update applied on this process' pieces, Newton-Schulz on the owners."""
    items: list[_Item] = []
    for group in optimizer.param_groups:
        momentum = group["momentum"]
        for p in group["params"]:
            if p.grad is None:
                continue
            if torch.is_complex(p):
                raise RuntimeError("Muon does not support complex parameters")
            if p.grad.is_sparse:
                raise RuntimeError("Muon does not support sparse gradients")
            if p.grad.ndim != 2:
                raise ValueError("Param gradient must be a 2D matrix")
            state = optimizer.state[p]
            if "momentum_buffer" not in state:
                state["momentum_buffer"] = torch.zeros_like(
                    p.grad, memory_format=torch.preserve_format)
            grad, buf = _local(p.grad), _local(state["momentum_buffer"])
            buf.lerp_(grad, 1 - momentum)
            update = grad.lerp(buf, momentum) if group["nesterov"] else buf
            items.append(_Item(plan[id(p)], group, update.bfloat16()))
    for item, result in zip(items, _exchange(items)):
        group, p = item.settings, item.matrix.param
        lr = group["lr"]
        if isinstance(lr, Tensor) and lr.dim() != 0:  # torch.optim.optimizer._to_scalar
            lr = lr.squeeze()
        adjusted = _adjust_lr(lr, group["adjust_lr_fn"], p.shape)
        local = _local(p)
        local.mul_(1 - lr * group["weight_decay"])
        local.add_(result, alpha=-adjusted)


class _ShardedStep:
    """The optimizer's sharded step and its plan (made at the first step, again when the
    parameters change); holds the optimizer weakly, as torch's scheduler wrapper does."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = weakref.ref(optimizer)
        self.key: tuple[int, ...] | None = None
        self.plan: dict[int, _Matrix] = {}
        self.groups: list[Any] = []  # the process groups the plan created

    def __call__(self, optimizer: torch.optim.Optimizer, closure: Any = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        params = [p for group in optimizer.param_groups for p in group["params"]]
        key = tuple(map(id, params))
        with torch.no_grad():
            if key != self.key:
                self.plan, self.key = _plan(params, self.groups), key
            _sharded_step(optimizer, self.plan)
        return loss


def shard_muon(optimizers: Sequence[torch.optim.Optimizer]) -> None:
    """Give each ``torch.optim.Muon`` of ``optimizers`` the sharded step, on the instance:
    ``optimizer.step()`` runs torch's step hooks and profiler label around it and notes the
    call for an LR scheduler (``_opt_called``, as a scheduler's own wrapper of ``step``
    does); the state and ``state_dict()`` stay torch's. Once per optimizer."""
    for optimizer in optimizers:
        if not is_muon(optimizer) or getattr(optimizer.step, _MARK, False):
            continue
        sharded = _ShardedStep(optimizer)

        def run(opt: torch.optim.Optimizer, closure: Any = None,
                *, _sharded: _ShardedStep = sharded) -> Any:
            return _sharded(opt, closure)

        hooked = torch.optim.Optimizer.profile_hook_step(run)
        ref = sharded.optimizer

        def step(closure: Any = None, *, _hooked: Any = hooked, _ref: Any = ref) -> Any:
            opt = _ref()
            opt._opt_called = True  # an LR scheduler's check: the optimizer stepped first
            return _hooked(opt, closure)

        step._wrapped_by_lr_sched = True  # type: ignore[attr-defined]  # a scheduler made
        # later keeps this step rather than wrapping the one it replaced
        setattr(step, _MARK, True)
        optimizer.step = step  # type: ignore[method-assign]
