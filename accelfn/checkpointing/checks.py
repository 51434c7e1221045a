"""What a checkpoint must match in the run that loads it, and the refusals that say how.

``save()`` records signatures (parameter names, shapes and dtypes;
the optimizer's class and parameter groups; the transform stack) and
``load()`` compares them with this run's before anything changes:
each mismatch is a ``CheckpointError`` naming the difference and
the fix.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from ..core.state import TrainState
from ..step.engine import Step, describe
from ..step.extension import GradientTransform
from .format import LOADER_FORMAT, CheckpointError

__all__ = [
    "check_finite",
    "check_loader",
    "check_optimizer_state",
    "check_slots",
    "compare_models",
    "compare_optimizers",
    "compare_schedulers",
    "compare_stacks",
    "is_sharded",
    "model_signature",
    "optimizer_signature",
    "stack_signature",
]


# ------------------------------------------------------------------------------ signatures
def model_signature(model: nn.Module) -> dict[str, list[Any]]:
    """``{name: [shape, dtype]}`` of every tensor in the model's state dict."""
    return {name: [list(t.shape), str(t.dtype).replace("torch.", "")]
            for name, t in model.state_dict().items() if isinstance(t, torch.Tensor)}


def stack_signature(step: Step | None) -> dict[str, Any] | None:
    """The transforms of ``step`` (in no particular order) and its description."""
    if step is None:
        return None
    if not isinstance(step, Step):
        raise TypeError(f"step= takes the accelfn Step being trained, got {type(step).__name__}")
    # The built-ins' stacking order never changes the result (each fills its place), so they
    # are sorted; gradient transforms run in stacking order, so theirs is kept, after them.
    builtins = sorted(repr(t) for t in step.transforms if not isinstance(t.part, GradientTransform))
    chain = [repr(t) for t in step.transforms if isinstance(t.part, GradientTransform)]
    return {"transforms": builtins + chain, "describe": describe(step)}


def is_sharded(model: nn.Module) -> bool:
    """Whether the model's parameters are DTensors (FSDP2)."""
    return any(hasattr(p, "to_local") and hasattr(p, "device_mesh") for p in model.parameters())


def optimizer_signature(optimizer: torch.optim.Optimizer, model: nn.Module) -> dict[str, Any]:
    """The optimizer's class, its parameter groups' sizes, and the model's name of every
    parameter of every group, in order (what decides where learning rates and moments go)."""
    names = {id(p): name for name, p in model.named_parameters()}
    return {"class": type(optimizer).__name__,
            "groups": [len(g["params"]) for g in optimizer.param_groups],
            "names": [[names.get(id(p), f"<parameter {i} of group {n}, not in the model>")
                       for i, p in enumerate(g["params"])]
                      for n, g in enumerate(optimizer.param_groups)]}


# ------------------------------------------------------------------------------ comparisons
def compare_models(saved: dict[str, list[Any]], here: dict[str, list[Any]]) -> None:
    missing = [k for k in saved if k not in here]
    unexpected = [k for k in here if k not in saved]
    shapes = [f"{k} saved {saved[k][0]} {saved[k][1]}, here {here[k][0]} {here[k][1]}"
              for k in saved if k in here and saved[k] != here[k]]
    if not (missing or unexpected or shapes):
        return
    parts = []
    for label, items in (("in the checkpoint but not in this model", missing),
                         ("in this model but not in the checkpoint", unexpected),
                         ("with another shape or dtype", shapes)):
        if items:
            more = f" (+{len(items) - 4} more)" if len(items) > 4 else ""
            parts.append(f"{len(items)} {label}: {', '.join(items[:4])}{more}")
    raise CheckpointError(
        "the checkpoint comes from a different model: " + "; ".join(parts)
        + ". Build the model exactly as the checkpointed run did (same architecture, sizes "
        "and dtype) before loading"
    )


def _layout_free(transforms: list[str]) -> list[str]:
    return [t for t in transforms if not t.startswith("distributed(")]


def compare_stacks(saved: dict[str, Any] | None, here: dict[str, Any] | None,
                   resharding: bool = False) -> None:
    """The step is the checkpointed run's (built-ins in any order, gradient transforms in
    theirs). With ``resharding``, ``distributed(...)`` is left out: its strategy and mesh are
    the layout being changed (HSDP 2x2 into FSDP over 2, or into one process), and it keeps
    no state of its own in a checkpoint."""
    if saved is None or here is None:
        return
    theirs, ours = saved["transforms"], here["transforms"]
    if resharding:
        theirs, ours = _layout_free(theirs), _layout_free(ours)
    if theirs == ours:
        return
    added = sorted(set(ours) - set(theirs))
    removed = sorted(set(theirs) - set(ours))
    order = "" if added or removed else "; its gradient transforms run in another order"
    raise CheckpointError(
        f"the checkpoint was saved by the step {saved['describe']!r}, this step is "
        f"{here['describe']!r} (added: {', '.join(added) or 'none'}; removed: "
        f"{', '.join(removed) or 'none'}{order}): transform state (loss scaler, counters, "
        "averages) would not match. Build the step the checkpointed run used, or pass step=None to "
        "load without this check"
    )


