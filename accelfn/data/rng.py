"""Seeded draws: torch's random draws in the data pipeline, from generators seeded per sample.

A per-sample transform (every ``torchvision.transforms.v2`` random transform, a dataset's own
``transform=``) calls ``torch.rand``, ``torch.randint``, ``Tensor.uniform_``, ... without a
generator, i.e. it draws from torch's global generator. The loader runs it in worker threads
while the training loop draws from that same generator (dropout masks): the augmentation
then depends on thread scheduling, and the loop's own random stream on how many draws the
workers made meanwhile. ``seeded_draws`` runs a block with those draws taken from
generators seeded with a given seed instead, leaving torch's global generators untouched:

* in a thread (worker threads, the prefetch thread, the loop's thread) through a
  ``torch.overrides.TorchFunctionMode``, which is local to the thread: every torch function
  that accepts a ``generator=`` and is called without one gets this thread's generator for
  the draw's device, seeded with ``seed`` (so the draws equal those made after
  ``torch.manual_seed(seed)``); it costs about 6 us per torch call made in the block;
* in a worker process of a ``PoolMapper`` (which has nobody to share the process's
  generators with) by seeding the global generators, which is cheaper and also covers
  functions that cannot take a generator. There NumPy's global generator
  (``np.random.rand``) and Python's ``random`` are seeded with ``seed`` too, so their draws
  also depend on the sample only, not on the worker (forked workers would otherwise all
  draw the same NumPy numbers).

Code that seeds torch's global CPU generator itself (``torch.manual_seed(index)``, then draws,
as torchvision's ``FakeData`` does to make one fixed image per index) draws what that seed
gives, without drawing from the global generator. Such code is not thread-safe: a
``SampleCollator`` loads its samples one at a time in threads once it has seen it, and its
seeding still meets the training loop's draws, so ``worker_type="process"`` suits it best.

Not covered, in threads: functions that draw but take no generator (``F.dropout`` and the
other dropouts, ``F.rrelu``, ``F.gumbel_softmax``, fractional max-pooling; a warning names the
first use of each), and Python's ``random`` and NumPy's global generators: they are shared
by all threads (the training loop's too), so they cannot be seeded per sample there; draw
from a generator seeded per sample (``np.random.default_rng(seed)``), draw with torch, or
use ``worker_type="process"``.
"""

from __future__ import annotations

import contextlib
import inspect
import random
import threading
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch.overrides import TorchFunctionMode

__all__ = ["DRAWS_WITHOUT_GENERATOR", "DRAWS_WITH_GENERATOR", "Draws", "seeded_draws"]

#: Torch functions and ``Tensor`` methods (by name) that draw and accept ``generator=``.
DRAWS_WITH_GENERATOR = frozenset({
    "rand", "rand_like", "randn", "randn_like", "randint", "randint_like", "randperm",
    "normal", "normal_", "uniform_", "random_", "bernoulli", "bernoulli_", "exponential_",
    "geometric_", "cauchy_", "log_normal_", "multinomial", "poisson", "binomial",
    "_standard_gamma", "_sample_dirichlet",
})

#: Functions (by name) that draw from the global generator and cannot be given another one.
DRAWS_WITHOUT_GENERATOR = frozenset({
    "dropout", "dropout_", "dropout1d", "dropout2d", "dropout3d", "alpha_dropout",
    "alpha_dropout_", "feature_dropout", "feature_dropout_", "feature_alpha_dropout",
    "feature_alpha_dropout_", "native_dropout", "rrelu", "rrelu_", "gumbel_softmax",
    "fractional_max_pool2d", "fractional_max_pool3d", "fractional_max_pool2d_with_indices",
    "fractional_max_pool3d_with_indices",
})



@dataclass
class Draws:
    """What a [`seeded_draws`][] block saw.

    ``seeded_global``: code in the block seeded torch's global CPU generator itself
    (``torch.manual_seed``) and then drew (always False in a ``PoolMapper`` worker process,
    whose global generator is its own).
    """

    seeded_global: bool = False


