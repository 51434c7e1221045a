"""Every private torch (and tensordict) API accelfn uses, behind one name each.

torch changes its private functions between releases without notice. Keeping each one here,
with a test in ``tests/core/test_compat.py`` that fails loudly when torch changes it, means a
torch upgrade breaks one file, in a known place (and ``compat_memory`` for the fake tensors
and allocator history of the memory tools, ``compat_distributed`` for the Flight Recorder
and the process group's timeout). The torch range accelfn is tested with is
stated in ``pyproject.toml``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from tensordict import TensorDict
from torch import Tensor, nn

__all__ = [
    "aten_interceptor",
    "aten_observer",
    "backward",
    "compile_backends",
    "compile_counters",
    "compile_modes",
    "cpu_bf16_native",
    "dcp_private_metadata_classes",
    "dcp_stager",
    "dcp_storage_entries",
    "foreach_copy_",
    "foreach_div_",
    "foreach_lerp_",
    "foreach_norm",
    "fsdp_drop_unreduced_grads",
    "inductor_cache_dir",
    "inductor_cpp_kernel_files",
    "inductor_header_dir",
    "inductor_isa_probe_files",
    "inductor_precompiled_headers",
    "is_compiled",
    "module_apply",
    "non_finite_check_and_unscale_",
    "op_schema",
    "scaler_forget_step",
    "scaler_found_inf",
    "scaler_scale",
    "set_nested_element",
    "step_supports_amp_scaling",
    "stop_node_thread",
    "sum_unrecorded",
    "tensordict_has_names",
    "tensordict_unchecked",
    "tensordicts_unchecked",
    "unwrap_compiled",
    "weights_only_unpickle",
]


def non_finite_check_and_unscale_(grads: list[Tensor], found_inf: Tensor,
                                  inv_scale: Tensor) -> None:
    """``torch._amp_foreach_non_finite_check_and_unscale_``: multiply ``grads`` by
    ``inv_scale`` in place and set ``found_inf`` to 1 where any holds NaN/Inf (one fused pass).
    """
    torch._amp_foreach_non_finite_check_and_unscale_(grads, found_inf, inv_scale)


def backward(loss: Tensor, inputs: tuple[Tensor, ...] = ()) -> None:
    """``loss.backward(inputs=inputs or None)``: torch's own call (``inputs``: accumulate into
    these leaves only; empty, autograd's default, every leaf that requires grad)."""
    loss.backward(inputs=inputs or None)  # type: ignore[no-untyped-call]


@torch.no_grad()
def sum_unrecorded(tensors: list[Tensor]) -> Tensor:
    """``torch.stack(tensors).sum(0)`` under ``torch.no_grad()``, as a decorator (as torch's
    ``clip_grad_norm_``): autograd is switched off and back inside torch's own context
    manager, so an interrupt at any line here leaves it as it was."""
    return torch.stack(tensors).sum(0)


def foreach_div_(tensors: list[Tensor], divisor: Tensor | float) -> None:
    """``torch._foreach_div_``: divide every tensor by ``divisor`` in one fused call."""
    torch._foreach_div_(tensors, divisor)


def foreach_lerp_(tensors: list[Tensor], ends: list[Tensor], weights: Sequence[Tensor]) -> None:
    """``torch._foreach_lerp_``: ``t += w * (end - t)`` for every tensor."""
    torch._foreach_lerp_(tensors, ends, list(weights))


def foreach_copy_(targets: list[Tensor], sources: list[Tensor]) -> None:
    """``torch._foreach_copy_``: copy ``sources`` into ``targets`` in one fused call.

    DTensors (FSDP2's sharded parameters), for which torch registers no sharding strategy of
    the fused copy and which one fused call cannot mix with plain tensors (FSDP2's
    unsharded buffers), are copied one pair at a time (``Tensor.copy_``, which DTensor
    implements).
    """
    if any(hasattr(t, "device_mesh") for t in targets):
        for target, source in zip(targets, sources, strict=True):
            target.copy_(source)
        return
    torch._foreach_copy_(targets, sources)


