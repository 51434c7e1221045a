"""Any optimizer's state resumes, whatever its shape: Adafactor's factored moments (``row_var``
of shape (n, 1)), scalar states, a stacked buffer; and an optimizer whose ``step()`` takes no
``closure`` saves and loads sharded (torch.distributed.checkpoint initialises an optimizer's
state by calling ``step(closure=None)``). The parameter-order check compares the parameter
names recorded at save, never a state tensor's shape with its parameter's.
"""

from __future__ import annotations

import json

import pytest
import torch
from checkpoint_helpers import (
    assert_unchanged,
    counter,
    dataset,
    noisy,
    run,
    scramble_rngs,
    snapshot,
)
from helpers import Net

import accelfn as af
from accelfn import checkpointing as ckpt
from accelfn import data

FORMATS = pytest.mark.parametrize("sharded", [False, True], ids=["plain", "dcp"])


class Stacked(torch.optim.Optimizer):
    """Momentum and a second moment kept in one stacked buffer of shape (2, *p.shape), a
    count (a Python int), a scale (a 0-d tensor) and a trace of shape (1,)."""

    def __init__(self, params, lr: float = 0.05) -> None:
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["count"] = 0
                    state["scale"] = torch.tensor(1.0)
                    state["trace"] = torch.zeros(1)
                    state["moments"] = torch.zeros((2, *p.shape))
                state["count"] += 1
                state["scale"].mul_(0.9).add_(0.1)
                state["trace"].add_(p.grad.norm())
                moments = state["moments"]
                moments[0].mul_(0.9).add_(p.grad)
                moments[1].mul_(0.99).addcmul_(p.grad, p.grad, value=0.01)
                p.add_(moments[0] / (moments[1].sqrt() + 1e-3) * state["scale"],
                       alpha=-group["lr"] / state["count"] ** 0.5)


class NoClosure(torch.optim.Optimizer):
    """An optimizer whose ``step()`` takes no argument at all (as some implementations)."""

    def __init__(self, params, lr: float = 0.05) -> None:
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self):  # no closure
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                buf = self.state[p].setdefault("momentum", torch.zeros_like(p))
                buf.mul_(0.9).add_(p.grad)
                p.add_(buf, alpha=-group["lr"])


class Stateless(torch.optim.Optimizer):
    """Plain gradient descent, no state, ``step()`` without a closure."""

    def __init__(self, params, lr: float = 0.05) -> None:
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.add_(p.grad, alpha=-group["lr"])


def build(kind: str, seed: int = 0, *, calls: bool = False):
    torch.manual_seed(seed)
    model = Net()
    params = list(model.parameters())
    if kind == "adafactor":
        optimizers = [torch.optim.Adafactor(params, lr=1e-2)]
    elif kind == "stacked":
        optimizers = [Stacked(params)]
    elif kind == "no_closure":
        optimizers = [NoClosure(params)]
    else:  # "no_closure_pair": a stateless one without a closure beside AdamW
        matrices = [p for p in params if p.dim() == 2]
        optimizers = [Stateless(matrices),
                      torch.optim.AdamW([p for p in params if p.dim() != 2], lr=1e-2)]
    scheds = [torch.optim.lr_scheduler.StepLR(o, 2, 0.5) for o in optimizers]
    state = af.TrainState(model, optimizers if len(optimizers) > 1 else optimizers[0],
                          scheduler=scheds if len(scheds) > 1 else scheds[0])
    loader = data.loader(dataset(), batch_size=4, seed=1)
    step = af.with_clipping(max_norm=1.0)(af.apply_transform(noisy, counter()))
    if calls:  # an update every 2 calls: between them, the gradients wait in the parameters
        step = af.with_accumulation(2, mode="calls")(step)
    step.prepare(state)
    return state, loader, step


