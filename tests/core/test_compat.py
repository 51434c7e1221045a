"""Every private torch API accelfn uses, each checked against what it must do.

When torch changes one of them, the failing test names the function in accelfn.core.compat
to update: nothing else of accelfn touches torch's private names.
"""

from __future__ import annotations

import ast
import os
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from tensordict import TensorDict
from torch import nn

import accelfn as af
from accelfn.core import compat

ROOT = Path(__file__).resolve().parents[2] / "accelfn"


def test_non_finite_check_and_unscale_scales_and_flags():
    grads = [torch.tensor([2.0, 4.0]), torch.tensor([float("inf")])]
    found = torch.zeros(())
    compat.non_finite_check_and_unscale_(grads, found, torch.tensor(0.5))
    assert torch.equal(grads[0], torch.tensor([1.0, 2.0])) and found.item() == 1.0


def test_foreach_ops():
    a, b = [torch.ones(3), torch.full((2,), 4.0)], [torch.zeros(3), torch.zeros(2)]
    compat.foreach_div_(a, torch.tensor(2.0))
    assert torch.equal(a[1], torch.full((2,), 2.0))
    compat.foreach_lerp_(b, a, [torch.tensor(0.5)] * 2)
    assert torch.equal(b[1], torch.ones(2))
    compat.foreach_copy_(b, a)
    assert torch.equal(b[0], a[0])
    assert [n.item() for n in compat.foreach_norm([torch.tensor([3.0, 4.0])])] == [5.0]


def test_step_supports_amp_scaling_is_true_for_fused_adam_only():
    p = [nn.Parameter(torch.ones(1))]
    assert compat.step_supports_amp_scaling(torch.optim.AdamW(p, fused=True))
    assert not compat.step_supports_amp_scaling(torch.optim.SGD(p, lr=0.1))


def test_unwrap_compiled_returns_the_original_module():
    model = nn.Linear(2, 2)
    assert compat.unwrap_compiled(torch.compile(model)) is model  # wrapping does not compile
    assert compat.unwrap_compiled(model) is model


def test_compile_modes_and_backends():
    assert "max-autotune" in compat.compile_modes()
    assert "inductor" in compat.compile_backends() and "eager" in compat.compile_backends()


def test_set_nested_element():
    root: dict = {}
    compat.set_nested_element(root, ("a", "b"), 1)
    assert root == {"a": {"b": 1}}


def test_grad_scaler_internals():
    model = nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=4.0)
    scaler.scale(model(torch.ones(1, 2)).sum()).backward()
    assert compat.scaler_scale(scaler).item() == 4.0
    scaler.unscale_(opt)
    assert [f.item() for f in compat.scaler_found_inf(scaler, opt)] == [0.0]
    with pytest.raises(RuntimeError, match="unscale_"):
        scaler.unscale_(opt)  # the wedge compat.scaler_forget_step undoes
    compat.scaler_forget_step(scaler)
    scaler.unscale_(opt)  # no error: the iteration was forgotten
    assert scaler.get_scale() == 4.0


def test_aten_observer_sees_operators():
    seen = []
    with compat.aten_observer(lambda name, args, kwargs: seen.append(name)):
        torch.ones(2).nonzero()
    assert "nonzero" in seen


def test_module_apply_keeps_parameter_objects():
    model = nn.Linear(2, 2)
    weight = model.weight
    compat.module_apply(model, lambda t: t * 0)
    assert model.weight is weight and torch.equal(weight, torch.zeros(2, 2))


def test_no_module_outside_compat_names_a_private_torch_attribute():
    offenders = []
    for path in ROOT.rglob("*.py"):
        if path.name.startswith("compat") and path.parent.name == "core":
            continue
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith(
                    "torch") and any(part.startswith("_") for part in node.module.split(".")):
                offenders.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.module}")
            if isinstance(node, ast.Attribute) and node.attr.startswith("_") \
                    and not node.attr.startswith("__"):
                base = node.value
                while isinstance(base, ast.Attribute):
                    base = base.value
                if isinstance(base, ast.Name) and base.id in ("torch", "dist", "F"):
                    offenders.append(f"{path.relative_to(ROOT)}:{node.lineno} .{node.attr}")
    assert not offenders, "private torch APIs outside accelfn/core/compat*.py:\n" + "\n".join(
        offenders)