def foreach_norm(tensors: list[Tensor], ord: float = 2.0) -> list[Tensor]:
    """``torch._foreach_norm``: the norm of every tensor, one fused call."""
    return list(torch._foreach_norm(tensors, ord))


def step_supports_amp_scaling(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer.step`` reads a ``found_inf`` attribute and skips on the device
    (``Optimizer._step_supports_amp_scaling``, set by the fused Adam, AdamW and SGD)."""
    return bool(getattr(optimizer, "_step_supports_amp_scaling", False))


def is_compiled(model: torch.nn.Module) -> bool:
    """Whether ``model``'s call is compiled: compiled in place (``Module.compile``, which sets
    ``_compiled_call_impl``) or a ``torch.compile`` wrapper."""
    return getattr(model, "_compiled_call_impl", None) is not None or hasattr(model, "_orig_mod")


def unwrap_compiled(model: torch.nn.Module) -> torch.nn.Module:
    """The module inside a ``torch.compile`` wrapper (``OptimizedModule._orig_mod``)."""
    inner = getattr(model, "_orig_mod", model)
    assert isinstance(inner, torch.nn.Module)
    return inner


def cpu_bf16_native() -> bool:
    """Whether this CPU computes bf16 matmuls and convolutions natively
    (``torch.ops.mkldnn._is_mkldnn_bf16_supported()``: AVX-512 or AMX on x86, bf16 on Arm);
    without it oneDNN emulates bf16 and autocast's bf16 runs many times slower than float32
    (x35 on a ResNet-18 step on an AVX2 CPU)."""
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):  # a build without oneDNN
        return False


def compile_modes() -> tuple[str, ...]:
    """The ``mode=`` values ``torch.compile`` accepts (``torch._inductor.list_mode_options``)."""
    from torch._inductor import list_mode_options

    return tuple(list_mode_options())


def compile_backends() -> list[str]:
    """The ``backend=`` names ``torch.compile`` knows (``torch._dynamo.list_backends``)."""
    import torch._dynamo

    return list(torch._dynamo.list_backends(exclude_tags=()))


def set_nested_element(root: dict[str, Any], path: tuple[str | int, ...], value: Any) -> None:
    """``torch.distributed.checkpoint._nested_dict.set_element``: put ``value`` at ``path``
    of a nested state dict, creating the containers on the way."""
    from torch.distributed.checkpoint._nested_dict import (  # type: ignore[attr-defined]
        set_element,
    )

    set_element(root, path, value)


def scaler_scale(scaler: torch.amp.GradScaler) -> Tensor:
    """The loss scale as a device tensor, without a host read (``GradScaler._get_scale_async``)."""
    scale = scaler._get_scale_async()
    assert scale is not None, "the scaler has not scaled a loss yet"
    return scale


def scaler_found_inf(scaler: torch.amp.GradScaler,
                     optimizer: torch.optim.Optimizer) -> list[Tensor]:
    """The per-device NaN/Inf flags ``unscale_`` recorded for ``optimizer``
    (``GradScaler._found_inf_per_device``)."""
    return list(scaler._found_inf_per_device(optimizer).values())


def scaler_forget_step(scaler: torch.amp.GradScaler) -> None:
    """Forget what ``unscale_`` recorded this iteration, as ``update()`` does at its end, but
    leave the scale and its growth tracker as they are (``GradScaler._per_optimizer_states``):
    an aborted update must not wedge the next one."""
    from collections import defaultdict

    from torch.amp.grad_scaler import _refresh_per_optimizer_state

    scaler._per_optimizer_states = defaultdict(_refresh_per_optimizer_state)


def fsdp_drop_unreduced_grads(module: nn.Module) -> None:
    """Drop the gradients FSDP2 holds unsharded and unreduced in ``module`` and its FSDP2
    submodules: what backward passes accumulated while reduce-scatter was off
    (``set_requires_gradient_sync(False)``), which the optimizer's ``zero_grad`` does not
    reach. Each ``FSDPParam`` of each ``FSDPParamGroup`` (``FSDPState._fsdp_param_groups``)
    keeps them in ``unsharded_accumulated_grad`` (reduce dtype differing from the parameter
    dtype) or on its unsharded parameter (``FSDPParam._unsharded_param.grad``)."""
    from torch.distributed.fsdp import FSDPModule

    for sub in module.modules():
        if not isinstance(sub, FSDPModule):
            continue
        state = sub._get_fsdp_state()
        for group in state._fsdp_param_groups:
            for fsdp_param in group.fsdp_params:
                fsdp_param.unsharded_accumulated_grad = None
                unsharded = getattr(fsdp_param, "_unsharded_param", None)  # after lazy init
                if unsharded is not None:
                    unsharded.grad = None


def aten_observer(
        on_op: Callable[[str, tuple[Any, ...], dict[str, Any]], None],
) -> contextlib.AbstractContextManager[Any]:
    """A ``torch.utils._python_dispatch.TorchDispatchMode`` that calls ``on_op(name, args,
    kwargs)`` before every aten operator run inside it (``name``: the overload packet's, e.g.
    ``"nonzero"``), then runs it."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class _Observer(TorchDispatchMode):  # type: ignore[no-untyped-call]  # untyped in torch
        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (),
                               kwargs: Any = None) -> Any:
            kwargs = kwargs or {}
            on_op(func.overloadpacket.__name__, tuple(args), kwargs)
            return func(*args, **kwargs)

    return _Observer()  # type: ignore[no-untyped-call]  # TorchDispatchMode.__init__