def _resumes_exactly(tmp_path, kind: str, sharded: bool) -> af.TrainState:
    state, loader, step = build(kind)
    it = iter(loader)
    run(state, it, step, 3)
    ckpt.save(tmp_path, state, loader=loader, step=step, sharded=sharded)
    expected = run(state, it, step, 3)
    fresh, fresh_loader, fresh_step = build(kind, seed=1)
    scramble_rngs()
    ckpt.load(tmp_path, fresh, loader=fresh_loader, step=fresh_step)
    got = run(fresh, iter(fresh_loader), fresh_step, 3)
    assert all(torch.equal(a, b) for a, b in zip(expected, got))
    for a, b in zip(state.model.parameters(), fresh.model.parameters()):
        assert torch.equal(a, b)
    for a, b in zip(state.optimizers, fresh.optimizers):
        assert repr(a.state_dict()) == repr(b.state_dict())
    return fresh


@FORMATS
def test_adafactor_with_factored_moments_resumes_exactly(tmp_path, sharded):
    fresh = _resumes_exactly(tmp_path, "adafactor", sharded)
    shapes = {tuple(s["row_var"].shape) for s in fresh.optimizer.state.values()
              if "row_var" in s}
    assert (16, 1) in shapes  # factored: not the parameter's shape (16, 8)


@FORMATS
def test_scalar_states_and_a_stacked_buffer_resume_exactly(tmp_path, sharded):
    fresh = _resumes_exactly(tmp_path, "stacked", sharded)
    entry = next(iter(fresh.optimizer.state.values()))
    assert entry["count"] == 6 and entry["scale"].dim() == 0
    assert entry["trace"].shape == (1,) and entry["moments"].shape[0] == 2


@FORMATS
@pytest.mark.parametrize("kind", ["no_closure", "no_closure_pair"])
def test_an_optimizer_whose_step_takes_no_closure_saves_and_loads(tmp_path, sharded, kind):
    # sharded, NoClosure's state is in DCP's files (loading it made DCP call
    # step(closure=None) on the new optimizer before); the stateless one is in state.pt
    fresh = _resumes_exactly(tmp_path, kind, sharded)
    meta = json.loads((ckpt.latest(tmp_path) / "meta.json").read_text())
    assert meta["optimizer_sharded"] == sharded
    payload = torch.load(ckpt.latest(tmp_path) / "state.pt", weights_only=True)["state"]
    if kind == "no_closure_pair":
        assert isinstance(payload["optimizer"][0], dict) and not fresh.optimizers[0].state
        assert (payload["optimizer"][1] is None) == sharded
    else:
        assert (payload["optimizer"] is None) == sharded
    for optimizer in fresh.optimizers:  # its own step() is left as it was
        assert "closure" not in str(getattr(optimizer.step, "__wrapped__", optimizer.step))


def test_a_sharded_checkpoint_before_the_first_update_loads_no_optimizer_state(tmp_path):
    state, loader, step = build("no_closure")
    ckpt.save(tmp_path, state, loader=loader, step=step, sharded=True)  # no state yet
    fresh, fresh_loader, fresh_step = build("no_closure", seed=1)
    ckpt.load(tmp_path, fresh, loader=fresh_loader, step=fresh_step)
    assert not fresh.optimizer.state  # none was saved, none was made
    for a, b in zip(state.model.parameters(), fresh.model.parameters()):
        assert torch.equal(a, b)


@pytest.mark.parametrize("kind", ["stacked", "no_closure"])
def test_a_sharded_load_into_a_state_holding_gradients_restores_the_optimizer(tmp_path, kind):
    # DCP makes an optimizer's state before loading into it only when no parameter has a
    # gradient: with gradients (an accumulation window open in the new run) it loaded none
    state, loader, step = build(kind, calls=True)
    it = iter(loader)
    run(state, it, step, 4)  # 2 updates
    ckpt.save(tmp_path, state, loader=loader, step=step, sharded=True)
    expected = run(state, it, step, 4)
    fresh, fresh_loader, fresh_step = build(kind, seed=1, calls=True)
    run(fresh, iter(fresh_loader), fresh_step, 1)  # a window open: gradients, no update yet
    assert not fresh.optimizer.state and fresh.model.inp.weight.grad is not None
    ckpt.load(tmp_path, fresh, loader=fresh_loader, step=fresh_step)
    assert fresh.optimizer.state and fresh.model.inp.weight.grad is None
    got = run(fresh, iter(fresh_loader), fresh_step, 4)
    assert all(torch.equal(a, b) for a, b in zip(expected, got))
    assert repr(state.optimizer.state_dict()) == repr(fresh.optimizer.state_dict())


