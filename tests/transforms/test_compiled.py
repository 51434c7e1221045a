"""compiled(regional=...) and compiled(cache=...): block-wise compilation against eager
PyTorch, graphs that do not grow with depth, stacking with checkpointed and distributed, and a
compile cache file that warms a fresh process (torch's cache counters, not timings).

Run as a script, this file is the worker of its subprocess tests:
``python test_compiled.py cache <file> <out.json>`` (one process compiling with the cache file)
and, under torchrun, ``python test_compiled.py distributed <out_dir>``.
"""

from __future__ import annotations

import copy
import io
import json
import os
import subprocess
import sys
import warnings
import zipfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import pytest
import torch
import torch.nn.functional as F
from helpers import Net, as_dict, classify, make_batch, torchrun
from reference import reference_update

import accelfn as af
from accelfn.core import compat
from accelfn.parts.compile_cache import CacheFile, read_cache, unpack_kernels, write_cache

HERE = Path(__file__).resolve()
TOL = {"atol": 1e-5, "rtol": 1e-4}  # fp32: inductor fuses and reorders reductions


def graphs() -> int:
    return compat.compile_counters().get("stats", {}).get("unique_graphs", 0)


def captured() -> int:
    return compat.compile_counters().get("stats", {}).get("calls_captured", 0)


@pytest.fixture
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def train(step, model, steps=3, lr=0.1):
    state = af.TrainState(model, torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9))
    for i in range(steps):
        step(state, make_batch(n=10, seed=i))
    return state


def reference(model, steps=3, lr=0.1):
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    for i in range(steps):
        reference_update(model, optimizer, as_dict(make_batch(n=10, seed=i)), classify)
    return model


def assert_close(m1, m2):
    for (name, a), b in zip(m1.named_parameters(), m2.parameters()):
        torch.testing.assert_close(a, b, **TOL, msg=f"parameter {name}")


def gradients(model, fn=classify):
    model.zero_grad(set_to_none=True)
    fn(model, make_batch(n=10, seed=7))["loss"].backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}


# ----------------------------------------------------------------------- regional


IN_PLACE, NESTED = True, "nested"


def _in_place(model) -> bool:
    return all("_accelfn_compiled" in b.__dict__ for b in model.blocks)


@pytest.mark.compile
@pytest.mark.parametrize("regional", [IN_PLACE, NESTED])
def test_regional_compiles_each_block_once_and_matches_eager(fresh_dynamo, regional):
    torch.manual_seed(0)
    base = Net(depth=3)
    m1, m2 = copy.deepcopy(base), copy.deepcopy(base)
    step = af.compiled(regional=regional)(classify)
    g0 = graphs()
    with torch._dynamo.config.patch(error_on_recompile=True):  # blocks 2 and 3 reuse block 1's
        state = train(step, m1)
    # one graph: in place, the block's (the rest eager); nested, the whole model's
    assert graphs() - g0 == 1
    assert_close(m1, reference(m2))
    prepared = step.prepare(state)
    assert _in_place(m1) is (regional is IN_PLACE)
    assert prepared.model is m1  # the function receives the model itself
    # in place: the blocks compiled; nested: the model's own call compiled too
    assert compat.is_compiled(m1) is (regional is NESTED)
    assert list(m1.state_dict()) == list(base.state_dict())
    assert all(b.__dict__["_accelfn_tags"] == ("compile",) for b in m1.blocks)
    got, want = gradients(prepared.model), gradients(m2)  # through the compiled model
    for name in want:
        torch.testing.assert_close(got[name], want[name], **TOL, msg=name)