def test_tensordict_unchecked_builds_the_tensordict_the_constructor_builds():
    from tensordict import TensorDict

    entries = {"x": torch.randn(4, 3), "y": torch.arange(4)}
    fast = compat.tensordict_unchecked(dict(entries), torch.Size([4]), None)
    slow = TensorDict(entries, batch_size=[4])
    assert type(fast) is TensorDict and fast.batch_size == slow.batch_size
    assert fast.device is None and sorted(fast.keys()) == sorted(slow.keys())
    assert all(fast[k] is entries[k] for k in entries)  # no copy
    unsafe = TensorDict._new_unsafe(dict(entries), batch_size=torch.Size([4]), nested=False)
    assert vars(fast) == {**vars(unsafe), "_tensordict": entries}  # the fields _new_unsafe sets
    assert (fast == slow).all() and fast.clone()["y"].tolist() == [0, 1, 2, 3]
    assert compat.tensordict_unchecked({}, torch.Size([]), torch.device("cpu")).device == \
        torch.device("cpu")


def test_tensordict_has_names_is_any_names():
    from tensordict import TensorDict

    plain = TensorDict({"x": torch.ones(2, 3)}, batch_size=[2, 3])
    named = TensorDict({"x": torch.ones(2, 3)}, batch_size=[2, 3], names=[None, "t"])
    assert compat.tensordict_has_names(plain) is False is any(plain.names)
    assert compat.tensordict_has_names(named) is True is any(named.names)


def test_inductor_cache_dir_and_the_kernel_files_of_loaded_keys(tmp_path, monkeypatch):
    from torch._inductor import codecache

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    assert compat.inductor_cache_dir() == str(tmp_path)
    key = "cxyzkernelkey"
    folder = tmp_path / key[1:3]
    folder.mkdir()
    for name in (f"{key}.main.cpp", f"{key}.main.so", f"{key}.lock", "cxyother.main.so"):
        (folder / name).write_bytes(b"")
    monkeypatch.setitem(codecache.CppPythonBindingsCodeCache.cache, key, lambda: None)
    assert compat.inductor_cpp_kernel_files() == [f"xy/{key}.main.so"]
    (folder / "cxyprobe.so").write_bytes(b"")
    (folder / "cxyprobe.so.load_ok").write_bytes(b"")
    (folder / "cxyfailed.so").write_bytes(b"")  # a probe without the marker did not pass
    assert compat.inductor_isa_probe_files() == ["xy/cxyprobe.so", "xy/cxyprobe.so.load_ok"]


def test_inductor_precompiled_headers_are_the_pairs_built_since(tmp_path, monkeypatch):
    import time

    from torch._inductor import codecache

    assert compat.inductor_header_dir() == str(codecache._HEADER_DIR)
    monkeypatch.setattr(codecache, "_HEADER_DIR", str(tmp_path / "headers"))
    assert compat.inductor_precompiled_headers(0.0) == []  # no directory yet
    root = tmp_path / "headers"
    root.mkdir()
    for name in ("cold.h", "cold.h.gch", "cnew.h", "cnew.h.gch", "conly.h"):
        (root / name).write_bytes(b"x")
    (root / "corphan.h.gch").write_bytes(b"x")  # no header beside it: not a pair
    old = time.time() - 3600
    os.utime(root / "cold.h.gch", (old, old))
    since = time.time() - 60
    assert compat.inductor_precompiled_headers(since) == ["cnew.h", "cnew.h.gch"]
    assert compat.inductor_precompiled_headers(0.0) == ["cnew.h", "cnew.h.gch", "cold.h",
                                                        "cold.h.gch"]


