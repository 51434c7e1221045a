"""Processes: torchrun's process group, the world size, rank-0 output, metric reduction.

A process group must be gone, its threads joined, before the interpreter finalizes: a gloo
worker thread that finishes a collective then takes the GIL to release the collective's
tensors, and a thread that asks for the GIL once the interpreter finalizes is ended by
``pthread_exit``, whose unwinding through torch's ``noexcept`` destructors calls
``std::terminate`` ("terminate called without an active exception", SIGABRT) after the
script itself succeeded. ``destroy_process_group()`` only unregisters a group: the group
itself goes when its last reference does. Two references outlive it, and this module
removes both:

* torch binds ``group.WORLD`` into default arguments when a few of its modules are first
  imported (``torch.distributed.nn.functional``, ``ZeroRedundancyOptimizer``'s
  ``_broadcast_object``, ``ShardedGradScaler``); imported once a group exists, they keep that
  group for the life of the interpreter. They are imported here, with accelfn, before any
  group exists, so they bind ``None`` (the default group at call time).
* A ``DistributedDataParallel`` wrapper holds its group, and the wrapper of a finished run
  sits in reference cycles that only the garbage collector frees, maybe during finalization.
  ``init_distributed`` registers a collection at exit that runs while the interpreter is
  still whole (the group's destructor then joins its threads).
"""

from __future__ import annotations

import atexit
import gc
import importlib
import os
import sys
from collections.abc import Mapping
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from tensordict import TensorDict, TensorDictBase
from torch import Tensor

from . import hangs

if dist.is_available() and not dist.is_initialized():  # see the module docstring
    import torch.distributed.fsdp.sharded_grad_scaler
    import torch.distributed.nn.functional
    import torch.distributed.optim.zero_redundancy_optimizer

__all__ = ["init_distributed", "is_main_process", "reduce_metrics", "scale_lr", "world_size"]


def world_size() -> int:
    """Number of training processes (1 without torch.distributed)."""
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def is_main_process() -> bool:
    """True on rank 0, or in a single process: the one that prints and saves."""
    return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0


_collect_at_exit_registered = False


def _collect_at_exit() -> None:
    """Free the process groups that only garbage cycles still hold (a finished run's DDP
    wrapper), while the interpreter can still run their threads to the end."""
    gc.collect()


def _release_groups_at_exit() -> None:
    global _collect_at_exit_registered
    if not _collect_at_exit_registered:
        atexit.register(_collect_at_exit)
        _collect_at_exit_registered = True


_JOINING = timedelta(minutes=5)  # the least time the processes are given to join the group


def _timeout(timeout: float | timedelta | None) -> timedelta | None:
    """``init_distributed``'s ``timeout`` as a timedelta, checked."""
    if timeout is None:
        return None
    seconds = timeout.total_seconds() if isinstance(timeout, timedelta) else timeout
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) \
            or not 0 < seconds < float("inf"):
        raise ValueError(f"init_distributed(timeout={timeout!r}): give the seconds a collective "
                         "may wait for every process (a number > 0, or a timedelta), e.g. "
                         "timeout=300")
    return timedelta(seconds=seconds)


def init_distributed(backend: str | None = None, *, timeout: float | timedelta | None = None,
                     hang_dir: str | os.PathLike[str] | None = None) -> torch.device:
    """Set up the process group from torchrun's environment and return this process' device.

    Equivalent to ``dist.init_process_group(backend)`` with ``nccl`` on GPUs and ``gloo`` on
    CPUs, plus ``torch.cuda.set_device(LOCAL_RANK)``. Without torchrun's variables (a plain
    ``python`` run) it initialises nothing and returns the current device; a process group
    set up beforehand is used as it is, and without ``LOCAL_RANK`` the current CUDA device
    is kept. In a Ray Train worker (``TorchTrainer`` sets its group up) the device is the one
    Ray gave the worker: its GPU, or the CPU when it was given none (it sees the machine's
    GPUs all the same). With a process group, garbage is collected at interpreter exit, before the
    interpreter finalizes, so that a group destroyed by ``destroy_process_group()`` is freed
    and its threads joined while they can still end normally.

    ``timeout`` (seconds, or a timedelta) bounds how long a collective waits for every process
    (torch's default: 30 minutes on gloo, 10 on NCCL); a group set up beforehand gets it by
    ``dist.set_timeout``. Joining the group is given at least 5 minutes whatever ``timeout``
    says (the processes of a job start at different times: a node's import of torch, a slow
    file system), then the bound applies to every collective. When a process never arrives,
    the others fail after it and the error names the collective and the ranks that did not come
    (:func:`accelfn.core.hangs.name_hang`; torch's Flight Recorder is turned on for it). With
    ``hang_dir``, each process's Flight Recorder is dumped there (``rank_<r>``) on such a
    failure, for ``accelfn doctor --hang DIR``.
    """
    wait = _timeout(timeout)
    if hang_dir is not None and not isinstance(hang_dir, (str, os.PathLike)):
        raise TypeError(f"init_distributed(hang_dir={hang_dir!r}): give a directory path")
    cuda = torch.cuda.is_available()
    env_world = int(os.environ.get("WORLD_SIZE", "1"))
    ray_device = ray_train_device()
    if ray_device is not None:  # a Ray Train worker: the GPU Ray gave it, else the CPU
        device = ray_device
        if device.type == "cuda":
            torch.cuda.set_device(device)
    elif not cuda:
        device = torch.device("cpu")
    elif "LOCAL_RANK" in os.environ:  # torchrun's: bind this process to its GPU
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)
    else:  # no launcher to say: the device the process chose (mp.spawn, a plain run)
        device = torch.device("cuda", torch.cuda.current_device())
    if dist.is_available() and dist.is_initialized():
        _release_groups_at_exit()
        if wait is not None:
            dist.set_timeout(wait)
        hangs.record_collectives(hang_dir, size=False)  # the recorder started with the group
        return device
    if env_world <= 1:
        _check_not_a_ray_worker()
        return device
    if "MASTER_ADDR" not in os.environ or "RANK" not in os.environ:
        raise RuntimeError(
            f"WORLD_SIZE={env_world} but RANK/MASTER_ADDR are not set; start the script with "
            "torchrun --nproc_per_node=N script.py"
        )
    backend = backend or ("nccl" if cuda else "gloo")
    if backend == "nccl" and not (cuda and dist.is_nccl_available()):
        raise RuntimeError("backend 'nccl' needs CUDA GPUs and an NCCL build; use 'gloo' on CPUs")
    device_id = device if backend == "nccl" else None
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    _release_groups_at_exit()
    hangs.record_collectives(hang_dir)
    # gloo connects every pair while the group is built, under the group's timeout
    joining = None if wait is None else max(wait, _JOINING)
    if restart is None:
        dist.init_process_group(backend=backend, device_id=device_id, timeout=joining)
        _bound(wait, joining)
        return device
    # torchrun keeps one store for the whole job: without a per-restart prefix a restarted
    # worker can read the address its peer published before the restart and fail to connect.
    from torch.distributed.rendezvous import rendezvous

    store, rank, world = next(rendezvous("env://"))
    prefixed = dist.PrefixStore(f"restart-{restart}/", store)  # type: ignore[attr-defined]
    dist.init_process_group(backend=backend, store=prefixed, timeout=joining,
                            rank=rank, world_size=world, device_id=device_id)
    _bound(wait, joining)
    return device