def aten_interceptor(
        handle: Callable[[Any, tuple[Any, ...], dict[str, Any]], Any],
) -> contextlib.AbstractContextManager[Any]:
    """A ``TorchDispatchMode`` that hands every aten operator run inside it to ``handle(op,
    args, kwargs)`` (``op``: the ``OpOverload``), which runs it (``op(*args, **kwargs)``) or
    refuses it, and returns its result."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class _Interceptor(TorchDispatchMode):  # type: ignore[no-untyped-call]  # untyped in torch
        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (),
                               kwargs: Any = None) -> Any:
            return handle(func, tuple(args), kwargs or {})

    return _Interceptor()  # type: ignore[no-untyped-call]  # TorchDispatchMode.__init__


def op_schema(op: Any) -> Any:
    """An aten ``OpOverload``'s schema (``op._schema``: its arguments, which it writes)."""
    return op._schema


def module_apply(module: nn.Module, fn: Callable[[Tensor], Tensor]) -> nn.Module:
    """``nn.Module._apply``: replace every parameter and buffer ``t`` by ``fn(t)`` in place
    (the parameters stay the same objects, so optimizers built on them still hold them)."""
    applied: nn.Module = module._apply(fn)  # type: ignore[no-untyped-call]  # unannotated
    return applied


def dcp_private_metadata_classes() -> list[Any]:
    """The classes DCP pickles into its metadata that torch keeps private
    (``metadata._MEM_FORMAT_ENCODING``, ``filesystem._StorageInfo``): allowed globals for
    the weights-only unpickler."""
    from torch.distributed.checkpoint import filesystem, metadata

    return [metadata._MEM_FORMAT_ENCODING, filesystem._StorageInfo]


def dcp_storage_entries(metadata: Any) -> list[tuple[Any, Any, Any, Any]]:
    """``(index, relative_path, offset, length)`` of every item in DCP metadata's
    ``storage_data`` (its values are the private ``filesystem._StorageInfo``)."""
    return [(index, getattr(info, "relative_path", None), getattr(info, "offset", None),
             getattr(info, "length", None)) for index, info in metadata.storage_data.items()]


_STAGER_STAGES_TWICE: list[bool] = []  # the probe's answer, once per process