_PASS, _INJECT, _WARN = 0, 1, 2
_routes: dict[Any, int] = {}
_warned: set[str] = set()
_local = threading.local()
_process_owns_generators = False
_NUMPY_KEY = 0x6E756D70  # an extra seed word for NumPy's generator ("nump")


def _route(func: Any) -> int:
    name = getattr(func, "__name__", None)
    if inspect.isfunction(func):  # a Python-level torch function (torch.nn.init, F.*)
        try:
            params = inspect.signature(func).parameters
        except (TypeError, ValueError):  # pragma: no cover - functions have signatures
            params = {}  # type: ignore[assignment]
        if "generator" in params:
            route = _INJECT
        else:
            route = _WARN if name in DRAWS_WITHOUT_GENERATOR else _PASS
    elif name in DRAWS_WITH_GENERATOR:
        route = _INJECT
    elif name in DRAWS_WITHOUT_GENERATOR:
        route = _WARN
    else:
        route = _PASS
    try:
        _routes[func] = route
    except TypeError:  # pragma: no cover - unhashable callables are not cached
        pass
    return route


def _device_of(args: Sequence[Any], kwargs: Mapping[str, Any]) -> torch.device:
    """The device a draw is made on: ``device=``, else ``out=``'s, else the first tensor's,
    else the default device."""
    device = kwargs.get("device")
    if device is not None:
        dev = torch.device(device)
    else:
        out = kwargs.get("out")
        tensors = [out] if isinstance(out, torch.Tensor) else []
        tensors += [a for a in args if isinstance(a, torch.Tensor)]
        dev = tensors[0].device if tensors else torch.get_default_device()
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    return dev


def _warn_once(key: str, message: str) -> None:
    if key not in _warned:
        _warned.add(key)
        warnings.warn(message, RuntimeWarning, stacklevel=4)


def _warn_global(func: Any) -> None:
    name = str(getattr(func, "__qualname__", None) or getattr(func, "__name__", repr(func)))
    _warn_once(
        name,
        f"a data transform called {name}, which draws from torch's global random generator "
        "and cannot be given another one; in the loader's threads it shares that generator "
        "with the training loop, so those draws are not reproducible. Draw with a function "
        "that takes generator= (e.g. torch.rand / Tensor.bernoulli_), move the step to a "
        "batch transform, or use worker_type='process'",
    )


