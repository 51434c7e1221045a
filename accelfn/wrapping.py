"""Wrapping a module's forward in place, keeping state_dict keys and deepcopy intact."""

from __future__ import annotations

import functools
import types
from collections.abc import Callable
from typing import Any

from torch import nn

__all__ = ["wrap_forward"]

Wrapper = Callable[..., Any]  # wrapper(module, inner_forward, *args, **kwargs)


def _wrapped_forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
    call = self._accelfn_inner
    for wrapper in self._accelfn_wrappers:  # innermost first
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
    if not tags:
        module._accelfn_inner = module.forward
        module._accelfn_wrappers = ()
        module.forward = types.MethodType(_wrapped_forward, module)
    module._accelfn_wrappers = (*module._accelfn_wrappers, wrapper)
    module._accelfn_tags = (*tags, tag)
    return True