def _bound(wait: timedelta | None, joining: timedelta | None) -> None:
    """The collectives' timeout, once the group is built with the longer one for joining."""
    if wait is not None and wait != joining:
        dist.set_timeout(wait)


def reduce_metrics(metrics: Mapping[str, Tensor] | TensorDictBase, *,
                   op: str = "mean") -> TensorDict:
    """Equivalent to ``dist.all_reduce`` of every metric (divided by the world size for
    ``"mean"``), done as one collective on one stacked tensor.

    Call it when you read metrics (every N steps), not every step, on every process: it is a
    collective, so reduce first and print on the main process (``if is_main_process():``
    around the call would wait forever for the others). In a single process it returns the
    metrics unchanged (as float32 values).
    """
    if op not in ("mean", "sum", "max", "min"):
        raise ValueError(f"reduce_metrics(op={op!r}) must be 'mean', 'sum', 'max' or 'min'")
    keys = [k for k in metrics.keys() if isinstance(metrics[k], Tensor)]
    if not keys:
        return TensorDict({}, batch_size=[])
    values = torch.stack([metrics[k].detach().float().reshape(()) for k in keys])
    world = world_size()
    if world > 1:
        reduce_op = {"mean": dist.ReduceOp.SUM, "sum": dist.ReduceOp.SUM,
                     "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}[op]
        try:
            dist.all_reduce(values, op=reduce_op)
        except RuntimeError as error:
            hangs.raise_named(error, "reduce_metrics")
            raise
        if op == "mean":
            values = values / world
    return TensorDict({k: values[i] for i, k in enumerate(keys)}, batch_size=[])


def scale_lr(base_lr: float, batch_size: int, base_batch_size: int = 256) -> float:
    """The linear scaling rule: ``base_lr * global_batch / base_batch_size``.

    ``batch_size`` is the per-process batch; the global batch multiplies it by the world size.
    """
    if batch_size < 1 or base_batch_size < 1:
        raise ValueError("scale_lr needs positive batch sizes")
    return base_lr * batch_size * world_size() / base_batch_size


def _ray_train_context() -> Any:
    """Ray Train's context when this process is one of its workers, else None. Ray is asked
    only when ``ray.train`` is imported already, as it is in its workers."""
    train = sys.modules.get("ray.train")
    if train is None:
        return None
    try:
        return train.get_context()
    except Exception:  # the driver, a plain Ray task or actor: not a Ray Train worker
        return None


def _ray_train_workers() -> int:
    """The number of workers of the Ray Train run this process is a worker of (1 outside
    one)."""
    context = _ray_train_context()
    return 1 if context is None else int(context.get_world_size())


def ray_train_device() -> torch.device | None:
    """The device Ray Train gave this process when it is one of its workers (its GPU, or the
    CPU when it was given none: Ray leaves such a worker the machine's GPUs visible); None
    outside Ray Train."""
    if _ray_train_context() is None:
        return None
    device: torch.device = importlib.import_module("ray.train.torch").get_device()
    return device


def in_ray_train_worker() -> bool:
    """Whether this process is a worker of a Ray Train run (whose training function runs in a
    thread of the worker, not in its main thread)."""
    return _ray_train_context() is not None


def _check_not_a_ray_worker() -> None:
    """Refuse a Ray Train worker of several that has no process group: each would train
    alone on its own share of nothing (DataParallelTrainer, or a group destroyed)."""
    workers = _ray_train_workers()
    if workers > 1:
        raise RuntimeError(
            f"this process is one of {workers} Ray Train workers but has no torch.distributed "
            "process group, so each worker would train a model of its own: run the loop with "
            "ray.train.torch.TorchTrainer (it sets the group up before the loop starts), not "
            "DataParallelTrainer, and leave the group for Ray to destroy")