def compare_optimizers(saved: Any, state: TrainState) -> None:
    """The checkpoint's optimizers (meta.json's signatures) are this state's: as many, in the
    same order, each of the same class over the same parameters, group by group."""
    here = [optimizer_signature(o, state.model) for o in state.optimizers]
    theirs = saved if isinstance(saved, list) else [saved]
    if len(theirs) != len(here):
        raise CheckpointError(
            f"the checkpoint holds {len(theirs)} optimizer(s) "
            f"({', '.join(o['class'] for o in theirs)}), this state {len(here)} "
            f"({', '.join(o['class'] for o in here)}); build the TrainState with the optimizers "
            "of the checkpointed run, in the same order (TrainState(model, [optimizer, ...]) "
            "for several)")
    for i, (a, b) in enumerate(zip(theirs, here)):
        _compare_optimizer(a, b, None if len(here) == 1 else i)


def _compare_optimizer(saved: dict[str, Any], here: dict[str, Any], index: int | None) -> None:
    if (saved["class"], saved["groups"]) != (here["class"], here["groups"]):
        if index is None:
            raise CheckpointError(
                f"the checkpoint's optimizer is {saved['class']} with parameter groups of "
                f"sizes {saved['groups']}, this one is {here['class']} with "
                f"{here['groups']}; build the optimizer (and its parameter groups) as the "
                "checkpointed run did"
            )
        raise CheckpointError(
            f"the checkpoint's optimizer {index} is {saved['class']} with parameter groups of "
            f"sizes {saved['groups']}, this state's optimizer {index} is {here['class']} with "
            f"{here['groups']}; build the optimizers (and their parameter groups) as the "
            "checkpointed run did, in the same order"
        )
    if saved.get("names") is None:
        return  # written before names were recorded: the sizes are all there is to compare
    which = "the optimizer's" if index is None else f"optimizer {index} ({here['class']})'s"
    for group, (theirs, ours) in enumerate(zip(saved["names"], here["names"])):
        for position, (a, b) in enumerate(zip(theirs, ours)):
            if a != b:
                raise CheckpointError(
                    f"{which} parameter group {group} holds {a} in the checkpoint, "
                    f"{b} here (its parameter {position}): learning rates, weight decay and "
                    "optimizer state would land on other parameters. Build the parameter "
                    "groups from the same parameters, in the same order, as the checkpointed "
                    "run did"
                )


def compare_schedulers(saved: Any, state: TrainState) -> None:
    """The checkpoint's schedulers (class names, one per optimizer) are this state's."""
    here = [None if s is None else type(s).__name__ for s in state.schedulers]
    theirs = saved if isinstance(saved, list) else [saved]
    for i, (a, b) in enumerate(zip(theirs, here)):
        if a != b and len(here) == 1:
            raise CheckpointError(
                f"the checkpoint's scheduler is {a}, this state's is {b}; build the state with "
                "the scheduler the checkpointed run used")
        if a != b:
            raise CheckpointError(
                f"the checkpoint's scheduler of optimizer {i} is {a}, this state's is {b}; "
                "build the state with the schedulers the checkpointed run used (one entry per "
                "optimizer, None where it had none)")


# What torch's own optimizers keep per parameter in the parameter's shape (read from their
# sources: each is made by ``zeros_like(p)`` or ``full_like(p)``). Adafactor's factored
# moments have the parameter's shape with one dimension reduced to 1 (``_factored``). Other
# optimizers (a subclass of these too: it may keep its states otherwise) are not compared:
# a state's shape is their own business (stacked buffers, scalars).
_PARAMETER_SHAPED: dict[type[torch.optim.Optimizer], tuple[str, ...]] = {
    torch.optim.Adam: ("exp_avg", "exp_avg_sq", "max_exp_avg_sq"),
    torch.optim.AdamW: ("exp_avg", "exp_avg_sq", "max_exp_avg_sq"),
    torch.optim.NAdam: ("exp_avg", "exp_avg_sq"),
    torch.optim.RAdam: ("exp_avg", "exp_avg_sq"),
    torch.optim.Adamax: ("exp_avg", "exp_inf"),
    torch.optim.SparseAdam: ("exp_avg", "exp_avg_sq"),
    torch.optim.SGD: ("momentum_buffer",),
    torch.optim.RMSprop: ("square_avg", "momentum_buffer", "grad_avg"),
    torch.optim.Adagrad: ("sum",),
    torch.optim.Adadelta: ("square_avg", "acc_delta"),
    torch.optim.ASGD: ("ax",),
    torch.optim.Rprop: ("prev", "step_size"),
    torch.optim.Adafactor: ("variance",),
}
_muon = getattr(torch.optim, "Muon", None)
if isinstance(_muon, type) and issubclass(_muon, torch.optim.Optimizer):
    _PARAMETER_SHAPED[_muon] = ("momentum_buffer",)