def dcp_stager(stager: Any | None, make: Callable[[], Any]) -> Any:
    """``stager`` (a ``torch.distributed.checkpoint.staging.DefaultStager``) when it can stage
    again, else a new one from ``make()`` (the old one closed).

    torch 2.11's ``DefaultStager`` closes its state-dict stager at the end of every
    ``stage()``: its copy table is emptied and the next ``stage()`` raises
    ``KeyError: <class 'type'>``. Later releases keep it open until ``close()``, and a kept
    stager copies into the pinned buffers of the previous call. Which one this torch does is
    probed once, by staging a one-element dict twice on the CPU.
    """
    if stager is not None:
        if not _STAGER_STAGES_TWICE:
            _STAGER_STAGES_TWICE.append(_stager_stages_twice())
        if _STAGER_STAGES_TWICE[0]:
            return stager
        stager.close()
    return make()


def _stager_stages_twice() -> bool:
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

    probe = DefaultStager(StagingOptions(use_pinned_memory=False, use_shared_memory=False,
                                         use_async_staging=False, use_non_blocking_copy=False))
    try:
        for _ in range(2):
            probe.stage({"probe": torch.zeros(1)})
    except KeyError:
        return False
    finally:
        probe.close()
    return True


def weights_only_unpickle(data: bytes) -> Any:
    """Unpickle ``data`` with torch's weights-only unpickler (``torch._weights_only_unpickler``),
    honouring ``torch.serialization.safe_globals``."""
    import io

    from torch import _weights_only_unpickler

    unpickler = _weights_only_unpickler.Unpickler
    return unpickler(io.BytesIO(data), encoding="ASCII").load()  # type: ignore[no-untyped-call]


def stop_node_thread(node: Any) -> None:
    """Stop the background thread of a torchdata ``Prefetcher`` or ``PinMemory`` node, if it
    has one (torchdata 0.11 keeps it as ``node._it`` with a ``_shutdown()`` method and offers
    no public way to stop it)."""
    worker = getattr(node, "_it", None)
    if worker is not None and callable(getattr(worker, "_shutdown", None)):
        worker._shutdown()


def compile_counters() -> dict[str, dict[str, int]]:
    """A copy of ``torch._dynamo.utils.counters``: what ``torch.compile`` did in this process.

    Groups and keys used by accelfn: ``stats.unique_graphs`` (graphs compiled),
    ``stats.calls_captured`` (operations traced into them), ``inductor.fxgraph_cache_hit`` /
    ``fxgraph_cache_miss`` and ``aot_autograd.autograd_cache_hit`` / ``autograd_cache_miss``
    (compiled code found in, or missing from, inductor's caches).
    """
    from torch._dynamo.utils import counters

    return {group: dict(values) for group, values in counters.items()}


def inductor_cache_dir() -> str:
    """``torch._inductor.runtime.cache_dir_utils.cache_dir()``: the directory inductor keeps
    its compiled code in (``TORCHINDUCTOR_CACHE_DIR``, else a per-user temporary one)."""
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    return str(cache_dir())


def inductor_cpp_kernel_files() -> list[str]:
    """The compiled C++ kernels (``.so``/``.o``) this process loaded, as paths relative to
    [`inductor_cache_dir`][]: inductor keeps each under ``<key[1:3]>/<key>.*``, where ``key``
    is a key of ``CppCodeCache.cache`` (and its subclasses'), and builds one only when its
    file is missing."""
    import os

    from torch._inductor import codecache

    keys: set[str] = set()
    for cls in (codecache.CppCodeCache, codecache.CppPythonBindingsCodeCache,
                codecache.CppWrapperCodeCache):
        keys.update(k for k in getattr(cls, "cache", {}) if isinstance(k, str))
    root = inductor_cache_dir()
    found = []
    for key in sorted(keys):
        folder = os.path.join(root, key[1:3])
        if not os.path.isdir(folder):
            continue
        for name in sorted(os.listdir(folder)):
            if name.startswith(key + ".") and name.endswith((".so", ".o")):
                found.append(f"{key[1:3]}/{name}")
    return found


