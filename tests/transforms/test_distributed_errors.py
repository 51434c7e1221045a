"""distributed: torch.distributed's common failures said in accelfn's terms (2 gloo processes).

Each case is reproduced for real: a model with a parameter the loss never uses (DDP's error at
the next forward), processes that built models of different shapes (DDP's shape check), and a
process that does not arrive within a short process-group ``timeout=`` (at the first step, and
at a later one), two launches in all. The error raised is an ``accelfn`` ``DistributedError``
naming the fix, with torch's own error as its ``__cause__``; an error it does not know passes
through unchanged.

The module is also the torchrun worker: ``python -m torch.distributed.run --nproc_per_node=2
test_distributed_errors.py CASE OUT`` saves what each rank caught in ``OUT/rank<r>.pt``.
"""

from __future__ import annotations

import os
import sys
import time

import pytest
import torch
from torch import nn

HERE = os.path.dirname(os.path.abspath(__file__))
TESTS = os.path.dirname(HERE)
if TESTS not in sys.path:  # under torchrun: conftest sits in tests/
    sys.path.insert(0, TESTS)

from helpers import torchrun  # noqa: E402

from accelfn.parts.distributed.errors import translate  # noqa: E402
from accelfn.transforms.distributed import DistributedError  # noqa: E402

CASES = ["unused", "shapes"]  # one launch each; a failure breaks the process group
TIMEOUT_S = 2.0
LATE_S = 5.0  # the late process arrives after the others' timeout


class TwoHeads(nn.Module):
    """Two heads, only the first used by the loss."""

    def __init__(self) -> None:
        super().__init__()
        self.used = nn.Linear(4, 1)
        self.idle = nn.Linear(4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.used(x)


def squared(model, batch):
    return model(batch["x"]).pow(2).mean()


def rank_rows(rank: int, update: int) -> torch.Tensor:
    return torch.randn(4, 4, generator=torch.Generator().manual_seed(10 * update + rank))


def _caught(error: BaseException) -> dict:
    cause = error.__cause__
    return {"type": type(error).__name__, "kind": getattr(error, "kind", None),
            "message": str(error), "runtime": isinstance(error, RuntimeError),
            "cause_type": None if cause is None else type(cause).__name__,
            "cause": "" if cause is None else str(cause)}


def _steps(model: nn.Module, updates: int, **options) -> tuple[dict | None, nn.Module]:
    """``updates`` steps of ``af.distributed(**options)``; what they raised, if anything."""
    import torch.distributed as dist
    from tensordict import TensorDict

    import accelfn as af

    state = af.TrainState(model, torch.optim.SGD(model.parameters(), lr=0.1))
    step = af.distributed(**options)(squared)
    try:
        for update in range(updates):
            x = rank_rows(dist.get_rank(), update)
            step(state, TensorDict(x=x, batch_size=[len(x)]))
    except Exception as error:  # what the step raised is the result
        return _caught(error), model
    return None, model


def worker(case: str, out_dir: str) -> None:
    from datetime import timedelta

    import torch.distributed as dist

    dist.init_process_group("gloo", timeout=timedelta(seconds=TIMEOUT_S))
    rank = dist.get_rank()
    torch.manual_seed(0)
    result: dict = {}
    if case == "unused":
        result["caught"], _ = _steps(TwoHeads(), 2)
        torch.manual_seed(0)
        result["fixed"], model = _steps(TwoHeads(), 3, find_unused_parameters=True)
        result["params"] = {k: v.detach().clone() for k, v in model.named_parameters()}
        # then process 1 stops after one update: process 0's next one waits in vain
        result["later"], _ = _steps(nn.Linear(4, 1), 1 if rank else 3)
        if rank:
            time.sleep(LATE_S)
    else:  # process 1 builds another shape; process 0 waits for it in vain
        result["caught"], _ = _steps(nn.Linear(4 + rank, 1), 1)
        if rank:
            time.sleep(LATE_S)  # stays until process 0 timed out
    torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
    sys.stdout.flush()
    os._exit(0)  # the process group is broken after a failure: no orderly teardown


def _run(case: str, out) -> list[dict]:
    torchrun(__file__, case, out, timeout=120)
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(2)]


@pytest.fixture(scope="module")
def caught(tmp_path_factory):
    results = {}
    for case in CASES:
        out = tmp_path_factory.mktemp(case)
        results[case] = _run(case, out)
    return results


def _assert_translated(got: dict, kind: str, cause: str) -> None:
    assert got is not None, "the step raised nothing"
    assert (got["type"], got["kind"], got["runtime"]) == ("DistributedError", kind, True)
    assert got["cause_type"] == "RuntimeError" and cause in got["cause"]