def _expected_shape(optimizer: torch.optim.Optimizer, key: str,
                    shape: torch.Size) -> list[int] | None:
    """The shape torch's own ``optimizer`` keeps its state ``key`` in for a parameter of
    ``shape``; None where it is not known (another optimizer, or a scalar such as ``step``)."""
    kind = type(optimizer)
    if key in _PARAMETER_SHAPED.get(kind, ()):
        return list(shape)
    if kind is torch.optim.Adafactor and key in ("row_var", "col_var") and len(shape) > 1:
        factored = list(shape)
        factored[-1 if key == "row_var" else -2] = 1
        return factored
    return None


def check_optimizer_state(saved: Any, optimizer: torch.optim.Optimizer,
                          model: nn.Module | None = None) -> None:
    """The saved optimizer state fits this optimizer: a state entry per parameter of its
    groups, as many parameters in each group, and, for torch's own optimizers, every state
    they keep in the parameter's shape (``exp_avg``, ``exp_avg_sq``, ``max_exp_avg_sq``,
    ``momentum_buffer``, ..., Adafactor's factored ``row_var``/``col_var``) of that shape.
    The parameters' order is checked by name (``compare_optimizers``); another optimizer's
    state shapes are its own business (stacked buffers, scalars) and are not compared."""
    if not isinstance(saved, dict) or not isinstance(saved.get("param_groups"), list) \
            or not isinstance(saved.get("state"), dict) \
            or not all(isinstance(g, dict) and isinstance(g.get("params"), list)
                       and all(isinstance(i, int) for i in g["params"])
                       for g in saved["param_groups"]):
        raise CheckpointError("the checkpoint's optimizer state is malformed")
    sizes = [len(g["params"]) for g in saved["param_groups"]]
    here = [len(g["params"]) for g in optimizer.param_groups]
    if sizes != here:
        raise CheckpointError(f"the checkpoint's optimizer state has parameter groups of sizes "
                              f"{sizes}, this {type(optimizer).__name__} {here}; build it over "
                              "the same parameters, in the same groups")
    ids = {i for g in saved["param_groups"] for i in g["params"]}
    for pid, entry in saved["state"].items():
        if pid not in ids or not isinstance(entry, dict):
            raise CheckpointError(f"the checkpoint's optimizer state names parameter {pid}, "
                                  "which is in none of its groups: the checkpoint is damaged")
    # torch's load_state_dict pairs the saved ids with this optimizer's parameters in order
    params = {pid: p for g, mine in zip(saved["param_groups"], optimizer.param_groups)
              for pid, p in zip(g["params"], mine["params"])}
    names = {id(p): name for name, p in model.named_parameters()} if model is not None else {}
    for pid, entry in saved["state"].items():
        param = params[pid]
        for key, value in entry.items():
            expected = _expected_shape(optimizer, key, param.shape)
            if expected is None or not isinstance(value, torch.Tensor) \
                    or list(value.shape) == expected:
                continue
            name = names.get(id(param), f"parameter {pid}")
            raise CheckpointError(
                f"the checkpoint's {type(optimizer).__name__} state {key!r} of {name} has "
                f"shape {list(value.shape)}, where this parameter of shape {list(param.shape)} "
                f"needs {expected}: the checkpoint is forged or damaged (the next update would "
                "fail). Load an earlier checkpoint")


def check_slots(saved: Any, state: TrainState) -> None:
    if not isinstance(saved, Mapping):
        raise CheckpointError("the checkpoint's transform slots are malformed")
    live = state.slots
    for name, value in saved.items():
        obj = live.get(name)
        if not isinstance(obj, dict):
            continue  # objects with load_state_dict check themselves; rolled back on failure
        if not isinstance(value, Mapping) or set(value) != set(obj):
            keys = sorted(value) if isinstance(value, Mapping) else type(value).__name__
            raise CheckpointError(
                f"the checkpoint's state of transform slot {name!r} has keys {keys}, this step "
                f"expects {sorted(obj)}: the checkpoint comes from a different transform stack"
            )
        for key, current in obj.items():
            if isinstance(current, torch.Tensor) and (
                    not isinstance(value[key], torch.Tensor) or value[key].shape != current.shape):
                raise CheckpointError(f"slot {name!r} entry {key!r} has another shape than this "
                                      "step's: the checkpoint comes from a different transform "
                                      "stack")