def inductor_isa_probe_files() -> list[str]:
    """The results of inductor's probes of the CPU's vector instruction sets, relative to
    [`inductor_cache_dir`][]: ``cpu_vec_isa.VecISA.check_build`` compiles a test program to
    ``<key[1:3]>/<key>.so`` and marks a load that worked with ``<key>.so.load_ok``, and
    compiles nothing when both exist. Only probes that passed are listed (marker and
    library)."""
    import os

    root = inductor_cache_dir()
    found = []
    for folder in sorted(os.listdir(root)):
        path = os.path.join(root, folder)
        if len(folder) != 2 or not os.path.isdir(path):
            continue
        for name in sorted(os.listdir(path)):
            if name.endswith(".so.load_ok") and os.path.isfile(os.path.join(path, name[:-8])):
                found += [f"{folder}/{name[:-8]}", f"{folder}/{name}"]
    return found


def inductor_header_dir() -> str:
    """``torch._inductor.codecache._HEADER_DIR``: where inductor keeps the C++ headers it
    precompiles (``precompiled_headers`` under the per-user temporary directory, not under
    [`inductor_cache_dir`][]). Each is ``<name>.h`` (one ``#include`` line) and
    ``<name>.h.gch``, ``name`` a hash of the header's preprocessed text, the compiler's
    version and its flags; inductor builds a ``.gch`` only when it is missing."""
    from torch._inductor import codecache

    return str(codecache._HEADER_DIR)


def inductor_precompiled_headers(since: float) -> list[str]:
    """The headers inductor precompiled at or after ``since`` (a ``time.time()``), as names
    in [`inductor_header_dir`][]: each ``<name>.h`` with its ``<name>.h.gch``."""
    import os

    root = inductor_header_dir()
    if not os.path.isdir(root):
        return []
    found = []
    for name in sorted(os.listdir(root)):
        header = name.removesuffix(".gch")
        if name.endswith(".h.gch") and os.path.isfile(os.path.join(root, header)) and \
                os.path.getmtime(os.path.join(root, name)) >= since:
            found += [header, name]
    return found


# the method torch's optimizers call at each step to refuse a step inside a CUDA graph capture
# unless their groups are capturable (the CPU tape of accelfn.testing plays it on the CPU)
# (None in a torch without one: the tape then plays no such check)
OPTIMIZER_CAPTURE_CHECK: str | None = next((name for name in (
    "_accelerator_graph_capture_health_check", "_cuda_graph_capture_health_check")
    if hasattr(torch.optim.Optimizer, name)), None)


_TD_NEW = TensorDict.__new__


def tensordict_unchecked(entries: dict[str, Any], batch_size: torch.Size,
                         device: torch.device | None) -> Any:
    """``TensorDict._new_unsafe(entries, batch_size=..., device=..., nested=False)``: a
    TensorDict of ``entries`` as they are, without the constructor's per-entry checks (the
    caller guarantees shapes and devices agree). Outside compilation its four fields are set
    directly, as ``_new_unsafe`` sets them, in half its time (it is built once per
    micro-batch)."""
    if torch.compiler.is_compiling():
        return TensorDict._new_unsafe(entries, batch_size=batch_size, device=device,  # type: ignore[arg-type]
                                      nested=False)
    return _new_tensordict(entries, batch_size, device)


def tensordicts_unchecked(keys: list[str], rows: Iterable[Sequence[Tensor]],
                          batch_sizes: Sequence[torch.Size], device: torch.device | None
                          ) -> list[Any]:
    """``[tensordict_unchecked(dict(zip(keys, row)), size, device) for row, size in ...]``,
    checking for compilation once (the micro-batches of a split)."""
    build = tensordict_unchecked if torch.compiler.is_compiling() else _new_tensordict
    return [build(dict(zip(keys, row)), size, device) for row, size in zip(rows, batch_sizes)]


def _new_tensordict(entries: dict[str, Any], batch_size: torch.Size,
                    device: torch.device | None) -> Any:
    td = _TD_NEW(TensorDict)
    fields = td.__dict__
    fields["_device"] = device
    fields["_tensordict"] = entries
    fields["_batch_size"] = batch_size
    fields["_td_dim_names"] = None
    return td


def tensordict_has_names(td: Any) -> bool:
    """``TensorDict._has_names()``: whether any batch dimension is named (``any(td.names)``
    without building the list)."""
    return bool(td._has_names())
