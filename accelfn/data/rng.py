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

Code that uses torch's global generator itself (``torch.get_rng_state()``, then
``torch.manual_seed(index)`` and draws, then ``torch.set_rng_state(...)``, as torchvision's
``FakeData`` does to make one fixed image per index; or ``torch.random.fork_rng()``) gets, in
a block, a generator of the block's own in place of the global one: ``torch.manual_seed``,
``torch.seed``, ``torch.initial_seed``, ``torch.get_rng_state``, ``torch.set_rng_state`` and
their ``torch.cuda`` counterparts act on the block's generators while the calling thread is
in a block (elsewhere they are torch's). So the training loop's random stream (its dropout
masks) never meets the dataset's seeding: a loop over such a dataset draws what the same loop
over a ``DataLoader`` with ``num_workers=0`` draws, whatever the loader's workers and
prefetching. Torch has no per-thread global generator, which is why these functions are
wrapped (once, at the first block): ``fork_rng`` or a lock around sample loading would still
race with the training thread's own draws, which take no lock. A dataset seeding
``torch.default_generator`` directly (not through these functions) draws what that seed gives
without drawing from the global generator, but its seeding still meets the training loop's
draws: a ``SampleCollator`` then loads its samples one at a time, and
``worker_type="process"`` suits it best.

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
        self.entry_seed = _real_initial_seed()
        self.draws = Draws()
        self.left_seeded = False  # the block's code seeded its generator and did not restore
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

    def reseed(self, seed: int) -> torch.Generator:
        """``torch.manual_seed(seed)`` in the block: every device's generator of the block
        starts again from ``seed``; the CPU one is returned."""
        self.seed = seed
        self.seeded.clear()
        self.left_seeded = True
        return self.generator(torch.device("cpu"))

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
                real = _real_initial_seed()
                if device.type == "cpu" and real != self.entry_seed:
                    kwargs = {**kwargs, "generator": self.mirrored(real)}
                elif device.type != "meta":
                    kwargs = {**kwargs, "generator": self.generator(device)}
        else:
            _warn_global(func)
        return func(*args, **kwargs)

    def check_exit(self) -> None:
        """Warn (once) when the block drew after seeding the global generator and left it
        seeded (or another thread seeded it meanwhile)."""
        if self.draws.seeded_global and _real_initial_seed() != self.entry_seed:
            _warn_once(
                "seeded",
                "torch's global generator was seeded (torch.default_generator.manual_seed) "
                "while the loader was loading a sample, and not put back. If the dataset seeds "
                "it, save and restore its state there (as torchvision's FakeData does) or, "
                "better, give it a torch.Generator of its own: seeding the global generator "
                "from worker threads changes the training loop's random stream (worker "
                "processes have their own: worker_type='process'); if the loop seeds it while "
                "batches load, the samples loading then are not reproducible",
            )
        elif self.left_seeded:
            _warn_once(
                "seeded",
                "torch's generator was seeded (torch.manual_seed) while the loader was "
                "loading a sample, and not put back: the loader gives sample loading a "
                "generator of its own, so the training loop's random stream is not reseeded "
                "(it would be under a DataLoader with num_workers=0, so a loop ported from one "
                "draws other numbers). Save and restore the state in the dataset "
                "(torch.random.fork_rng(), as torchvision's FakeData does) to draw the same "
                "as such a DataLoader loop, or give the dataset a torch.Generator of its own",
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
    _wrap_global_functions()
    pool: list[dict[torch.device, torch.Generator]] = _local.__dict__.setdefault("pool", [])
    modes: list[_SeededMode] = _local.__dict__.setdefault("modes", [])
    depth: int = _local.__dict__.get("depth", 0)
    if depth == len(pool):
        pool.append({})
    _local.depth = depth + 1
    mode = _SeededMode(seed, pool[depth])
    modes.append(mode)
    try:
        with mode:
            yield mode.draws
        mode.check_exit()
    finally:
        modes.pop()
        _local.depth = depth


# --------------------------------------------------------------------------------------------
# torch's global-generator functions, acting on the block's generators inside a block


_wrapped: list[bool] = []  # [True] once torch's functions are wrapped
_wrap_lock = threading.Lock()


def _real_initial_seed() -> int:
    return int(torch.default_generator.initial_seed())


def _block() -> _SeededMode | None:
    modes: list[_SeededMode] | None = _local.__dict__.get("modes")
    return modes[-1] if modes else None


def _cuda(device: Any = "cuda") -> torch.device:
    dev = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
    return dev if dev.index is not None else torch.device("cuda", torch.cuda.current_device())


def _in_block(real: Callable[..., Any], name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        mode = _block()
        if mode is None:
            return real(*args, **kwargs)
        return fn(mode, *args, **kwargs)

    wrapper.__name__ = wrapper.__qualname__ = name
    wrapper.__doc__ = real.__doc__
    wrapper.__wrapped__ = real  # type: ignore[attr-defined]
    wrapper._accelfn_in_block = True  # type: ignore[attr-defined]
    return wrapper


def _set_state(mode: _SeededMode, device: torch.device, state: torch.Tensor) -> None:
    mode.generator(device).set_state(state)
    mode.left_seeded = False  # a state put back: the dataset restores what it changed


def _cpu() -> torch.device:
    return torch.device("cpu")


def _fresh_seed(mode: _SeededMode) -> int:
    seed = int(torch.Generator().seed())  # nondeterministic, as torch.seed() is
    mode.reseed(seed)
    return seed


_CPU_FUNCTIONS: dict[str, Callable[..., Any]] = {
    "manual_seed": lambda mode, seed: mode.reseed(int(seed)),
    "seed": _fresh_seed,
    "initial_seed": lambda mode: mode.generator(_cpu()).initial_seed(),
    "get_rng_state": lambda mode: mode.generator(_cpu()).get_state(),
    "set_rng_state": lambda mode, new_state: _set_state(mode, _cpu(), new_state),
}

_CUDA_FUNCTIONS: dict[str, Callable[..., Any]] = {
    "manual_seed": lambda mode, seed: (mode.reseed(int(seed)), None)[1],
    "manual_seed_all": lambda mode, seed: (mode.reseed(int(seed)), None)[1],
    "initial_seed": lambda mode: mode.generator(_cuda()).initial_seed(),
    "get_rng_state": lambda mode, device="cuda": mode.generator(_cuda(device)).get_state(),
    "set_rng_state": lambda mode, new_state, device="cuda": _set_state(
        mode, _cuda(device), new_state),
}


def _wrap_global_functions() -> None:
    """Wrap torch's global-generator functions (once) so that they act on the calling
    thread's innermost block's generators while it is in a block. Each place a function is
    found is wrapped (``torch.manual_seed`` is not ``torch.random.manual_seed`` once
    ``torch._dynamo`` is imported: it wraps the former)."""
    if _wrapped:
        return
    with _wrap_lock:
        if _wrapped:
            return
        places = [(torch, _CPU_FUNCTIONS), (torch.random, _CPU_FUNCTIONS),
                  (torch.cuda, _CUDA_FUNCTIONS), (torch.cuda.random, _CUDA_FUNCTIONS)]
        for where, functions in places:
            for name, fn in functions.items():
                real = getattr(where, name, None)
                if callable(real) and not getattr(real, "_accelfn_in_block", False):
                    setattr(where, name, _in_block(real, name, fn))
        _wrapped.append(True)