def test_dcp_private_metadata_classes_and_storage_entries(tmp_path):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.filesystem import FileSystemReader

    classes = compat.dcp_private_metadata_classes()
    assert [c.__name__ for c in classes] == ["_MEM_FORMAT_ENCODING", "_StorageInfo"]
    dcp.save({"w": torch.ones(3)}, checkpoint_id=str(tmp_path))
    metadata = FileSystemReader(str(tmp_path)).read_metadata()
    entries = compat.dcp_storage_entries(metadata)
    assert len(entries) == 1 and isinstance(entries[0][1], str) and entries[0][3] > 0


def test_weights_only_unpickle_refuses_arbitrary_globals():
    import pickle

    data = pickle.dumps({"a": [1, 2.5]}, protocol=2)
    assert compat.weights_only_unpickle(data) == {"a": [1, 2.5]}
    with pytest.raises(Exception, match="not an allowed global"):
        compat.weights_only_unpickle(pickle.dumps(print, protocol=2))


def test_stop_node_thread_stops_a_prefetcher():
    from torchdata.nodes import IterableWrapper, Prefetcher

    node = Prefetcher(IterableWrapper(range(100)), prefetch_factor=2)
    next(iter(node))
    compat.stop_node_thread(node)
    worker = getattr(node, "_it", None)
    assert worker is not None and worker._thread is not None
    worker._thread.join(timeout=5)
    assert not worker._thread.is_alive()


def test_compile_counters_count_graphs_and_are_a_copy():
    torch._dynamo.reset()
    before = compat.compile_counters()

    def f(x):
        return torch.sin(x) + 1

    torch.compile(f, backend="eager")(torch.ones(3))
    after = compat.compile_counters()
    graphs = after["stats"]["unique_graphs"] - before.get("stats", {}).get("unique_graphs", 0)
    assert graphs == 1 and after["stats"]["calls_captured"] >= 2
    after["stats"]["unique_graphs"] += 100  # a copy: torch's counters are untouched
    now = compat.compile_counters()["stats"]["unique_graphs"]
    assert now == after["stats"]["unique_graphs"] - 100
    torch._dynamo.reset()


def test_backward_is_loss_backward(monkeypatch):
    def grads(run):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.GELU(), torch.nn.Linear(8, 1))
        for _ in range(2):  # accumulates, as backward does
            run(model(torch.randn(16, 4)).pow(2).mean() * 0.5)
        return [p.grad for p in model.parameters()]

    expected = grads(lambda loss: loss.backward())
    calls = []
    original = torch.Tensor.backward

    def backward(self, *args, **kwargs):
        calls.append(kwargs)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "backward", backward)
    got = grads(compat.backward)
    assert calls == [{"inputs": None}] * 2  # torch's own call, autograd's default inputs
    assert all(torch.equal(a, b) for a, b in zip(expected, got))


def test_backward_accumulates_into_the_given_inputs_only():
    a, b = torch.ones(3, requires_grad=True), torch.ones(3, requires_grad=True)
    compat.backward((a * b * 2).sum(), (a,))
    assert torch.equal(a.grad, torch.full((3,), 2.0)) and b.grad is None


def test_sum_unrecorded_is_the_sum_without_autograd_and_restores_grad_mode():
    w = torch.ones(3, requires_grad=True)
    terms = [(w * k).sum() for k in (1.0, 2.0, 3.0)]
    total = compat.sum_unrecorded(terms)
    assert torch.equal(total, torch.stack([t.detach() for t in terms]).sum(0))
    assert not total.requires_grad and torch.is_grad_enabled()
    with torch.no_grad():
        compat.sum_unrecorded(terms)
        assert not torch.is_grad_enabled()  # as it was


