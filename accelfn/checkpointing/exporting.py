"""Trained weights out, in the files the ecosystem loads: ``model.safetensors`` (or a Hugging
Face ``save_pretrained`` folder), whole, from one process or from FSDP/HSDP shards.

    from accelfn import checkpointing

    checkpointing.export("out/model", state)                        # out/model/model.safetensors
    checkpointing.export("out/ema", state, ema=True, dtype=torch.bfloat16)

    # anywhere, without accelfn:
    from safetensors.torch import load_file
    weights = load_file("out/model/model.safetensors")
    model.load_state_dict(weights)                                   # (re-tie first: see below)

Every process calls it (consolidating shards is a collective): the full state dict comes from
``torch.distributed.checkpoint.state_dict.get_model_state_dict(model,
options=StateDictOptions(full_state_dict=True, cpu_offload=True))``, which gathers DTensor
and FSDP shards onto the first process's CPU memory and strips the wrappers' prefixes
(DDP's ``module.``, ``torch.compile``'s ``_orig_mod.``); the first process writes the file with
``safetensors.torch.save_file`` (to a temporary name, then renamed), and an error there is
raised on every process.

* ``ema=True`` exports the ``with_ema`` average instead of the weights (as
  ``af.ema_state_dict``: averaged parameters, and buffers when they are averaged): it is
  copied into the model for the gathering and the model's own values are put back.
* Tied weights (one parameter under several names, e.g. an embedding and an output layer)
  are written once, under the first name ``state_dict()`` gives, as ``transformers`` does;
  the file's metadata ``accelfn.tied`` (JSON, ``{"dropped name": "kept name"}``) records
  the tie. safetensors refuses tensors that share memory, and copying them would double them
  and lose the tie on load.
* ``dtype`` casts the floating-point tensors (integer buffers such as BatchNorm's
  ``num_batches_tracked`` keep theirs).
* ``format="transformers"``: a model with ``save_pretrained`` (a ``transformers``
  ``PreTrainedModel``) writes its ``save_pretrained`` folder (``config.json``,
  ``model.safetensors``, ...) from the consolidated weights; ``transformers`` handles the
  ties it declares.

``safetensors`` is imported when ``export`` runs, and ``ImportError`` says how to install it.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import re
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, Literal

import torch
from torch import nn

from ..core import compat
from ..core.state import TrainState
from .collective import agree, rank_world
from .format import CheckpointError

__all__ = ["EXPORT_FILE", "export", "tied_names"]

EXPORT_FILE = "model.safetensors"
_FORMATS = ("safetensors", "transformers")
# segments that wrappers add to parameter names and state_dict() keys leave out
_WRAPPERS = re.compile(r"(^|\.)(module|_orig_mod|_checkpoint_wrapped_module|_fsdp_wrapped_module)"
                       r"(?=\.)")


def _plain(model: nn.Module) -> nn.Module:
    """The user's module inside DDP and ``torch.compile`` wrappers."""
    while True:
        inner = compat.unwrap_compiled(model)
        if isinstance(inner, nn.parallel.DistributedDataParallel):
            inner = inner.module
        if inner is model:
            return model
        model = inner


def _name(fqn: str) -> str:
    return _WRAPPERS.sub(r"\1", fqn).lstrip(".")


def tied_names(model: nn.Module) -> dict[str, str]:
    """``{name: first name}`` of every parameter or buffer of ``model`` that is also
    reachable under an earlier name (tied weights), in ``state_dict()`` order."""
    first: dict[int, str] = {}
    tied: dict[str, str] = {}
    named = [*model.named_parameters(remove_duplicate=False),
             *model.named_buffers(remove_duplicate=False)]
    for fqn, tensor in named:
        name = _name(fqn)
        kept = first.setdefault(id(tensor), name)
        if kept != name:
            tied[name] = kept
    return tied


@contextlib.contextmanager
def _ema_in_model(state: TrainState) -> Iterator[None]:
    """While the block runs, ``state.model`` holds the ``with_ema`` average (the model's own
    values come back on exit, also after an error)."""
    slot = state.slots.get("with_ema")
    if slot is None or not hasattr(slot, "sources") or not hasattr(slot, "values"):
        raise ValueError(
            "export(ema=True): this state has no EMA weights: build the step with "
            "af.with_ema(...) and run it (or step.prepare(state) after loading a checkpoint) "
            "first, or export the weights with ema=False")
    sources = [t.detach() for t in slot.sources(state.model)]
    with torch.no_grad():
        own = [t.clone() for t in sources]
        compat.foreach_copy_(sources, list(slot.values))
        try:  # not state.lend_model: state_dict() would then give the model's own values
            yield
        finally:
            compat.foreach_copy_(sources, own)


