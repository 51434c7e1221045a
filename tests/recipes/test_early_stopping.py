"""EarlyStopping: the seeds' decisions, best weights restored, checkpointable."""

from __future__ import annotations

import io

import pytest
import torch
from helpers import Net, classify, make_batch
from torch import nn

import accelfn as af
from accelfn.recipes.early_stopping import EarlyStopping
from accelfn.transforms.ema import ema_weights, with_ema


class SeedEarlyStopping:
    """The seeds' class, decisions only (it keeps references, not copies, of the weights)."""

    def __init__(self, patience=7, min_delta=0):
        self.patience, self.min_delta = patience, min_delta
        self.best_loss, self.counter, self.early_stop = None, 0, False

    def __call__(self, val_loss):
        if self.best_loss is None:
            self.best_loss = val_loss
        elif val_loss < self.best_loss - self.min_delta:
            self.best_loss = val_loss
            self.counter = 0
        else:
            self.counter += 1
            if self.counter >= self.patience:
                self.early_stop = True


@pytest.mark.parametrize("losses,patience,min_delta", [
    ([1.0, 0.9, 0.95, 0.91, 0.8, 0.85, 0.86, 0.87, 0.7], 3, 0.0),
    ([1.0, 0.99, 0.985, 0.98, 0.9, 0.95], 2, 0.05),
    ([3.0, 2.0, 1.0, 0.5], 1, 0.0),
])
def test_decisions_equal_the_seeds_class(losses, patience, min_delta):
    seed = SeedEarlyStopping(patience, min_delta)
    es = EarlyStopping(patience, min_delta=min_delta, restore_best=False)
    for loss in losses:
        seed(loss)
        stop = es.update(loss)
        assert stop == seed.early_stop
        assert es.best == seed.best_loss and es.counter == seed.counter
        if stop:
            break


def train_and_watch(model, metrics, es, state=None):
    """Train between evaluations; return the model's weights at each evaluation."""
    state = state or af.TrainState(model, torch.optim.SGD(model.parameters(), lr=0.5))
    step = af.lift(classify)
    seen = []
    for i, metric in enumerate(metrics):
        step(state, make_batch(seed=i))
        seen.append({k: v.clone() for k, v in model.state_dict().items()})
        if es.update(metric, state):
            return seen, i
    return seen, None


def test_restores_the_best_weights_when_it_stops(net):
    es = EarlyStopping(patience=2)
    seen, stopped = train_and_watch(net, [1.0, 0.5, 0.7, 0.6, 0.1], es)
    assert stopped == 3 and es.should_stop and es.best == 0.5 and es.best_index == 1
    for k, v in net.state_dict().items():
        assert torch.equal(v, seen[1][k]), k
    assert not torch.equal(seen[3]["head.weight"], seen[1]["head.weight"])
    assert es.update(0.0, net) is True  # stays stopped, changes nothing
    assert es.best == 0.5


def test_batchnorm_buffers_come_back_too():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.Linear(8, 4))
    es = EarlyStopping(patience=1)
    seen, stopped = train_and_watch(model, [0.3, 0.2, 0.4], es)
    assert stopped == 2
    assert torch.equal(model[1].running_mean, seen[1]["1.running_mean"])
    assert model[1].num_batches_tracked.item() == 2


def test_max_mode_min_delta_and_nan():
    es = EarlyStopping(patience=2, mode="max", min_delta=0.01, restore_best=False)
    assert not es.update(torch.tensor(0.50))  # a 0-d tensor metric is fine
    assert not es.update(0.505)  # not better by more than min_delta
    assert es.counter == 1
    assert not es.update(0.52) and es.counter == 0 and es.best == 0.52
    assert not es.update(float("nan")) and es.counter == 1  # NaN never improves
    assert es.update(0.525)  # below 0.52 + 0.01: second bad evaluation, stop
    assert es.best == 0.52 and es.best_index == 2


def test_restore_best_false_leaves_the_model_and_restore_on_demand(net):
    es = EarlyStopping(patience=1, restore_best=False)
    seen, stopped = train_and_watch(net, [0.2, 0.3], es)
    assert stopped == 1
    assert torch.equal(net.head.weight, seen[1]["head.weight"])
    es.restore(net)
    assert torch.equal(net.head.weight, seen[0]["head.weight"])