def test_backward_leaves_everything_else_to_loss_backward():
    from torch.overrides import TorchFunctionMode

    w = torch.ones(3, requires_grad=True)
    with pytest.raises(RuntimeError, match="scalar outputs"):  # torch's own errors
        compat.backward(w * 2)
    with pytest.raises(RuntimeError, match="does not require grad"):
        compat.backward(torch.ones(()))

    seen = []

    class Seen(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            seen.append(getattr(func, "__name__", str(func)))
            return func(*args, **(kwargs or {}))

    with Seen():
        compat.backward((w * 2).sum())
    assert "backward" in seen and torch.equal(w.grad, torch.full((3,), 2.0))

    class Sub(torch.Tensor):
        pass

    w.grad = None
    compat.backward((w * 3).sum().as_subclass(Sub))
    assert torch.equal(w.grad, torch.full((3,), 3.0))


def _cpu_stager():
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

    return DefaultStager(StagingOptions(use_pinned_memory=False, use_shared_memory=False,
                                        use_async_staging=False, use_non_blocking_copy=False))


def test_dcp_stager_stages_every_call_and_keeps_a_stager_that_can():
    made = []

    def make():
        made.append(_cpu_stager())
        return made[-1]

    state = {"model": {"w": torch.arange(3.0)}, "step": 1, "kind": dict}
    stager = None
    for step in range(3):  # torch 2.11 fails the second call on a kept stager
        stager = compat.dcp_stager(stager, make)
        state["model"]["w"] += 1
        staged = stager.stage(state)
        assert torch.equal(staged["model"]["w"], torch.arange(3.0) + step + 1)
        assert staged["model"]["w"].data_ptr() != state["model"]["w"].data_ptr()
        assert staged["step"] == 1 and staged["kind"] is dict
    stager.close()
    # a stager is kept exactly when a plain one stages twice on this torch
    plain = _cpu_stager()
    try:
        plain.stage({"w": torch.zeros(1)})
        plain.stage({"w": torch.zeros(1)})
        twice = True
    except KeyError:
        twice = False
    finally:
        plain.close()
    assert len(made) == (1 if twice else 3)


def _private_torch_calls(run) -> set[str]:
    """The torch functions with a private name (one leading underscore) that accelfn's own
    code calls while ``run()`` runs (what torch calls inside its public functions is torch's
    business). A decorated public function runs as its wrapper: ``clip_grad_norm_``'s is
    ``_no_grad_wrapper``, named here by the function it wraps."""
    package, torch_dir = str(ROOT), os.path.dirname(torch.__file__)
    found: set[str] = set()

    def private(name: str) -> bool:
        return name.startswith("_") and not name.startswith("__")

    def profile(frame, event, arg):
        if event == "c_call":
            caller, name = frame, getattr(arg, "__name__", "")
            owner = getattr(arg, "__module__", None) or type(getattr(arg, "__self__", None)
                                                           ).__module__
            in_torch = str(owner).startswith("torch")
        elif event == "call":
            caller, name = frame.f_back, frame.f_code.co_name
            in_torch = frame.f_code.co_filename.startswith(torch_dir)
            wrapped = frame.f_locals.get("func") if name == "_no_grad_wrapper" else None
            name = getattr(wrapped, "__name__", name)
        else:
            return
        if in_torch and private(name) and caller is not None \
                and caller.f_code.co_filename.startswith(package):
            found.add(f"{name} from {os.path.relpath(caller.f_code.co_filename, package)}")

    sys.setprofile(profile)
    try:
        run()
    finally:
        sys.setprofile(None)
    return found


@pytest.mark.parametrize("returns", ["loss", "metrics"])
def test_the_step_calls_no_private_torch_function(returns):
    """backward, the clip, the optimizer step and zero_grad are torch's public calls, and
    no private switch of autograd's mode runs in the step (DESIGN §7)."""
    def loss_fn(model, batch):
        loss = F.cross_entropy(model(batch["x"]), batch["y"])
        return loss if returns == "loss" else {"loss": loss, "half": loss.detach() / 2}

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.GELU(), nn.Linear(8, 3))
    state = af.TrainState(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    step = af.with_clipping(max_norm=0.5)(af.with_accumulation(2)(loss_fn))
    batch = TensorDict({"x": torch.randn(8, 6), "y": torch.randint(0, 3, (8,))}, batch_size=[8])
    step(state, batch)  # prepared
    assert _private_torch_calls(lambda: step(state, batch)) == set()
    # the probe sees what it looks for: the private calls of the code this replaced
    assert _private_torch_calls(lambda: compat.foreach_norm([torch.ones(2)])) == {
        "_foreach_norm from core/compat.py"}
