"""A timm scheduler in a TrainState: told the count of applied updates after each update
(``step_update(num_updates=...)``) and the epoch after each epoch (``step(epoch)``), as timm's
``train_one_epoch`` loop does; it used to be stepped as a torch scheduler and fail after the
update was applied."""

from __future__ import annotations

import copy
import math
import warnings

import torch
from helpers import Net, as_dict, assert_params_equal, classify, make_batch

import accelfn as af
import accelfn.data as ad


class TimmScheduler:
    """timm.scheduler.scheduler.Scheduler (timm 1.0), the parts a training loop uses."""

    def __init__(self, optimizer, param_group_field="lr", t_in_epochs=True):
        self.optimizer = optimizer
        self.param_group_field = param_group_field
        self._initial_param_group_field = f"initial_{param_group_field}"
        for group in optimizer.param_groups:
            group.setdefault(self._initial_param_group_field, group[param_group_field])
        self.base_values = [g[self._initial_param_group_field] for g in optimizer.param_groups]
        self.metric = None
        self.t_in_epochs = t_in_epochs

    def state_dict(self):
        return {key: value for key, value in self.__dict__.items() if key != "optimizer"}

    def load_state_dict(self, state_dict):
        self.__dict__.update(state_dict)

    def _get_values(self, t, on_epoch=True):
        proceed = (on_epoch and self.t_in_epochs) or (not on_epoch and not self.t_in_epochs)
        return self._get_lr(t) if proceed else None

    def step(self, epoch, metric=None):
        self.metric = metric
        values = self._get_values(epoch, on_epoch=True)
        if values is not None:
            self.update_groups(values)

    def step_update(self, num_updates, metric=None):
        self.metric = metric
        values = self._get_values(num_updates, on_epoch=False)
        if values is not None:
            self.update_groups(values)

    def update_groups(self, values):
        if not isinstance(values, (list, tuple)):
            values = [values] * len(self.optimizer.param_groups)
        for group, value in zip(self.optimizer.param_groups, values):
            group[self.param_group_field] = value


class TimmCosine(TimmScheduler):
    """timm's CosineLRScheduler with linear warmup, one cycle (its maths)."""

    def __init__(self, optimizer, t_initial, lr_min=0.0, warmup_t=0, warmup_lr_init=0.0,
                 t_in_epochs=True):
        super().__init__(optimizer, "lr", t_in_epochs=t_in_epochs)
        self.t_initial, self.lr_min = t_initial, lr_min
        self.warmup_t, self.warmup_lr_init = warmup_t, warmup_lr_init
        if warmup_t:
            self.warmup_steps = [(v - warmup_lr_init) / warmup_t for v in self.base_values]
            super().update_groups(warmup_lr_init)
        else:
            self.warmup_steps = [1 for _ in self.base_values]

    def _get_lr(self, t):
        if t < self.warmup_t:
            return [self.warmup_lr_init + t * s for s in self.warmup_steps]
        if t >= self.t_initial:
            return [self.lr_min for _ in self.base_values]
        return [self.lr_min + 0.5 * (lr_max - self.lr_min)
                * (1 + math.cos(math.pi * t / self.t_initial)) for lr_max in self.base_values]


def _setup(t_in_epochs):
    torch.manual_seed(0)
    model = Net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    scheduler = TimmCosine(optimizer, t_initial=12 if not t_in_epochs else 4, lr_min=1e-3,
                           warmup_t=3 if not t_in_epochs else 1, warmup_lr_init=1e-2,
                           t_in_epochs=t_in_epochs)
    return model, optimizer, scheduler


EPOCHS, PER_EPOCH = 4, 3


def _timm_loop(t_in_epochs):
    """timm's train_one_epoch and main loop, by hand."""
    model, optimizer, scheduler = _setup(t_in_epochs)
    lrs = []
    num_updates = 0
    for epoch in range(EPOCHS):
        for i in range(PER_EPOCH):
            batch = as_dict(make_batch(seed=epoch * PER_EPOCH + i))
            lrs.append(optimizer.param_groups[0]["lr"])
            classify(model, batch)["loss"].backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            num_updates += 1
            scheduler.step_update(num_updates=num_updates)
        scheduler.step(epoch + 1)
    return model, lrs