def _position_differs(saved: Any, reference: Any, where: str, batches: int | None) -> str | None:
    """Where and how a loader position differs in form from this loader's own (same keys,
    same kinds of values), or holds a count out of range; None when it is well formed."""
    if isinstance(reference, Mapping):
        if not isinstance(saved, Mapping):
            return f"{where} is a {type(saved).__name__}, this loader's a mapping"
        if set(saved) != set(reference):
            missing = sorted(map(str, set(reference) - set(saved)))
            unknown = sorted(map(str, set(saved) - set(reference)))
            return f"{where} lacks {missing} and has unknown {unknown}"
        if batches is not None and {"epoch", "batches"} <= set(saved) and \
                isinstance(saved["batches"], int) and saved["batches"] > batches:
            return f"{where} is at batch {saved['batches']} of an epoch of {batches}"
        for key in reference:
            found = _position_differs(saved[key], reference[key], f"{where}[{key!r}]", batches)
            if found:
                return found
        return None
    if isinstance(reference, (list, tuple)):
        if not isinstance(saved, (list, tuple)) or len(saved) != len(reference):
            return f"{where} is not a sequence of {len(reference)}"
        for i, (a, b) in enumerate(zip(saved, reference)):
            found = _position_differs(a, b, f"{where}[{i}]", batches)
            if found:
                return found
        return None
    if type(saved) is not type(reference):
        return f"{where} is {saved!r}, where this loader has a {type(reference).__name__}"
    if isinstance(saved, int) and not isinstance(saved, bool) and saved < 0:
        return f"{where} is {saved}: counts and epochs are never negative"
    return None


def check_loader(saved: Any, loader: Any) -> None:
    """An accelfn.data loader position fits ``loader``: its configuration, and its form
    against the loader's own position (keys, kinds of values, counts in range), so that a
    malformed one is refused here, before anything is restored, not at the next ``iter()``."""
    config = getattr(loader, "config", None)
    if not isinstance(config, dict):
        return  # another kind of loader: its load_state_dict checks (rolled back on failure)
    if not (isinstance(saved, Mapping) and saved.get("format") == LOADER_FORMAT
            and isinstance(saved.get("config"), Mapping) and "root" in saved):
        raise CheckpointError(
            f"the checkpoint's loader position is not an {LOADER_FORMAT} position (it is "
            f"malformed, or was saved by another kind of loader)"
        )
    theirs = dict(saved["config"])
    if theirs != config:
        diff = ", ".join(f"{k}: saved {theirs.get(k)!r}, here {config.get(k)!r}"
                         for k in sorted(set(theirs) | set(config))
                         if theirs.get(k) != config.get(k))
        raise CheckpointError(
            f"the loader position was saved by a loader with another configuration ({diff}); "
            "build the loader with the same settings to resume"
        )
    reference = loader.state_dict()["root"]  # this loader's own position: a read
    batches = getattr(loader, "num_batches", None)
    found = _position_differs(saved["root"], reference, "root",
                              batches if isinstance(batches, int) else None)
    if found:
        raise CheckpointError(f"the checkpoint's loader position is malformed: {found}; it is "
                              "forged or damaged (load an earlier checkpoint, or pass "
                              "loader=None and start the loader at a new epoch)")


# ------------------------------------------------------------------------------ values
def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t  # a DTensor's shard


def check_finite(state: TrainState, name: str = "") -> None:
    """Refuse a restored state whose parameters or optimizer state hold NaN or Inf (a
    diverged or forged checkpoint): one device check of all of them, then, on failure only,
    the first such tensor by name. This process' shards only (load() agrees on the outcome)."""
    named: list[tuple[str, torch.Tensor]] = [
        (f"parameter {n}", p) for n, p in state.model.named_parameters()]
    for i, optimizer in enumerate(state.optimizers):
        for index, (param, entry) in enumerate(optimizer.state.items()):
            del param
            for key, value in entry.items():
                if isinstance(value, torch.Tensor):
                    named.append((f"optimizer {i}'s state {key!r} of parameter {index}", value))
    tensors = [(what, _local(t).detach()) for what, t in named
               if t.is_floating_point() or t.is_complex()]
    tensors = [(what, t) for what, t in tensors if t.numel()]
    if not tensors:
        return
    flags = torch.stack([torch.isfinite(t).all().to("cpu", non_blocking=True)
                         for _, t in tensors])
    if bool(flags.all()):
        return
    bad = next(what for (what, _), ok in zip(tensors, flags.tolist()) if not ok)
    where = f"state {name!r}: " if name else ""
    raise CheckpointError(
        f"{where}the checkpoint's {bad} holds NaN or Inf: the run it comes from had diverged, "
        "or the file was forged. Load an earlier checkpoint, or pass allow_nonfinite=True to "
        "load it anyway")