class _SeededMode(TorchFunctionMode):
    """Give ``generator=`` (seeded with ``seed``, one per device) to draws made without one.

    Code that seeds torch's global CPU generator itself inside the block with
    ``torch.manual_seed(k)`` (as torchvision's ``FakeData`` does, to make one fixed image per
    index) draws what it would draw after ``torch.manual_seed(k)``: while
    ``torch.initial_seed()`` differs from its value when the block began, CPU draws come from
    a generator of the block seeded with it (a seed equal to that value goes unnoticed). The
    global generators are never drawn from, and their state is never read (``get_state()``
    from several threads can deadlock: it holds the generator's lock while it allocates,
    which may run the garbage collector, and another thread may wait for that lock holding
    the GIL).
    """

    def __init__(self, seed: int, generators: dict[torch.device, torch.Generator]) -> None:
        super().__init__()
        self.seed = seed
        self.generators = generators
        self.seeded: set[torch.device] = set()
        self.entry_seed = torch.initial_seed()
        self.draws = Draws()
        self.mirror: torch.Generator | None = None  # for code that seeded the global one
        self.mirror_seed: int | None = None

    def generator(self, device: torch.device) -> torch.Generator:
        g = self.generators.get(device)
        if g is None:
            g = self.generators[device] = torch.Generator(device=device)
        if device not in self.seeded:
            g.manual_seed(self.seed)
            self.seeded.add(device)
        return g

    def mirrored(self, seed: int) -> torch.Generator:
        """A generator in the state ``torch.manual_seed(seed)`` left the global one in."""
        self.draws.seeded_global = True
        if self.mirror is None:
            self.mirror = torch.Generator()
        if seed != self.mirror_seed:
            self.mirror.manual_seed(seed)
            self.mirror_seed = seed
        return self.mirror

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Any,
        args: Sequence[Any] = (),
        kwargs: Mapping[str, Any] | None = None,
    ) -> Any:
        route = _routes.get(func)
        if route is None:
            route = _route(func)
        if not route:  # the fast path: most calls do not draw
            return func(*args, **kwargs) if kwargs else func(*args)
        kwargs = kwargs or {}
        if route == _INJECT:
            if kwargs.get("generator") is None and not any(
                isinstance(a, torch.Generator) for a in args
            ):
                device = _device_of(args, kwargs)
                if device.type == "cpu" and torch.initial_seed() != self.entry_seed:
                    kwargs = {**kwargs, "generator": self.mirrored(torch.initial_seed())}
                elif device.type != "meta":
                    kwargs = {**kwargs, "generator": self.generator(device)}
        else:
            _warn_global(func)
        return func(*args, **kwargs)

    def check_exit(self) -> None:
        """Warn (once) when the block drew after seeding the global generator and left it
        seeded (or another thread seeded it meanwhile)."""
        if self.draws.seeded_global and torch.initial_seed() != self.entry_seed:
            _warn_once(
                "seeded",
                "torch's global generator was seeded (torch.manual_seed / torch.set_rng_state) "
                "while the loader was loading a sample, and not put back. If the dataset seeds "
                "it, save and restore its state there (as torchvision's FakeData does) or, "
                "better, give it a torch.Generator of its own: seeding the global generator "
                "from worker threads changes the training loop's random stream (worker "
                "processes have their own: worker_type='process'); if the loop seeds it while "
                "batches load, the samples loading then are not reproducible",
            )


def own_process_generators() -> None:
    """Declare that this process's global generators serve only ``seeded_draws`` (called
    in the worker processes of a ``PoolMapper``, which run one item at a time)."""
    global _process_owns_generators
    _process_owns_generators = True


@contextlib.contextmanager
def seeded_draws(seed: int) -> Iterator[Draws]:
    """Run the block with torch's draws made without ``generator=`` seeded by ``seed``.

    Equivalent, for the draws, to ``torch.manual_seed(seed)`` before the block, without
    drawing from or changing torch's global generators (see the module's docstring for how,
    and for what is not covered): two blocks run with the same seed draw the same numbers
    whatever else runs in other threads meanwhile. Draws given an explicit ``generator=``
    keep it. Blocks may nest (the inner one has its own generators). In a worker process of
    a ``PoolMapper`` it seeds that process's own global generators instead: torch's, NumPy's
    and Python's ``random`` (in threads those two are not managed). Yields a [`Draws`][]
    that says, once the block is over, whether code in it seeded the global generator.
    """
    if _process_owns_generators:
        torch.default_generator.manual_seed(seed)
        random.seed(seed)
        # both are MT19937 seeded alike from these words: a third one keeps them apart
        np.random.seed([seed & 0xFFFFFFFF, (seed >> 32) & 0xFFFFFFFF, _NUMPY_KEY])
        if torch.cuda.is_initialized():  # type: ignore[no-untyped-call]  # untyped in torch
            torch.cuda.manual_seed_all(seed)
        yield Draws()
        return
    pool: list[dict[torch.device, torch.Generator]] = _local.__dict__.setdefault("pool", [])
    depth: int = _local.__dict__.get("depth", 0)
    if depth == len(pool):
        pool.append({})
    _local.depth = depth + 1
    mode = _SeededMode(seed, pool[depth])
    try:
        with mode:
            yield mode.draws
        mode.check_exit()
    finally:
        _local.depth = depth
