"""Diagnostics: gradient sampling, initialisation and data checks, findings (CPU)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from accelfn.observe.diagnostics import Diagnostics
from accelfn.observe.findings import Finding, format_findings, worst_severity
from accelfn.observe.gradients import layer_grad_norms
from accelfn.observe.initialisation import check_init, check_model
from accelfn.observe.inputs import check_batch


class _Scale(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, factor):
        ctx.factor = factor
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return g * ctx.factor, None


class GradScale(nn.Module):
    """Identity forward; multiplies the gradient flowing back by ``factor``."""

    def __init__(self, factor: float) -> None:
        super().__init__()
        self.factor = factor

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _Scale.apply(x, self.factor)


def _mlp(planted: nn.Module | None = None) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32),
                         planted or nn.Identity(), nn.Linear(32, 4))


def _train(model: nn.Module, diag: Diagnostics, steps: int) -> list[int]:
    """Plain loop (zero_grad(set_to_none) after the update, like accelfn's step)."""
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    hooks_seen = []
    for _ in range(steps):
        hooks_seen.append(len(diag._handles))
        x, y = torch.randn(32, 16), torch.randint(0, 4, (32,))
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        diag.step({"loss": loss.detach()}, {"image": x, "label": y})
    return hooks_seen


# -- gradients -----------------------------------------------------------------------------------


def test_planted_exploding_layer_is_reported_by_name() -> None:
    model = _mlp(GradScale(1e6))  # layers 0 and 2 sit below the amplifier
    diag = Diagnostics(model, every=2)
    hooks = _train(model, diag, steps=4)
    report = diag.report()
    errors = [f for f in report.findings if f.check == "gradients" and f.severity == "error"]
    named = {f.message.split("'")[1] for f in errors}
    assert named == {"0", "2"}
    assert all("exploding" in f.message and "with_clipping" in (f.fix or "") for f in errors)
    assert not any("'4'" in f.message for f in report.findings)  # normal layer not flagged
    assert report.layer_norms["0"] > 1e3 > report.layer_norms["4"]
    assert [h["step"] for h in report.history] == [0, 2]
    # hooks exist only on sampled steps: normal steps run untouched
    assert [h > 0 for h in hooks] == [True, False, True, False]
    diag.close()
    assert diag._handles == []


def test_vanishing_gradients_and_healthy_model() -> None:
    model = _mlp(GradScale(1e-12))
    diag = Diagnostics(model, every=1)
    _train(model, diag, steps=2)
    warned = {f.message.split("'")[1] for f in diag.report().findings
              if f.severity == "warning" and "vanishing" in f.message}
    assert warned == {"0", "2"}

    healthy = _mlp()
    diag = Diagnostics(healthy, every=1)
    _train(healthy, diag, steps=3)
    report = diag.report()
    assert worst_severity(report.findings) == "ok", format_findings(report.findings)
    assert len(report.history) == 3 and set(report.layer_norms) == {"0", "2", "4"}


def test_layer_grad_norms_match_manual_norms() -> None:
    model = _mlp()
    F.cross_entropy(model(torch.randn(8, 16)), torch.randint(0, 4, (8,))).backward()
    norms = layer_grad_norms(model)
    layer = model[2]
    expected = torch.sqrt(layer.weight.grad.norm() ** 2 + layer.bias.grad.norm() ** 2)
    assert isinstance(norms["2"], torch.Tensor)
    torch.testing.assert_close(norms["2"], expected)
    assert set(norms) == {"0", "2", "4"}


def test_unused_parameter_and_loss_scale_division() -> None:
    class WithUnused(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.net, self.unused = _mlp(), nn.Linear(2, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.net(x)

    model = WithUnused()
    diag = Diagnostics(model, every=1, check_initialisation=False)
    x, y = torch.randn(8, 16), torch.randint(0, 4, (8,))
    (F.cross_entropy(model(x), y) * 1024.0).backward()  # as fp16 loss scaling would
    diag.step({"loss_scale": torch.tensor(1024.0)})
    ref = layer_grad_norms(model)
    report = diag.report()
    assert report.layer_norms["net.2"] == pytest.approx(ref["net.2"].item() / 1024.0, rel=1e-5)
    assert any("unused.weight" in f.message for f in report.findings)


def test_transform_form_reads_gradients_inside_an_accelfn_step() -> None:
    step_mod = pytest.importorskip("accelfn.step.engine")
    from tensordict import TensorDict

    from accelfn.core.state import TrainState

    model = _mlp(GradScale(1e6))
    diag = Diagnostics(model, every=1)

    def loss_fn(m: nn.Module, batch: TensorDict) -> torch.Tensor:
        return F.cross_entropy(m(batch["x"]), batch["y"])

    step = step_mod.apply_transform(loss_fn, diag.transform)
    state = TrainState(model, torch.optim.SGD(model.parameters(), lr=0.0))
    batch = TensorDict({"x": torch.randn(8, 16), "y": torch.randint(0, 4, (8,))},
                       batch_size=[8])
    diag.step(step(state, batch), batch)
    named = {f.message.split("'")[1] for f in diag.report().findings if f.severity == "error"}
    assert named == {"0", "2"}


# -- initialisation, inputs, labels ------------------------------------------------------------


def test_check_init_flags_zero_and_badly_scaled_layers() -> None:
    model = _mlp()
    assert [f.severity for f in check_init(model)] == ["ok"]
    with torch.no_grad():
        model[0].weight.zero_()
        model[2].weight.normal_(0, 50.0)
    findings = check_init(model)
    msgs = " | ".join(f.message for f in findings)
    assert "layer '0' weights are all zero" in msgs
    assert "layer '2' weight std" in msgs
    assert "'4'" not in msgs
    assert all(f.fix for f in findings)


def test_check_batch_inputs_and_labels() -> None:
    images = torch.randint(0, 256, (64, 3, 8, 8)).float()
    labels = torch.cat([torch.zeros(60), torch.ones(4)]).long()
    findings = check_batch({"image": images, "label": labels})
    text = format_findings(findings)
    assert "unnormalised 0-255 pixels" in text
    assert "imbalanced" in text and "15x" in text
    good = check_batch({"image": (images / 255 - 0.5) / 0.25,
                        "label": torch.arange(64) % 4})
    assert worst_severity(good) == "ok", format_findings(good)
    one = check_batch((torch.randn(8, 3), torch.full((8,), 2)))
    assert any("every sampled label is class 2" in f.message for f in one)
    nan = check_batch({"x": torch.tensor([1.0, float("nan")])})
    assert worst_severity(nan) == "error"


def test_diagnostics_samples_inputs_and_labels_of_sampled_steps() -> None:
    model = nn.Linear(4, 2)
    diag = Diagnostics(model, every=2, num_classes=3)
    for i in range(4):
        x = torch.full((10, 4), 200.0 + i).round()
        loss = model(x).sum()
        loss.backward()
        model.zero_grad(set_to_none=True)
        diag.step(None, {"x": x, "label": torch.zeros(10, dtype=torch.long)})
    report = diag.report()
    assert report.labels == {0: 20, 1: 0, 2: 0}  # steps 0 and 2 only
    assert report.inputs["x"]["min"] == 200.0 and report.inputs["x"]["max"] == 202.0
    text = str(report)
    assert "every sampled label is class 0" in text
    assert "input 'x'" in text


def test_check_model_wants_syncbatchnorm_when_distributed(monkeypatch: pytest.MonkeyPatch) -> None:
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4))
    assert not any(f.check == "sync_batchnorm" for f in check_model(model))
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda *a: 4)
    (f,) = [f for f in check_model(model) if f.check == "sync_batchnorm"]
    assert "convert_sync_batchnorm" in (f.fix or "")
    synced = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    assert not any(f.check == "sync_batchnorm" for f in check_model(synced))


def test_finding_formatting() -> None:
    fs = [Finding("a", "ok", "fine"), Finding("b", "error", "broken", "do x")]
    assert worst_severity(fs) == "error"
    text = format_findings(fs)
    assert text.index("broken") < text.index("fine") and "fix: do x" in text
    assert format_findings(fs, min_severity="warning").count("\n") == 1
    assert fs[1].to_dict() == {"check": "b", "severity": "error", "message": "broken",
                               "fix": "do x"}
