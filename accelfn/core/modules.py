"""Module utilities: finding a model's repeated blocks, wrapping a forward in place, eval mode
for a while."""

from __future__ import annotations

import contextlib
import functools
import types
from collections import defaultdict
from collections.abc import Callable, Iterator
from typing import Any

from torch import nn

__all__ = ["evaluating", "find_blocks", "inner_forward", "wrap_forward"]

Wrapper = Callable[..., Any]  # wrapper(module, inner_forward, *args, **kwargs)


def _wrapped_forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
    call: Callable[..., Any] = self.__dict__["_accelfn_inner"]
    for wrapper in self.__dict__["_accelfn_wrappers"]:  # innermost first
        call = functools.partial(wrapper, self, call)
    return call(*args, **kwargs)


def wrap_forward(module: nn.Module, tag: str, wrapper: Wrapper) -> bool:
    """Make ``module(...)`` run ``wrapper(module, inner_forward, ...)``; once per ``tag``.

    The module's parameters, buffers and state_dict keys are unchanged, and a
    ``copy.deepcopy`` of the module (as ``torch.optim.swa_utils.AveragedModel`` makes) runs
    the wrappers around its *own* forward, because the inner forward is a bound method that
    deepcopy rebinds. ``wrapper`` must be a module-level function. Later wrappers run outside
    earlier ones. Returns False when the module already carries ``tag``.
    """
    tags = module.__dict__.get("_accelfn_tags", ())
    if tag in tags:
        return False
    state = module.__dict__  # plain attributes: not parameters, buffers or submodules
    if not tags:
        state["_accelfn_inner"] = module.forward
        state["_accelfn_wrappers"] = ()
        state["forward"] = types.MethodType(_wrapped_forward, module)
    state["_accelfn_wrappers"] = (*state["_accelfn_wrappers"], wrapper)
    state["_accelfn_tags"] = (*tags, tag)
    return True


def inner_forward(module: nn.Module, tag: str) -> Callable[..., Any]:
    """What ``module``'s wrapper of ``tag`` wraps: its own forward inside the wrappers added
    before ``tag``, every piece reached through ``module`` (nothing bound to another
    module, so a compiler that takes ``module`` as an input sees all of it)."""
    state = module.__dict__
    inner = state["_accelfn_inner"]
    call: Callable[..., Any] = inner
    if isinstance(inner, types.MethodType) and inner.__self__ is module:
        call = functools.partial(inner.__func__, module)
    tags = state["_accelfn_tags"]
    for wrapper in state["_accelfn_wrappers"][:tags.index(tag)]:
        call = functools.partial(wrapper, module, call)
    return call


def find_blocks(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The model's repeated blocks: children of ``nn.ModuleList``/``nn.Sequential`` that share
    a class with a sibling and have parameters and submodules, outermost only, in the model's
    order (that of ``model.named_modules()``), whatever their classes: swin_t's stages and
    the PatchMerging layers between them come interleaved, as they run.

    Finds the transformer blocks of a GPT, the residual blocks of a torchvision ResNet.
    """
    found: list[tuple[str, nn.Module]] = []
    for name, module in model.named_modules():
        if not isinstance(module, (nn.ModuleList, nn.Sequential)):
            continue
        by_class: dict[type, list[tuple[str, nn.Module]]] = defaultdict(list)
        for child_name, child in module.named_children():
            by_class[type(child)].append((f"{name}.{child_name}" if name else child_name, child))
        for members in by_class.values():
            sample = members[0][1]
            if (len(members) >= 2 and any(True for _ in sample.children())
                    and any(True for _ in sample.parameters())):
                found.extend(members)
    names = [n for n, _ in found]
    outermost = [(n, m) for n, m in found
                 if not any(n.startswith(o + ".") for o in names if o != n)]
    # siblings were gathered class by class, and the containers outermost first: sort by the
    # place in the model (every path: a module shared under two names keeps both)
    order = {n: i for i, (n, _) in enumerate(model.named_modules(remove_duplicate=False))}
    return sorted(outermost, key=lambda item: order[item[0]])


def running_stat_modules(block: nn.Module) -> tuple[nn.Module, ...]:
    """The modules of ``block`` whose forward updates running statistics in training mode:
    batch/instance norms with ``track_running_stats`` (any module following that convention)."""
    return tuple(m for m in block.modules() if getattr(m, "track_running_stats", False) is True)


@contextlib.contextmanager
def evaluating(model: nn.Module) -> Iterator[None]:
    """``model.eval()`` for the body; afterwards ``model.train(mode)`` as it was, then every
    module's own mode as it was: a submodule the user keeps in eval mode (a frozen
    BatchNorm while fine-tuning) stays there, which ``model.train()`` alone would undo."""
    training = model.training
    modes = [(module, module.training) for module in model.modules()]
    model.eval()
    try:
        yield
    finally:
        model.train(training)  # the model's own train(), overridden or not
        for module, mode in modes:
            module.training = mode