def _accelfn_loop(t_in_epochs, resume_at=None):
    model, optimizer, scheduler = _setup(t_in_epochs)
    state = af.TrainState(model, optimizer, scheduler=scheduler)
    step = af.lift(classify)
    lrs = []
    for epoch in range(EPOCHS):
        if epoch == resume_at:  # a checkpoint between epochs, loaded into a new state
            saved = copy.deepcopy(state.state_dict())
            model, optimizer, scheduler = _setup(t_in_epochs)
            state = af.TrainState(model, optimizer, scheduler=scheduler)
            state.load_state_dict(saved)
        for i in range(PER_EPOCH):
            lrs.append(float(step(state, make_batch(seed=epoch * PER_EPOCH + i))["lr"]))
        state.end_epoch()
    return model, lrs


def test_a_timm_scheduler_per_update_is_told_the_update_count():
    ref, ref_lrs = _timm_loop(t_in_epochs=False)
    for resume_at in (None, 2):
        model, lrs = _accelfn_loop(t_in_epochs=False, resume_at=resume_at)
        assert lrs == [torch.tensor(x, dtype=torch.float32).item() for x in ref_lrs]
        assert_params_equal(model, ref)
    assert len(set(ref_lrs)) > 6  # the schedule moved every update


def test_a_timm_scheduler_per_epoch_is_told_the_epoch():
    ref, ref_lrs = _timm_loop(t_in_epochs=True)
    model, lrs = _accelfn_loop(t_in_epochs=True, resume_at=2)
    assert lrs == [torch.tensor(x, dtype=torch.float32).item() for x in ref_lrs]
    assert_params_equal(model, ref)
    assert len(set(ref_lrs)) == EPOCHS  # one rate per epoch


def _epochs_of(state, loader, epochs, *, end_epoch, evaluate=None):
    """``epochs`` passes over ``loader`` with one update per batch (``end_epoch``: calling
    ``state.end_epoch()`` after each), iterating ``evaluate`` (a second loader) in the middle
    of each pass, as an evaluation every N steps does; the warnings raised."""
    step = af.lift(classify)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(epochs):
            for i, batch in enumerate(loader):
                step(state, batch)
                if evaluate is not None and i == 0:
                    for held_out in evaluate:
                        step.evaluate(state, held_out)
            if end_epoch:
                state.end_epoch()
    return [w for w in caught if "end_epoch" in str(w.message)]


def _timm_state(t_in_epochs=True, **kwargs):
    model, optimizer, scheduler = _setup(t_in_epochs)
    return af.TrainState(model, optimizer, scheduler=scheduler, **kwargs)


def test_an_epoch_of_the_loader_without_end_epoch_warns_once_for_a_per_epoch_scheduler():
    """A timm scheduler counting epochs stays at its first rate unless the loop calls
    ``state.end_epoch()``: the first update in a later epoch of the loader warns, once."""
    loader = ad.loader(make_batch(12), batch_size=4, seed=0)
    state = _timm_state()
    caught = _epochs_of(state, loader, 3, end_epoch=False)
    assert len(caught) == 1 and "state.end_epoch()" in str(caught[0].message)
    assert state.step == 9  # warned, not refused


def test_no_warning_where_the_epochs_are_ended_or_not_counted():
    data = make_batch(12)
    evaluate = ad.loader(make_batch(8, seed=1), batch_size=4, shuffle=False)
    plain = Net()
    for state, end_epoch in [(_timm_state(), True),  # ended, with an evaluation every pass
                             (_timm_state(t_in_epochs=False), False),  # told the updates
                             (af.TrainState(plain, torch.optim.SGD(plain.parameters(), lr=0.1)),
                              False)]:  # no scheduler
        loader = ad.loader(data, batch_size=4, seed=0)
        assert _epochs_of(state, loader, 3, end_epoch=end_epoch, evaluate=evaluate) == []


def test_a_per_epoch_torch_scheduler_without_end_epoch_warns_too():
    model = Net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    state = af.TrainState(model, optimizer, scheduler=scheduler, scheduler_every="epoch")
    loader = ad.loader(make_batch(12), batch_size=4, seed=0)
    assert len(_epochs_of(state, loader, 2, end_epoch=False)) == 1