def _full_state_dict(model: nn.Module) -> dict[str, Any]:
    """The whole ``state_dict`` of ``model`` on the first process's CPU (``{}`` elsewhere)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    full = get_model_state_dict(
        model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return dict(full)


def _check(directory: str | os.PathLike[str], state: Any, format: str,
           dtype: torch.dtype | None, metadata: Mapping[str, str] | None) -> Path:
    if not isinstance(state, TrainState):
        raise TypeError(f"export(directory, state): state must be an accelfn.TrainState, got "
                        f"{type(state).__name__}")
    if format not in _FORMATS:
        raise ValueError(f"export(format={format!r}): use one of {', '.join(map(repr, _FORMATS))}")
    if dtype is not None and (not isinstance(dtype, torch.dtype) or not dtype.is_floating_point):
        raise ValueError(f"export(dtype={dtype!r}): give a floating-point torch.dtype, e.g. "
                         "torch.bfloat16, or None to keep the weights' own")
    if metadata is not None and not all(isinstance(k, str) and isinstance(v, str)
                                        for k, v in metadata.items()):
        raise TypeError("export(metadata=...): safetensors metadata maps str to str")
    if format == "transformers" and not hasattr(_plain(state.model), "save_pretrained"):
        raise ValueError(
            f"export(format='transformers'): {type(_plain(state.model)).__name__} has no "
            "save_pretrained (it is not a transformers PreTrainedModel); use "
            "format='safetensors'")
    out = Path(directory)
    if out.exists() and not out.is_dir():
        raise ValueError(f"export({str(out)!r}): is a file; pass a folder (it is made when "
                         "missing)")
    return out


def export(directory: str | os.PathLike[str], state: TrainState, *,
           format: Literal["safetensors", "transformers"] = "safetensors", ema: bool = False,
           dtype: torch.dtype | None = None,
           metadata: Mapping[str, str] | None = None) -> Path:
    """Equivalent to ``safetensors.torch.save_file(model.state_dict(), directory /
    "model.safetensors")`` on the first process, with the model whole (gathered from its
    shards), tied weights written once, and the wrappers' prefixes left out.

    Args:
        directory: the folder to write into (made when missing); an existing
            ``model.safetensors`` there is replaced.
        state: the run's [`TrainState`][accelfn.TrainState]; every process passes its own.
        format: ``"safetensors"`` (one ``model.safetensors``) or ``"transformers"`` (the
            model's ``save_pretrained`` folder, for a ``transformers`` model).
        ema: export the ``with_ema`` average instead of the weights.
        dtype: cast floating-point tensors to this dtype (e.g. ``torch.bfloat16``).
        metadata: more ``str -> str`` entries for the file's header.

    Returns:
        The written file (``directory/model.safetensors``; the folder for
        ``format="transformers"``), on every process.

    Raises:
        ValueError: an unknown format or dtype, ``ema=True`` without ``with_ema``, a
            non-``transformers`` model with ``format="transformers"``, ``directory`` a file.
        ImportError: safetensors is not installed.

    The tie record: ``safetensors.safe_open(path, "pt").metadata()["accelfn.tied"]`` is
    ``{"dropped name": "kept name"}`` as JSON; ``weights[dropped] = weights[kept]`` before
    ``model.load_state_dict(weights)`` (strict), or ``strict=False`` on a model that ties them
    itself.
    """
    out = _check(directory, state, format, dtype, metadata)
    if importlib.util.find_spec("safetensors") is None:
        raise ImportError("export() writes safetensors files: pip install safetensors")
    plain = _plain(state.model)
    tied = tied_names(plain)
    # written inside the block: on a CPU the gathered tensors may be the model's own, which
    # get their values back at its end
    with _ema_in_model(state) if ema else contextlib.nullcontext():
        full = _full_state_dict(state.model)  # a collective: every process takes part
        return _write(out, state, full, tied, plain, format, ema, dtype, metadata)


def _write(out: Path, state: TrainState, full: dict[str, Any], tied: dict[str, str],
           plain: nn.Module, format: str, ema: bool, dtype: torch.dtype | None,
           metadata: Mapping[str, str] | None) -> Path:
    """The first process writes ``full``; its error, if any, is raised on every process."""
    rank, _ = rank_world()
    error: BaseException | None = None
    path = out if format == "transformers" else out / EXPORT_FILE
    if rank == 0:
        try:
            from safetensors.torch import save_file

            weights = {k: (v.to(dtype) if dtype is not None and v.is_floating_point() else v)
                       for k, v in full.items() if isinstance(v, torch.Tensor)}
            out.mkdir(parents=True, exist_ok=True)
            if format == "transformers":
                for name, kept in tied.items():  # one tensor, as the model's own state_dict
                    if name in weights and kept in weights:
                        weights[name] = weights[kept]
                save_pretrained: Any = getattr(plain, "save_pretrained")  # noqa: B009
                save_pretrained(out, state_dict=weights, safe_serialization=True)
            else:
                ties = {k: v for k, v in tied.items() if k in weights and v in weights}
                header = {"format": "pt", "accelfn.tied": json.dumps(ties),
                          "accelfn.step": str(state.step), "accelfn.ema": str(ema).lower(),
                          **(metadata or {})}
                unique = {k: v.contiguous() for k, v in weights.items() if k not in ties}
                tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
                try:
                    save_file(unique, str(tmp), metadata=header)
                    os.replace(tmp, path)
                finally:
                    tmp.unlink(missing_ok=True)
        except Exception as exc:  # every process raises, none waits in a collective
            error = exc
    agree(error, "export", kind=CheckpointError, like=(ValueError, TypeError, OSError))
    return path
