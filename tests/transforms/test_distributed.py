"""distributed: 2 processes (gloo, CPU) under torchrun against the single-process reference."""

from __future__ import annotations

import copy
import os
import subprocess
import sys

import pytest
import torch
from dist_worker import CASES, STEPS, global_batch
from helpers import Net, classify, free_port, make_batch, token_loss, torchrun
from reference import reference_update
from timm_agc import adaptive_clip_grad

import accelfn as af

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # tests/: dist_worker.py


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("dist")
    torchrun(os.path.join(HERE, "dist_worker.py"), out, timeout=600)
    return [torch.load(out / f"rank{r}.pt", weights_only=True) for r in range(2)]


@pytest.fixture(scope="module")
def two_node_results(tmp_path_factory):
    """Two torchrun invocations, one per "node", meeting over 127.0.0.1 (--nnodes=2)."""
    out = tmp_path_factory.mktemp("nodes")
    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "ACCELFN_CASES": "ddp_acc3,fsdp_acc2_clip"}
    procs = [subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", f"--node_rank={rank}",
         "--nproc_per_node=1", "--master_addr=127.0.0.1", f"--master_port={port}",
         os.path.join(HERE, "dist_worker.py"), str(out)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
        for rank in range(2)]
    logs = [p.communicate(timeout=600)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), "\n".join(log[-3000:] for log in logs)
    return [torch.load(out / f"rank{r}.pt", weights_only=True) for r in range(2)]


def _agc_but_the_head(model) -> None:
    """timm's adaptive_clip_grad (its source, in tests/transforms/test_adaptive_clipping.py)
    over every parameter but the head's."""
    adaptive_clip_grad([p for n, p in model.named_parameters() if not n.startswith("head.")],
                       0.01)


def single_process(case: str) -> dict:
    """The same training on the concatenated global batch, one process, hand-written."""
    torch.manual_seed(0)
    model = Net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    fn = token_loss if case == "ddp_tokens" else classify
    for i in range(STEPS):
        batch = global_batch(i)
        reference_update(model, optimizer, batch, fn,
                         amp_dtype=torch.bfloat16 if "amp" in case else None,
                         max_norm=0.05 if "clip" in case else None,
                         edit_grads=_agc_but_the_head if "agc" in case else None)
    return dict(model.named_parameters())


pytestmark = pytest.mark.distributed


@pytest.mark.parametrize("case", list(CASES))
def test_update_equals_single_process_on_all_ranks_batches(results, case):
    expected = single_process(case)
    tol = {"ddp_clip_amp": 2e-2, "ddp_trunk_clip_amp": 2e-2, "ddp_bf16_hook": 1e-2,
           "ddp_compiled_ckpt": 1e-4, "fsdp_compiled_ckpt": 1e-4}.get(case, 1e-5)
    for rank in range(2):
        got = results[rank][case]["params"]
        for name, value in expected.items():
            torch.testing.assert_close(got[name], value.detach(), atol=tol, rtol=tol,
                                       msg=f"{case} rank {rank} {name}")
    if not case.startswith("fsdp"):
        for name in expected:  # DDP replicas stay bitwise identical
            assert torch.equal(results[0][case]["params"][name],
                               results[1][case]["params"][name])


def test_one_all_reduce_per_bucket_per_update_none_on_other_micro_batches(results):
    # the tiny model fits one bucket: exactly one all-reduce per update, whatever the
    # number of micro-batches (3), on both ranks
    for case in ("ddp_acc3", "ddp_method_acc3"):  # through forward, and through a method
        assert results[0][case]["counts"] == [1] * STEPS
        assert results[1][case]["counts"] == [1] * STEPS


@pytest.mark.parametrize("case", [c for c in CASES if "trunk" in c or "method" in c])
def test_the_function_receives_the_users_model_under_ddp_and_fsdp(results, case):
    # its class, its submodules and methods: the step computes the loss outside forward
    for rank in range(2):
        assert results[rank][case]["received"] == ["the TrunkNet trained"], \
            results[rank][case]["received"]


def test_single_process_distributed_is_a_no_op():
    torch.manual_seed(0)
    base = Net()
    m1, m2 = copy.deepcopy(base), copy.deepcopy(base)
    s1 = af.TrainState(m1, torch.optim.SGD(m1.parameters(), lr=0.1))
    step = af.distributed(af.with_accumulation(2)(classify))
    step(s1, make_batch())
    assert step.prepare(s1).model is m1 and step.prepare(s1).process_group is None
    ref = af.TrainState(m2, torch.optim.SGD(m2.parameters(), lr=0.1))
    af.with_accumulation(2)(classify)(ref, make_batch())
    for a, b in zip(m1.parameters(), m2.parameters()):
        assert torch.equal(a, b)
    assert af.world_size() == 1 and af.is_main_process()


def test_scale_lr_is_linear_in_global_batch():
    assert af.scale_lr(0.1, batch_size=512, base_batch_size=256) == pytest.approx(0.2)
    with pytest.raises(ValueError):
        af.scale_lr(0.1, batch_size=0)


def test_world_size_without_launcher_is_an_error(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    with pytest.raises(RuntimeError, match="torchrun"):
        af.init_distributed()


@pytest.mark.parametrize("case", ["ddp_acc3", "fsdp_acc2_clip"])
def test_two_nodes_on_one_machine_equal_single_process(two_node_results, case):
    expected = single_process(case)
    for rank in range(2):
        got = two_node_results[rank][case]["params"]
        for name, value in expected.items():
            torch.testing.assert_close(got[name], value.detach(), atol=1e-5, rtol=1e-5,
                                       msg=f"{case} node {rank} {name}")


def test_metrics_are_reduced_across_ranks_when_read(results):
    local = [results[r]["ddp"]["loss"] for r in range(2)]
    for rank in range(2):
        reduced = results[rank]["ddp"]["reduced"]
        torch.testing.assert_close(reduced["loss"], (local[0] + local[1]) / 2)
    assert not torch.equal(local[0], local[1])  # the ranks saw different data


def test_reduce_metrics_in_one_process():
    td = af.reduce_metrics({"loss": torch.tensor(2.0), "acc": torch.tensor(0.5)})
    assert float(td["loss"]) == 2.0 and float(td["acc"]) == 0.5
    with pytest.raises(ValueError, match="op"):
        af.reduce_metrics({"loss": torch.tensor(1.0)}, op="avg")
