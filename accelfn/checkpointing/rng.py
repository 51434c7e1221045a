"""RNG states of this process as tensors and plain data: Python, NumPy, torch CPU, CUDA.

Stored as tensors and ints (not the generators' pickles), so that a checkpoint loads with
``torch.load(weights_only=True)``. Restoring is validated first: ``rng_setters()`` checks a
saved state whole and returns the setters without calling any.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from .format import CheckpointError

__all__ = ["rng_setters", "rng_state", "set_rng_state"]

Setter = tuple[str, Callable[[], None]]


def _numpy_state() -> tuple[str, np.ndarray[Any, Any], int, int, float]:
    state = np.random.get_state(legacy=True)
    assert isinstance(state, tuple)  # legacy=True: the 5-tuple form
    kind, keys, pos, has_gauss, cached = state
    return str(kind), np.asarray(keys), int(pos), int(has_gauss), float(cached)


def rng_state() -> dict[str, Any]:
    """Equivalent to ``random.getstate()``, ``np.random.get_state()``, ``torch.get_rng_state()``
    and ``torch.cuda.get_rng_state_all()``, as tensors and plain data (this process' RNGs)."""
    version, internal, gauss = random.getstate()
    kind, keys, pos, has_gauss, cached = _numpy_state()
    cuda = None
    if torch.cuda.is_available() and torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
        cuda = torch.cuda.get_rng_state_all()
    return {
        "python": {"version": int(version), "state": torch.tensor(internal, dtype=torch.int64),
                   "gauss_next": gauss},
        "numpy": {"kind": kind, "keys": torch.from_numpy(keys.astype(np.int64)),
                  "pos": pos, "has_gauss": has_gauss, "cached_gaussian": cached},
        "torch": torch.get_rng_state(),
        "cuda": cuda,
    }


def rng_setters(saved: Any, dropped: frozenset[str] = frozenset()) -> list[Setter]:
    """Validated setters for the RNG states in ``saved``, by part name (nothing is set yet);
    the parts named in ``dropped`` are left out."""
    try:
        py = saved["python"]
        internal = tuple(int(v) for v in py["state"].tolist())
        gauss = py["gauss_next"]
        python_state = (int(py["version"]), internal, None if gauss is None else float(gauss))
        if len(internal) != len(random.getstate()[1]):
            raise ValueError("Python random state has the wrong length")
        npy = saved["numpy"]
        keys = npy["keys"].numpy().astype(np.uint32)
        numpy_state = (str(npy["kind"]), keys, int(npy["pos"]), int(npy["has_gauss"]),
                       float(npy["cached_gaussian"]))
        if keys.shape != _numpy_state()[1].shape:
            raise ValueError("NumPy random state has the wrong length")
        cpu = saved["torch"]
        if not isinstance(cpu, torch.Tensor) or cpu.shape != torch.get_rng_state().shape:
            raise ValueError("torch CPU RNG state has the wrong size")
        cuda = saved["cuda"]
    except (KeyError, TypeError, AttributeError, ValueError) as error:
        raise CheckpointError(f"the checkpoint's RNG states are malformed ({error})") from error
    setters: list[Setter] = [
        ("rng.python", lambda: random.setstate(python_state)),
        ("rng.numpy", lambda: np.random.set_state(numpy_state)),
        ("rng.torch", lambda: torch.set_rng_state(cpu)),
    ]
    if cuda is not None and torch.cuda.is_available():
        if len(cuda) != torch.cuda.device_count():
            raise CheckpointError(
                f"the checkpoint holds CUDA RNG states of {len(cuda)} device(s), this process "
                f"sees {torch.cuda.device_count()}; run with the same visible devices (or "
                "allow_resharding=True to resume without RNG states)"
            )
        setters.append(("rng.cuda", lambda: torch.cuda.set_rng_state_all(cuda)))
    return [(name, fn) for name, fn in setters if name not in dropped]


def set_rng_state(saved: dict[str, Any]) -> None:
    """Set every RNG from [`rng_state`][]'s result: equivalent to ``random.setstate``,
    ``np.random.set_state``, ``torch.set_rng_state`` and ``torch.cuda.set_rng_state_all``."""
    for _, setter in rng_setters(saved):
        setter()
