"""Tensor-parallel plans: module-name patterns mapped to torch's ``ParallelStyle``s.

``{"blocks.*.up": ColwiseParallel(), "blocks.*.down": RowwiseParallel()}`` names modules by
``fnmatch`` patterns over ``model.named_modules()`` names (wrappers such as
``torch.compile``'s ``_orig_mod`` left out). [`resolve_plan`][] turns a plan into the exact
names ``torch.distributed.tensor.parallel.parallelize_module`` takes, and refuses, before
anything changes, a pattern that names no module, a module named twice, and a layer whose
sharded width the tensor-parallel size does not divide.

[`llama`][] is the plan of Llama-style decoder layers (Hugging Face ``transformers``' Llama,
Mistral, Qwen2/3 module names), shipped so that a user does not write it out:

    from accelfn.transforms.distributed import plans

    step = af.distributed(strategy="fsdp", tp=2, tensor_parallel=plans.llama())(step)
"""

from __future__ import annotations

from collections.abc import Mapping
from fnmatch import fnmatchcase
from typing import Any

from torch import nn

__all__ = ["apply_plan", "check_plan", "llama", "resolve_plan"]

_WRAPPERS = frozenset({"_orig_mod", "_checkpoint_wrapped_module", "_fsdp_wrapped_module"})


def _styles() -> tuple[type, type, type]:
    from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel

    return ParallelStyle, ColwiseParallel, RowwiseParallel


def check_plan(plan: object) -> dict[str, Any]:
    """``plan`` as a dict, refused when it is not a non-empty mapping of ``str`` patterns to
    ``ParallelStyle`` instances (checked when the transform is built)."""
    style_type = _styles()[0]
    if not isinstance(plan, Mapping) or not plan:
        raise ValueError(
            f"distributed(tensor_parallel={plan!r}) must map module-name patterns to torch "
            "ParallelStyles, e.g. {'blocks.*.up': ColwiseParallel(), 'blocks.*.down': "
            "RowwiseParallel()} (torch.distributed.tensor.parallel)")
    for pattern, style in plan.items():
        if not isinstance(pattern, str) or not pattern:
            raise TypeError(f"distributed(tensor_parallel=...): the key {pattern!r} is not a "
                            "module-name pattern; use strings such as 'blocks.*.up'")
        if not isinstance(style, style_type):
            hint = " (an instance: ColwiseParallel(), not the class)" if isinstance(
                style, type) else ""
            raise TypeError(
                f"distributed(tensor_parallel=...): {pattern!r} maps to {style!r}, not a "
                f"torch.distributed.tensor.parallel.ParallelStyle{hint}")
    return dict(plan)


def _clean(name: str) -> str:
    return ".".join(part for part in name.split(".") if part not in _WRAPPERS)


def _sharded_width(module: nn.Module, style: Any, tp: int) -> tuple[str, int] | None:
    """(what, width) of the dimension ``style`` shards in ``module``; None when the style
    shards no weight (SequenceParallel, input/output preparation). Refuses a module the
    style cannot shard."""
    _, colwise, rowwise = _styles()
    if not isinstance(style, (colwise, rowwise)):
        return None
    kind = "ColwiseParallel" if isinstance(style, colwise) else "RowwiseParallel"
    if isinstance(module, nn.Linear):
        return ("out_features", module.out_features) if kind == "ColwiseParallel" else (
            "in_features", module.in_features)
    if isinstance(module, nn.Embedding):
        return ("embedding_dim", module.embedding_dim) if kind == "ColwiseParallel" else (
            "num_embeddings", module.num_embeddings)
    raise ValueError(f"{kind} shards nn.Linear and nn.Embedding layers only, and "
                     f"{type(module).__name__} is neither: name the layers inside it (as "
                     "'blocks.*.up'), not the module that holds them")