@pytest.mark.compile
def test_regional_traced_code_does_not_grow_with_depth_whole_model_code_does(fresh_dynamo):
    # backend="aot_eager" traces through AOTAutograd without generating code, in seconds
    counts = {}
    for regional in (IN_PLACE, NESTED, False):
        for depth in (2, 6):
            torch._dynamo.reset()
            g, c = graphs(), captured()
            torch.manual_seed(0)
            train(af.compiled(regional=regional, backend="aot_eager")(classify),
                  Net(depth=depth), steps=2)
            counts[regional, depth] = (graphs() - g, captured() - c)
    assert {counts[key][0] for key in counts} == {1}  # one graph each
    per_block = {regional: (counts[regional, 6][1] - counts[regional, 2][1]) / 4
                 for regional in (IN_PLACE, NESTED, False)}
    assert per_block[IN_PLACE] == 0  # one block traced, whatever the depth
    assert per_block[NESTED] <= 2  # a call of the blocks' compiled region
    assert per_block[False] >= 2 * per_block[NESTED] + 1  # every operation of the block


@pytest.mark.compile
def test_nested_with_the_eager_backend_compiles_blocks_in_place_with_a_note(fresh_dynamo,
                                                                            monkeypatch):
    # backend="eager" runs dynamo's graph as traced: a nested region there re-traces its block
    # at every call (torch's invoke_subgraph builds its schema by tracing, x29 slower on the
    # 4-block GPT of benchmarks/compile.py --quick); each block is compiled in place instead
    from torch._higher_order_ops import utils as hop_utils

    traced = []
    materialize = hop_utils.materialize_as_graph
    monkeypatch.setattr(hop_utils, "materialize_as_graph",
                        lambda *a, **k: traced.append(1) or materialize(*a, **k))
    torch.manual_seed(0)
    base = Net(depth=3)
    model = copy.deepcopy(base)
    with pytest.warns(RuntimeWarning, match=r"in place instead of as nested regions: "
                                            r"backend='eager'.*rest of the model runs eager"):
        state = train(af.compiled(regional=NESTED, backend="eager")(classify), model, steps=3)
    assert traced == []  # no region traced per call
    assert _in_place(model)
    assert_close(model, reference(copy.deepcopy(base)))
    assert state.step == 3
    with warnings.catch_warnings():  # asked for in place: nothing to say
        warnings.simplefilter("error")
        train(af.compiled(regional=IN_PLACE, backend="eager")(classify), Net(depth=3), steps=1)


@pytest.mark.compile
@pytest.mark.parametrize("regional", [IN_PLACE, NESTED])
def test_regional_with_checkpointed_in_either_order_matches_eager(fresh_dynamo, regional):
    torch.manual_seed(0)
    base = Net(depth=3)
    expected = reference(copy.deepcopy(base))
    g0 = graphs()
    for build in (lambda f: af.compiled(regional=regional)(af.checkpointed(f)),
                  lambda f: af.checkpointed(af.compiled(regional=regional)(f))):
        model = copy.deepcopy(base)
        with torch._dynamo.config.patch(error_on_recompile=True):
            train(build(classify), model)
        assert_close(model, expected)
        assert _in_place(model) is (regional is IN_PLACE)
        # checkpoint wrapping ran first: the compiled region holds the checkpointed forward
        assert all(b.__dict__["_accelfn_tags"] == ("checkpoint", "compile") for b in model.blocks)
    assert graphs() - g0 == 1  # the second order reused the first one's compiled code