def test_best_weights_are_copies_kept_on_the_cpu(net):
    es = EarlyStopping(patience=3)
    es.update(1.0, net)
    saved = es.best_weights["head.weight"]
    assert saved.device.type == "cpu" and saved.data_ptr() != net.head.weight.data_ptr()
    with torch.no_grad():
        net.head.weight.add_(1.0)
    assert not torch.equal(saved, net.head.weight)
    dev = EarlyStopping(patience=3, store="device")
    dev.update(1.0, net)
    assert dev.best_weights["head.weight"].data_ptr() != net.head.weight.data_ptr()


def test_checkpoint_round_trip_continues_the_same_way(net):
    es = EarlyStopping(patience=2)
    state = af.TrainState(net, torch.optim.SGD(net.parameters(), lr=0.5))
    seen, _ = train_and_watch(net, [1.0, 0.4, 0.6], es, state)
    buffer = io.BytesIO()
    torch.save(es.state_dict(), buffer)
    buffer.seek(0)
    resumed = EarlyStopping(patience=2)
    resumed.load_state_dict(torch.load(buffer, weights_only=True))
    assert (resumed.best, resumed.counter, resumed.calls) == (0.4, 1, 3)
    other = Net()
    assert resumed.update(0.7, other) is True  # second bad evaluation in a row
    for k, v in other.state_dict().items():
        assert torch.equal(v, seen[1][k]), k


def test_tracks_the_ema_weights_when_called_inside_ema_weights():
    torch.manual_seed(0)
    model = Net()
    state = af.TrainState(model, torch.optim.SGD(model.parameters(), lr=0.5))
    step = with_ema(decay=0.5)(classify)
    es = EarlyStopping(patience=1, restore_best=False)  # restore after the block
    ema_at = []
    for i, metric in enumerate([0.5, 0.9]):
        step(state, make_batch(seed=i))
        with ema_weights(state):
            ema_at.append(model.head.weight.detach().clone())
            stop = es.update(metric, state)
        if stop:
            es.restore(state)
    assert stop and not torch.equal(ema_at[0], ema_at[1])
    assert torch.equal(model.head.weight, ema_at[0])  # the best EMA weights


@pytest.mark.parametrize("kwargs,match", [
    ({"patience": 0}, "int >= 1"),
    ({"patience": 2, "mode": "lowest"}, "'min'"),
    ({"patience": 2, "min_delta": -0.1}, ">= 0"),
    ({"patience": 2, "store": "gpu"}, "'cpu' or 'device'"),
])
def test_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        EarlyStopping(**kwargs)


def test_update_needs_the_model_to_restore_it():
    es = EarlyStopping(patience=2)
    with pytest.raises(ValueError, match="restore_best=False"):
        es.update(1.0)
    with pytest.raises(TypeError, match=r"TrainState or an nn\.Module"):
        es.update(1.0, {"w": torch.zeros(1)})
    with pytest.raises(RuntimeError, match="no weights saved"):
        es.restore(Net())


@pytest.mark.parametrize("patience", [1, 2])
def test_stopping_before_any_finite_metric_leaves_the_model_as_it_is(patience):
    model = nn.Linear(2, 2)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    es = EarlyStopping(patience=patience)
    stops = [es.update(float("nan"), model) for _ in range(patience)]
    assert stops == [False] * (patience - 1) + [True]
    assert es.best is None and es.best_weights is None
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k])


def test_state_dict_and_load_state_dict_do_not_alias_the_best_weights():
    model = nn.Linear(2, 2)
    es = EarlyStopping(patience=3)
    es.update(1.0, model)
    saved = es.state_dict()
    kept = saved["best_weights"]["weight"].clone()
    with torch.no_grad():
        model.weight.add_(1.0)
    es.update(0.5, model)  # a new best: must not write into the checkpoint taken before
    assert torch.equal(saved["best_weights"]["weight"], kept)

    other = EarlyStopping(patience=3)
    other.load_state_dict(saved)
    with torch.no_grad():
        model.weight.add_(1.0)
    other.update(0.1, model)
    assert torch.equal(saved["best_weights"]["weight"], kept)