def resolve_plan(model: nn.Module, plan: Mapping[str, Any], tp: int) -> dict[str, Any]:
    """``plan``'s patterns replaced by the names of the modules they match, in the model's
    order; a ``ValueError`` for a pattern matching no module, a module matched twice, or a
    sharded width (``out_features`` for ColwiseParallel, ``in_features`` for RowwiseParallel)
    not divisible by ``tp``. Changes nothing."""
    # checkpointed's scope (the model under "module", marked by its key) is no name of the
    # user's model: the patterns name the model's own modules
    scoped = hasattr(model, "accelfn_checkpoint_key")
    modules = [(name.removeprefix("module.") if scoped else name, module)
               for name, module in model.named_modules() if name and not (scoped and
                                                                          name == "module")]
    owner: dict[str, str] = {}
    resolved: dict[str, Any] = {}
    for pattern, style in plan.items():
        matched = [(name, module) for name, module in modules
                   if fnmatchcase(_clean(name), pattern)]
        if not matched:
            names = [_clean(name) for name, _ in modules]
            shown = ", ".join(repr(n) for n in names[:8]) + (", ..." if len(names) > 8 else "")
            raise ValueError(
                f"distributed(tensor_parallel=...): {pattern!r} names no module of "
                f"{type(model).__name__}, whose modules are {shown}; patterns are fnmatch "
                "patterns over these names, e.g. 'blocks.*.up'")
        for name, module in matched:
            if name in owner:
                raise ValueError(
                    f"distributed(tensor_parallel=...): {_clean(name)!r} is named by both "
                    f"{owner[name]!r} and {pattern!r}; give each module one ParallelStyle")
            owner[name] = pattern
            try:
                width = _sharded_width(module, style, tp)
            except ValueError as error:
                raise ValueError(f"distributed(tensor_parallel=...): {pattern!r} names "
                                 f"{_clean(name)!r}; {error}") from None
            if width is not None and width[1] % tp:
                raise ValueError(
                    f"distributed(tp={tp}): {_clean(name)!r} ({type(style).__name__}) shards "
                    f"its {width[0]}={width[1]} over {tp} processes, which {tp} does not "
                    f"divide; pick tp among the divisors of {width[1]} or leave the layer "
                    "out of the plan")
            resolved[name] = style
    order = [name for name, _ in modules if name in resolved]
    return {("module." + name if scoped else name): resolved[name] for name in order}


def apply_plan(model: nn.Module, tp_mesh: Any, resolved: Mapping[str, Any]) -> None:
    """``parallelize_module(model, tp_mesh, resolved)``: the named layers' weights become
    DTensors sharded over the tensor-parallel group, in place."""
    from torch.distributed.tensor.parallel import parallelize_module

    parallelize_module(model, tp_mesh, dict(resolved))


def llama(config: Any = None, *, tp: int | None = None) -> dict[str, Any]:
    """Equivalent to the plan ``transformers`` declares for Llama (``base_model_tp_plan``):
    in every decoder layer, the attention's ``q_proj``, ``k_proj``, ``v_proj`` and the MLP's
    ``gate_proj``, ``up_proj`` column-wise, ``o_proj`` and ``down_proj`` row-wise.

    Each process of a tensor-parallel group then holds ``1/tp`` of every layer's attention
    heads and MLP width, and a layer costs two all-reduces (after ``o_proj`` and after
    ``down_proj``), Megatron-LM's split. The embedding, the norms and ``lm_head`` stay whole
    in the group (FSDP2 shards them over the data-parallel processes), so a step may read
    ``model.lm_head.weight`` for ``af.linear_cross_entropy`` as in one process.

    The patterns (``"*layers.*.self_attn.q_proj"``, ...) match a ``LlamaForCausalLM``
    (``model.layers.0...``), a bare ``LlamaModel`` (``layers.0...``) and the models that
    share Llama's module names (Mistral, Qwen2, Qwen3). ``tp`` must divide the number of
    attention heads and of key-value heads, or a process would hold part of a head: pass the
    model's ``config`` (anything with ``num_attention_heads``, and ``num_key_value_heads``
    when it differs) and ``tp`` to have that checked here; the widths themselves are
    checked by ``distributed`` before anything is sharded.
    """
    if (config is None) != (tp is None):
        raise TypeError("plans.llama(config, tp=k) checks the heads against k: pass both "
                        "(e.g. plans.llama(model.config, tp=2)) or neither")
    if config is not None and tp is not None:
        if not isinstance(tp, int) or isinstance(tp, bool) or tp < 1:
            raise ValueError(f"plans.llama(tp={tp!r}): tp is the number of processes a "
                             "layer is sharded over, an int >= 1")
        heads = getattr(config, "num_attention_heads", None)
        if not isinstance(heads, int):
            raise TypeError(f"plans.llama(config): {type(config).__name__} has no "
                            "num_attention_heads; pass the model's config (model.config)")
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        for what, count in (("num_attention_heads", heads), ("num_key_value_heads", kv_heads)):
            if count % tp:
                divisors = [d for d in range(1, count + 1) if heads % d == 0 == kv_heads % d]
                raise ValueError(
                    f"plans.llama(tp={tp}): the model has {what}={count}, which {tp} does not "
                    f"divide, so a process would hold part of a head; pick tp among "
                    f"{divisors} (the divisors of both head counts)")
    _, colwise, rowwise = _styles()
    return {
        "*layers.*.self_attn.q_proj": colwise(),
        "*layers.*.self_attn.k_proj": colwise(),
        "*layers.*.self_attn.v_proj": colwise(),
        "*layers.*.self_attn.o_proj": rowwise(),
        "*layers.*.mlp.gate_proj": colwise(),
        "*layers.*.mlp.up_proj": colwise(),
        "*layers.*.mlp.down_proj": rowwise(),
    }