def test_parameters_in_another_order_are_refused_by_their_names(tmp_path):
    # Adafactor's states have other shapes than their parameters: the names decide
    state, loader, step = build("adafactor")
    run(state, iter(loader), step, 2)
    path = ckpt.save(tmp_path, state, loader=loader, step=step)
    torch.manual_seed(1)
    model = Net()
    names = [n for n, _ in model.named_parameters()]
    params = dict(model.named_parameters())
    reordered = [params[n] for n in names[2:4] + names[:2] + names[4:]]
    opt = torch.optim.Adafactor(reordered, lr=1e-2)
    fresh = af.TrainState(model, opt, scheduler=torch.optim.lr_scheduler.StepLR(opt, 2, 0.5))
    fresh_step = af.with_clipping(max_norm=1.0)(af.apply_transform(noisy, counter()))
    fresh_step.prepare(fresh)
    before = snapshot(fresh)
    with pytest.raises(ckpt.CheckpointError,
                       match=rf"group 0 holds {names[0]} in the checkpoint, {names[2]} here"):
        ckpt.load(path, fresh, step=fresh_step)
    assert_unchanged(before, fresh)


def _forge_moment(path, key: str, index: int, shape: tuple[int, ...]) -> None:
    """Give the saved state of parameter ``index`` under ``key`` another shape and re-sign
    the checkpoint, as a forger would."""
    import io

    from checkpoint_helpers import forge
    payload = torch.load(path / "state.pt", weights_only=True)
    payload["state"]["optimizer"]["state"][index][key] = torch.zeros(shape)
    buffer = io.BytesIO()
    torch.save(payload, buffer)
    forge(path, "state.pt", buffer.getvalue())


@pytest.mark.parametrize("kind,key", [("adamw", "exp_avg"), ("adamw", "exp_avg_sq"),
                                      ("sgd", "momentum_buffer"), ("adafactor", "row_var")])
def test_a_moment_of_another_shape_than_its_parameter_is_refused_naming_both(
        tmp_path, kind, key):
    def made(seed: int = 0):
        if kind == "adafactor":
            return build("adafactor", seed)
        torch.manual_seed(seed)
        model = Net()
        opt = (torch.optim.AdamW(model.parameters(), lr=1e-2) if kind == "adamw"
               else torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
        state = af.TrainState(model, opt, scheduler=torch.optim.lr_scheduler.StepLR(opt, 2, 0.5))
        loader = data.loader(dataset(), batch_size=4, seed=1)
        step = af.with_clipping(max_norm=1.0)(af.apply_transform(noisy, counter()))
        step.prepare(state)
        return state, loader, step

    state, loader, step = made()
    run(state, iter(loader), step, 2)
    path = ckpt.save(tmp_path, state, loader=loader, step=step)
    index, (name, param) = [(i, np) for i, np in enumerate(state.model.named_parameters())
                            if np[1].dim() == 2][1]  # a matrix of blocks.0
    _forge_moment(path, key, index, (param.shape[0] + 1, param.shape[1]))
    fresh, fresh_loader, fresh_step = made(seed=1)
    run(fresh, iter(fresh_loader), fresh_step, 1)  # a state of its own, left as it was
    before = snapshot(fresh)
    with pytest.raises(ckpt.CheckpointError, match=rf"{key!r}.*{name}|{name}.*{key!r}"):
        ckpt.load(path, fresh, loader=fresh_loader, step=fresh_step)
    assert_unchanged(before, fresh)


def test_a_moment_of_its_parameters_shape_loads_for_an_optimizer_of_its_own(tmp_path):
    # an optimizer of the user's keeps states of any shape (Stacked's (2, *p.shape)): not
    # compared with the parameter's
    _resumes_exactly(tmp_path, "stacked", False)