pytestmark = pytest.mark.distributed


def test_unused_parameters_name_the_accelfn_option_and_the_parameters(caught):
    for rank in range(2):
        got = caught["unused"][rank]["caught"]
        _assert_translated(got, "unused_parameters", "find_unused_parameters=True")
        assert "af.distributed(find_unused_parameters=True)" in got["message"]
        assert "(idle.weight, idle.bias)" in got["message"]  # by name, not DDP's indices
        assert "torch.nn.parallel" not in got["message"]


def test_the_option_it_names_fixes_the_run(caught):
    """With find_unused_parameters=True the run trains as one process on both ranks' rows."""
    torch.manual_seed(0)
    model = TwoHeads()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for update in range(3):
        x = torch.cat([rank_rows(rank, update) for rank in range(2)])
        optimizer.zero_grad(set_to_none=True)
        model(x).pow(2).mean().backward()
        optimizer.step()
    for rank in range(2):
        assert caught["unused"][rank]["fixed"] is None
        for name, value in model.named_parameters():
            torch.testing.assert_close(caught["unused"][rank]["params"][name], value.detach(),
                                       atol=1e-6, rtol=1e-5)


def test_models_of_different_shapes_say_every_process_must_build_the_same_model(caught):
    got = caught["shapes"][1]["caught"]  # the process whose shapes DDP found different
    _assert_translated(got, "shape_mismatch", "appears not to match sizes")
    assert "every process must build the same model" in got["message"]
    assert "while the first step wrapped the model" in got["message"]



@pytest.mark.parametrize(("case", "where"), [
    ("shapes", "while the first step wrapped the model"),
    ("unused", "in a micro-batch's forward"),
])
def test_a_process_that_does_not_arrive_is_a_timeout_saying_where_and_what_to_check(
        caught, case, where):
    got = caught[case][0]["caught" if case == "shapes" else "later"]
    _assert_translated(got, "timeout", "Timed out waiting")
    assert f"a collective waited {TIMEOUT_S:g} s for another process {where}" in got["message"]
    assert "an error in the other processes' output" in got["message"]
    assert "timeout= to torch.distributed.init_process_group" in got["message"]


def test_unknown_errors_pass_through_and_known_ones_are_not_translated_twice():
    assert translate(RuntimeError("CUDA out of memory")) is None
    assert translate(ValueError("Timed out waiting 5ms")) is None  # not torch's kind
    done = translate(RuntimeError("Timed out waiting 3000ms for recv operation to complete"))
    assert isinstance(done, DistributedError) and done.kind == "timeout"
    assert "waited 3 s" in str(done)
    assert translate(done) is None
    lost = translate(RuntimeError("[pair.cc:534] Connection closed by peer [127.0.0.1]:4"),
                     where=" in a micro-batch's forward")
    assert isinstance(lost, DistributedError) and lost.kind == "process_lost"
    assert "another process left the run in a micro-batch's forward" in str(lost)



def test_a_tensor_parallel_weight_read_outside_its_module_names_the_fix():
    # torch's text (torch/distributed/tensor/_dispatch.py), as the forward raises it
    text = ("aten.mm.default: got mixed torch.Tensor and DTensor, need to convert all "
            "torch.Tensor to DTensor before calling distributed operators!")
    got = translate(RuntimeError(text), where=" in a micro-batch's forward")
    assert isinstance(got, DistributedError) and got.kind == "mixed_dtensor"
    for words in ("aten.mm.default", "tensor-parallel layer's parameter directly",
                  "model.head(h)", "leave that layer out of the tensor-parallel plan",
                  "in a micro-batch's forward"):
        assert words in str(got), str(got)


if __name__ == "__main__":
    worker(sys.argv[1], sys.argv[2])


def test_a_failure_in_a_micro_batchs_backward_is_explained_too():
    """DDP's gradient all-reduce runs inside the backward: the engine hands its error to the
    strategy (``sharding.explain``), which names where it happened."""
    import functools
    from types import SimpleNamespace

    import accelfn as af
    from accelfn.parts import sharding

    explain = functools.partial(sharding.explain, af.distributed()(squared).spec.sharding)
    ctx = SimpleNamespace(distributed=object(), model=nn.Linear(2, 2))
    got = explain(ctx, RuntimeError("Timed out waiting 3000ms for recv operation to complete"))
    assert isinstance(got, af.DistributedError) and got.kind == "timeout"
    assert "backward" in str(got)
    assert explain(ctx, ValueError("not torch.distributed's")) is None
    assert explain(SimpleNamespace(distributed=None, model=None), RuntimeError("x")) is None