class NormBlock(torch.nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.lin, self.bn = torch.nn.Linear(dim, dim), torch.nn.BatchNorm1d(dim)

    def forward(self, x):
        return x + torch.relu(self.bn(self.lin(x)))


class NormNet(Net):  # blocks whose forward updates BatchNorm running statistics
    def __init__(self, depth: int = 3) -> None:
        super().__init__(depth=depth)
        self.blocks = torch.nn.ModuleList(NormBlock(8) for _ in range(depth))


@pytest.mark.compile
def test_regional_on_blocks_with_running_statistics_matches_eager(fresh_dynamo):
    # torch's nested compile regions refuse blocks that mutate buffers in training
    # (BatchNorm's running statistics): such blocks are compiled in place instead
    torch.manual_seed(0)
    base = NormNet()
    expected = reference(copy.deepcopy(base))
    compiled = af.compiled(regional=NESTED, backend="aot_eager")
    for build in (lambda f: compiled(f), lambda f: compiled(af.checkpointed(f)),
                  lambda f: af.checkpointed(compiled(f))):
        torch._dynamo.reset()
        model = copy.deepcopy(base)
        with pytest.warns(RuntimeWarning, match="running statistics"):
            train(build(classify), model)
        assert _in_place(model)
        got, want = model.state_dict(), expected.state_dict()
        assert list(got) == list(want)
        for name in want:  # parameters and running statistics (updated once per forward)
            torch.testing.assert_close(got[name], want[name], **TOL, msg=name)


@pytest.mark.compile
def test_a_step_reaching_the_model_only_through_submodules_is_told_it_ran_eager(fresh_dynamo):
    """compiled() compiles the model's call in place; a step that never calls model(...)
    (the loss outside forward) runs eager: said once, with the fix. A step that calls it is
    told nothing and the check leaves no trace (no recompile at the next call)."""
    def outside(model, batch):  # the model's own layers, called one by one
        h = model.inp(batch["x"])
        for block in model.blocks:
            h = block(h)
        return F.cross_entropy(model.head(h), batch["y"])

    with pytest.warns(RuntimeWarning, match=r"did not call it.*regional=True"):
        train(af.compiled(backend="eager")(outside), Net(), steps=1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        state = train(af.compiled(backend="eager")(classify), Net(), steps=1)
        before = graphs()
        step = af.compiled(backend="eager")(classify)
        for i in range(2):
            step(state, make_batch(n=10, seed=i))
    assert graphs() == before  # the profile function left nothing to guard on


def test_regional_without_repeated_blocks_says_how_to_fix():
    model = torch.nn.Sequential(torch.nn.Linear(6, 4))
    state = af.TrainState(model, torch.optim.SGD(model.parameters(), lr=0.1))
    step = af.compiled(regional=True)(classify)
    with pytest.raises(ValueError, match=r"no repeated blocks.*use compiled\(\)"):
        step(state, make_batch())


def test_options_are_checked_and_described(tmp_path):
    with pytest.raises(TypeError, match=r"takes False, True .* or 'nested'"):
        af.compiled(regional="yes")
    with pytest.raises(TypeError, match="booleans"):
        af.compiled(fullgraph="yes")
    with pytest.raises(TypeError, match="path of a file"):
        af.compiled(cache=3)
    with pytest.raises(ValueError, match="backend='inductor'"):
        af.compiled(cache=tmp_path / "c.bin", backend="eager")
    for options in ("max-autotune", [("epilogue_fusion", True)], {1: True}):
        with pytest.raises(TypeError, match="dict of inductor options"):
            af.compiled(options=options)
    with pytest.raises(ValueError, match="Unexpected optimization option no_such_option"):
        af.compiled(options={"no_such_option": 1})  # when built, not at the first step
    with pytest.raises(TypeError, match="dynamic"):
        af.compiled(dynamic=1)
    with pytest.raises(ValueError, match="names a directory"):
        af.compiled(cache=tmp_path)
    options = {"epilogue_fusion": True}
    built = af.compiled(options=options)
    options["epilogue_fusion"] = False  # the caller's dict changes; the transform does not
    assert built == af.compiled(options={"epilogue_fusion": True})
    step = af.compiled(regional=True, cache=tmp_path / "c.bin")(classify)
    assert repr(step).startswith("compiled(regional, cache) ∘ ")
    assert af.compiled(regional=True) == af.compiled(regional=True) != af.compiled()
    assert repr(af.compiled(regional="nested")(classify)).startswith(
        "compiled(regional=nested) ∘ ")
    assert af.compiled(regional="nested") != af.compiled(regional=True)


# ----------------------------------------------------------------------- distributed


def distributed_main(out_dir: str) -> None:
    """Under torchrun: regional compilation with checkpointing inside DDP and FSDP2, each
    stacking order, every rank on its rows of the global batch (tests/dist_worker.py's)."""
    import torch.distributed as dist
    from dist_worker import RANK_ROWS, STEPS, global_batch

    af.init_distributed()
    rank = dist.get_rank()
    cases = {
        "ddp_outer": lambda: af.compiled(regional=True, backend="aot_eager")(
            af.checkpointed(af.distributed(classify))),
        "ddp_inner": lambda: af.distributed(af.checkpointed(
            af.compiled(regional=True, backend="aot_eager")(classify))),
        "fsdp_outer": lambda: af.compiled(regional=True, backend="aot_eager")(
            af.distributed(strategy="fsdp")(af.checkpointed(classify))),
        "fsdp_inner": lambda: af.checkpointed(af.distributed(strategy="fsdp")(
            af.compiled(regional=True, backend="aot_eager")(classify))),
        # nested regions asked for: the sharded blocks are compiled in place, with a note
        "ddp_nested": lambda: af.compiled(regional="nested", backend="aot_eager")(
            af.distributed(classify)),
    }
    results = {}
    for name, build in cases.items():
        torch.manual_seed(0)
        model = Net()
        keys = list(model.state_dict())
        state = af.TrainState(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
        step = build()
        g = graphs()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for i in range(STEPS):
                step(state, {k: v[RANK_ROWS[rank]] for k, v in global_batch(i).items()})
        params = {n: (p.full_tensor() if hasattr(p, "full_tensor") else p.detach()).clone()
                  for n, p in model.named_parameters()}
        results[name] = {"params": params, "graphs": graphs() - g,
                         "keys_kept": list(model.state_dict()) == keys,
                         "in_place": all("_accelfn_compiled" in b.__dict__ for b in model.blocks),
                         "notes": [str(w.message) for w in caught
                                   if "instead of as nested regions" in str(w.message)]}
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.barrier()
    dist.destroy_process_group()


@pytest.mark.compile
@pytest.mark.distributed
def test_regional_under_ddp_and_fsdp_in_either_order_equals_one_process(tmp_path):
    from dist_worker import STEPS, global_batch

    torchrun(HERE, "distributed", tmp_path, timeout=900)
    torch.manual_seed(0)
    model = Net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for i in range(STEPS):
        reference_update(model, optimizer, global_batch(i), classify)
    for rank in range(2):
        results = torch.load(tmp_path / f"rank{rank}.pt", weights_only=True)
        for case, got in results.items():
            assert got["keys_kept"] and got["in_place"], case
            assert got["graphs"] <= 1, (case, got["graphs"])  # the first case compiles
            assert len(got["notes"]) == (case == "ddp_nested"), (case, got["notes"])
            if got["notes"]:
                assert "sharded (DDP/FSDP2)" in got["notes"][0]
            for name, value in model.named_parameters():
                torch.testing.assert_close(got["params"][name], value.detach(), **TOL,
                                           msg=f"{case} rank {rank} {name}")


# ----------------------------------------------------------------------- the cache file


def cache_main(path: str, out: str) -> None:
    """One fresh process: two compiled updates with ``cache=path``; what torch's caches did,
    and which C++ kernels the compiler built (compile threads=1: built in this process)."""
    from torch._inductor import cpp_builder

    built: list[str] = []
    build = cpp_builder.CppBuilder.build

    headers: list[str] = []

    def counting_build(self):  # C++ kernels and instruction set probes; headers apart
        target = self.get_target_file_path()
        if target.endswith((".so", ".o")):
            built.append(target)
        elif target.endswith(".gch"):
            headers.append(target)
        return build(self)

    cpp_builder.CppBuilder.build = counting_build
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.manual_seed(0)
        train(af.compiled(cache=path)(classify), Net(depth=1), steps=2)
    counters = compat.compile_counters()
    Path(out).write_text(json.dumps({
        "inductor": counters.get("inductor", {}), "aot_autograd": counters.get("aot_autograd", {}),
        "kernels_built": len(built), "kernels_loaded": compat.inductor_cpp_kernel_files(),
        "headers_built": [Path(h).name for h in headers],
        "warnings": [str(w.message) for w in caught if "compile cache" in str(w.message)]}))


def run_cache_worker(tmp_path: Path, cache: Path, name: str) -> dict:
    inductor_dir = tmp_path / f"inductor-{name}"  # empty: a fresh machine
    tmp = tmp_path / f"tmp-{name}"  # inductor precompiles its C++ headers under TMPDIR
    tmp.mkdir()
    out = tmp_path / f"{name}.json"
    proc = subprocess.run(
        [sys.executable, str(HERE), "cache", str(cache), str(out)], capture_output=True,
        text=True, timeout=900, env={**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(inductor_dir),
                                     "TMPDIR": str(tmp), "TORCHINDUCTOR_COMPILE_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def cold_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("cache")
    cache = tmp / "ckpt" / "compile-cache.bin"  # beside the checkpoints, in their directory
    return tmp, cache, run_cache_worker(tmp, cache, "cold")


@pytest.mark.compile
def test_cache_file_makes_a_fresh_process_hit_instead_of_compile(cold_run, tmp_path):
    _, cache, cold = cold_run
    assert cold["inductor"].get("fxgraph_cache_miss", 0) >= 2  # compiled: forward, backward
    assert cold["inductor"].get("fxgraph_cache_hit", 0) == 0 and cold["warnings"] == []
    assert cold["kernels_built"] >= 1 and cold["kernels_loaded"]  # the C++ compiler ran
    contents, problem = read_cache(cache, {"torch": str(torch.__version__)})
    assert problem is None and contents is not None and contents.artifacts
    with zipfile.ZipFile(io.BytesIO(contents.kernels)) as archive:
        names = archive.namelist()
    assert set(cold["kernels_loaded"]) <= set(names)
    headers = [n for n in names if n.startswith("precompiled_headers/")]
    precompiled = {h.removesuffix(".gch") for h in cold["headers_built"]}
    assert precompiled and sorted(headers) == sorted(  # the headers this run precompiled
        f"precompiled_headers/{h}{suffix}" for h in precompiled for suffix in ("", ".gch"))
    probes = [n for n in names if n not in cold["kernels_loaded"] and n not in headers]
    assert probes and all(n.endswith((".so", ".so.load_ok")) for n in probes)  # ISA probes
    assert not [p for p in cache.parent.iterdir() if p.name != cache.name]  # no temp file left
    copy_ = tmp_path / "compile-cache.bin"
    copy_.write_bytes(cache.read_bytes())
    warm = run_cache_worker(tmp_path, copy_, "warm")
    assert warm["inductor"].get("fxgraph_cache_miss", 0) == 0, warm
    assert warm["inductor"]["fxgraph_cache_hit"] == cold["inductor"]["fxgraph_cache_miss"]
    assert warm["aot_autograd"].get("autograd_cache_hit", 0) >= 1 and warm["warnings"] == []
    assert warm["kernels_built"] == 0  # kernels and ISA probes from the file: no C++ compile
    assert warm["headers_built"] == []  # nor the precompiled header
    assert sorted(warm["kernels_loaded"]) == sorted(cold["kernels_loaded"])
    assert copy_.read_bytes() == cache.read_bytes()  # nothing new compiled: not rewritten


def test_cache_of_another_torch_version_is_not_loaded_and_is_replaced(tmp_path, monkeypatch):
    """A file written by another torch: nothing of it is loaded (torch compiles from
    scratch), the note is given once, and the first update's save replaces it with this
    run's code (the compile itself is the cold run's, in the test above)."""
    from accelfn.parts import compile_cache

    device = torch.device("cpu")
    forged = tmp_path / "compile-cache.bin"
    write_cache(forged, {**compile_cache._fingerprint(device), "torch": "1.0.0"},
                CacheFile(b"old artifacts", b""))
    loaded = []
    monkeypatch.setattr(torch.compiler, "load_cache_artifacts", lambda data: loaded.append(data))
    model = Net()
    state = af.TrainState(model, torch.optim.SGD(model.parameters(), lr=0.1))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        compile_cache.load(forged, device, state)
        compile_cache.load(forged, device, state)  # a second step's preparation: no new note
    notes = [str(w.message) for w in caught if "compile cache" in str(w.message)]
    assert loaded == [] and len(notes) == 1
    assert "torch '1.0.0'" in notes[0] and "compiling from scratch" in notes[0]
    # after the first update: this run's artifacts written over it, for this torch
    monkeypatch.setattr(torch.compiler, "save_cache_artifacts", lambda: (b"new artifacts", None))
    compile_cache.save(forged, device, state)
    again, problem = read_cache(forged, {"torch": str(torch.__version__)})
    assert problem is None and again is not None and again.artifacts == b"new artifacts"


def test_cache_file_format_refuses_damage_and_other_devices(tmp_path):
    path = tmp_path / "c.bin"
    here = {"torch": str(torch.__version__), "device": "cpu x86_64"}
    assert read_cache(path, here) == (None, None)  # no file: nothing to say
    write_cache(path, here, CacheFile(b"artifacts", b"kernels"))
    assert read_cache(path, here) == (CacheFile(b"artifacts", b"kernels"), None)
    assert "device 'cpu x86_64' (this run: 'cuda NVIDIA H200 sm_90')" in read_cache(
        path, {**here, "device": "cuda NVIDIA H200 sm_90"})[1]
    path.write_bytes(path.read_bytes()[:-2])
    assert read_cache(path, here) == (None, "is truncated or damaged")
    path.write_bytes(b"something else")
    assert read_cache(path, here)[1] == "is not an accelfn compile cache"
    write_cache(path, here, CacheFile(b"artifacts", b""))
    for key, value in ((b'"kernel_bytes": 0', b'"kernel_bytes": "0"'),
                       (b'"bytes": 9', b'"bytes": null')):  # valid JSON of the wrong type
        damaged = path.read_bytes().replace(key, value)
        (tmp_path / "d.bin").write_bytes(damaged)
        assert read_cache(tmp_path / "d.bin", here) == (None, "is truncated or damaged")
    assert read_cache(tmp_path, here)[1].startswith("could not be read")
    model = Net()
    state = af.TrainState(model, torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(ValueError, match="names a directory"):
        af.compiled(cache=tmp_path)(classify).prepare(state)


def test_kernels_are_restored_where_inductor_looks_and_nothing_else_is(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as archive:
        archive.writestr("ab/cabkey.main.so", b"new kernel")
        archive.writestr("cd/ccdkey.main.so", b"from the file")
    existing = tmp_path / "inductor" / "cd" / "ccdkey.main.so"
    existing.parent.mkdir(parents=True)
    existing.write_bytes(b"already here")
    assert unpack_kernels(buffer.getvalue()) == ["ab/cabkey.main.so"]
    restored = tmp_path / "inductor" / "ab" / "cabkey.main.so"
    assert restored.read_bytes() == b"new kernel" and os.access(restored, os.X_OK)
    assert existing.read_bytes() == b"already here"  # left alone
    from torch._inductor import codecache

    monkeypatch.setattr(codecache, "_HEADER_DIR", str(tmp_path / "headers"))
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as archive:
        archive.writestr("precompiled_headers/chash.h", b"#include <x.h>")
        archive.writestr("precompiled_headers/chash.h.gch", b"precompiled")
    assert unpack_kernels(buffer.getvalue()) == ["precompiled_headers/chash.h",
                                                 "precompiled_headers/chash.h.gch"]
    assert (tmp_path / "headers" / "chash.h.gch").read_bytes() == b"precompiled"
    for bad in ("../escape.so", "ab/cabkey.py", "/abs/ckey.so", "ab/sub/ckey.so",
                "precompiled_headers/../x.h", "precompiled_headers/chash.hpp",
                "precompiled_headers/sub/chash.h"):
        buffer = io.BytesIO()
        with zipfile.ZipFile(buffer, "w") as archive:
            archive.writestr("ef/cefkey.main.so", b"x")
            archive.writestr(bad, b"x")
        with pytest.raises(ValueError, match="not compiled kernels"):
            unpack_kernels(buffer.getvalue())
        assert not (tmp_path / "inductor" / "ef").exists()  # refused before writing anything
    assert unpack_kernels(b"") == []


if __name__ == "__main__":
    if sys.argv[1] == "cache":
        cache_main(sys.argv[2], sys.argv[3])
    elif sys.argv[1] == "distributed":
        distributed_main(sys.argv[2])
    else:
        raise SystemExit(f"unknown worker {sys.argv[1]!r}")
