"""Stragglers: the monitor flags a rank at least 20% slower than the median, naming it.

One launch of 2 gloo processes under torchrun, a DDP step monitored with ``log_every=50``:
first 50 updates where both ranks do the same work (nothing flagged), then 50 where rank 1's
step function sleeps (a slow forward: under DDP both ranks' iteration times are equal, rank
0 waits for rank 1 in the gradient all-reduce; the Flight Recorder's arrival times tell them
apart). The flag must come by update 50 of that run, as a warning on rank 0 and a finding in
every rank's report, naming rank 1 and its ratio. The decision itself is checked on numbers.

The module is also the torchrun worker: ``python -m torch.distributed.run --nproc_per_node=2
test_stragglers.py OUT`` saves what each rank saw in ``OUT/rank<r>.pt``.
"""

from __future__ import annotations

import os
import sys
import time
import warnings

import pytest
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
TESTS = os.path.dirname(os.path.dirname(HERE))
if TESTS not in sys.path:  # under torchrun: helpers sit in tests/
    sys.path.insert(0, TESTS)

from helpers import save_rank_results, torchrun_results  # noqa: E402

from accelfn.observe.monitor.stragglers import Stragglers, judge  # noqa: E402

UPDATES = 50
SLOW_S = 0.03  # rank 1's extra time per step, several times the step itself


def worker(out_dir: str) -> None:
    import torch.distributed as dist
    from tensordict import TensorDict
    from torch import nn

    import accelfn as af

    af.init_distributed()
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    state = af.TrainState(model, torch.optim.SGD(model.parameters(), lr=0.01))
    slow = {"on": False}

    def squared(model, batch):
        if slow["on"] and rank == 1:
            time.sleep(SLOW_S)
        return model(batch["x"]).pow(2).mean()

    step = af.distributed(squared)
    batch = TensorDict(x=torch.randn(4, 4), batch_size=[4])
    results = {}
    for run in ("even", "slow"):
        slow["on"] = run == "slow"
        flagged_at = None
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with af.Monitor(log_every=50, warmup=2, progress=False,
                            sync_check=None) as monitor:
                for update in range(1, UPDATES + 1):
                    monitor.step(step(state, batch))
                    if flagged_at is None and any("straggler" in str(w.message)
                                                  for w in caught):
                        flagged_at = update
        results[run] = {
            "flagged_at": flagged_at,
            "warnings": [str(w.message) for w in caught if "straggler" in str(w.message)],
            "findings": [(f.severity, f.message) for f in monitor.report().findings
                         if f.check == "stragglers"]}
    save_rank_results(out_dir, results)


@pytest.mark.distributed
@pytest.mark.slow
def test_a_sleeping_rank_is_flagged_by_update_50_naming_it_and_an_even_run_is_not(tmp_path):
    ranks = torchrun_results(__file__, tmp_path, timeout=300)
    for rank, got in enumerate(ranks):
        even, slow = got["even"], got["slow"]
        assert even["warnings"] == [] and [s for s, _ in even["findings"]] == ["ok"], even
        assert [s for s, _ in slow["findings"]] == ["warning"], slow
        message = slow["findings"][0][1]
        assert message.startswith("rank 1 is a straggler: its step takes "), message
        ratio = float(message.split("takes ")[1].split("x")[0])
        assert ratio >= 1.2, message
        # rank 0 says it when it sees it (the main process's output); rank 1 only reports
        assert slow["flagged_at"] == (UPDATES if rank == 0 else None), slow
        assert len(slow["warnings"]) == (1 if rank == 0 else 0), slow


def test_judge_flags_ranks_20_percent_above_the_median_only():
    assert judge([1.0, 1.0, 1.0, 1.25]) == {3: 1.25}
    assert judge([1.0, 1.0, 1.0, 1.15]) == {}
    assert judge([1.0, 1.5, 2.0]) == {2: 2.0 / 1.5}  # the median is the middle rank's
    assert judge([1.0]) == {} and judge([0.0, 0.0]) == {}
    assert judge([1.0, 1.0, 1.12], slower=0.1) == {2: pytest.approx(1.12)}


def test_the_check_is_off_in_one_process_and_refuses_a_bad_threshold():
    check = Stragglers()
    check.add([{"step": 1, "iter_s": 0.1}])
    check.check()  # no process group: nothing gathered, nothing found
    assert check.findings() == []
    with pytest.raises(ValueError, match="slower=0"):
        Stragglers(slower=0)


if __name__ == "__main__":
    worker(sys.argv[1])
