"""Training diagnostics: gradients, initialisation and data, sampled without host reads.

Everything here follows one rule: **nothing is read on the host during a normal step.**

* :class:`Diagnostics` samples per-layer gradient norms every ``every`` steps (computed on the
  device, read only in :meth:`Diagnostics.report`), and checks initialisation, input ranges
  and label balance, reporting exploding, vanishing or dead layers.
* The checks themselves live by concern: :mod:`.gradients` (per-layer norms and what they
  say), :mod:`.initialisation` (:func:`~.initialisation.check_init`,
  :func:`~.initialisation.check_model`), :mod:`.inputs` (:func:`~.inputs.check_batch`);
  every one reports :class:`~.findings.Finding` values.
* :class:`~.sync_probe.SyncProbe` (host-sync detection) is in :mod:`.sync_probe`; it is
  re-exported here, where ``accelfn`` and its tests import it from.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

from ..step.extension import GradientTransform, Transform
from .findings import Finding, format_findings
from .gradients import gradient_findings, group_norms, layer_groups
from .initialisation import check_init
from .inputs import input_findings, input_stats, inputs_and_labels, label_findings
from .sync_probe import SyncProbe

__all__ = [
    "Diagnostics",
    "DiagnosticsReport",
    "SyncProbe",  # re-exported: accelfn/__init__.py and tests import it from here
]


@dataclass
class DiagnosticsReport:
    """What :meth:`Diagnostics.report` found.

    ``layer_norms`` holds the last sampled per-layer gradient norm, ``history`` every sample
    as ``{"step": s, "norms": {layer: norm}}``, ``inputs`` per-key statistics of the sampled
    batches and ``labels`` the class counts seen in them.
    """

    findings: list[Finding]
    layer_norms: dict[str, float] = field(default_factory=dict)
    history: list[dict[str, Any]] = field(default_factory=list)
    inputs: dict[str, dict[str, float]] = field(default_factory=dict)
    labels: dict[int, int] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict."""
        out = asdict(self)
        out["findings"] = [f.to_dict() for f in self.findings]
        out["labels"] = {str(k): v for k, v in self.labels.items()}
        return out

    def __str__(self) -> str:
        lines = ["Training diagnostics", "===================="]
        if self.layer_norms:
            lines.append("gradient norm per layer (last sample):")
            width = max(len(k) for k in self.layer_norms)
            for k, v in self.layer_norms.items():
                lines.append(f"  {k:<{width}}  {v:.3e}")
        for key, st in self.inputs.items():
            lines.append(f"input {key}: min {st['min']:.3g} max {st['max']:.3g} "
                         f"mean {st['mean']:.3g} std {st['std']:.3g}")
        if self.labels:
            lines.append("labels: " + ", ".join(f"{k}:{v}" for k, v in
                                                sorted(self.labels.items())))
        lines.append(format_findings(self.findings))
        return "\n".join(lines)


class Diagnostics:
    """Samples gradients and data every ``every`` steps; reports problems on demand.

    >>> diag = Diagnostics(model, every=100)
    >>> for batch in loader:
    ...     metrics = step(state, batch)
    ...     diag.step(metrics, batch)
    >>> print(diag.report())

    On a sampled step, per-parameter gradient norms are taken in a
    ``register_post_accumulate_grad_hook`` as soon as backward has finished accumulating
    each gradient (so it also works when the step sets gradients to ``None`` after the
    update). The hooks exist only during sampled steps: other steps run untouched. With
    fp16 loss scaling the hook sees scaled gradients; a ``loss_scale`` metric passed to
    [`step`][] is divided out. Alternatively add [`transform`][] to an accelfn step: it
    reads the unscaled, micro-batch-weighted, unclipped gradients inside the step.

    Gradients are sampled before any all-reduce (per-rank values) under DDP.

    Args:
        model: the model whose gradients and initialisation are checked.
        every: sample one step in ``every`` (the first step is always sampled).
        explode: a layer whose gradient norm exceeds this is exploding.
        vanish: a layer whose gradient norm is below this (but not zero) is vanishing.
        ratio: a layer ``ratio`` times above (below) the median layer norm is an outlier.
        label_key: which batch key holds integer labels (found by name
            ``label(s)``/``target(s)``/``y`` when not given).
        num_classes: how many classes there are, so that classes never seen are reported
            (default: only the classes seen count).
        imbalance: the most/least frequent class ratio above which labels are imbalanced.
        check_initialisation: run `check_init` now, before training changes weights.
    """

    def __init__(self, model: nn.Module, *, every: int = 100, explode: float = 1e3,
                 vanish: float = 1e-7, ratio: float = 1e3, label_key: str | None = None,
                 num_classes: int | None = None, imbalance: float = 10.0,
                 check_initialisation: bool = True) -> None:
        if every < 1:
            raise ValueError(f"Diagnostics(every={every}): sample at least every 1 step")
        self.model = model
        self.every = every
        self.explode = explode
        self.vanish = vanish
        self.ratio = ratio
        self.label_key = label_key
        self.num_classes = num_classes
        self.imbalance = imbalance
        self._named, self._layers, self._index = layer_groups(model)
        self._steps = 0
        self._armed = False
        self._unscaled = False
        self._handles: list[RemovableHandle] = []
        self._param_norms: dict[int, Tensor] = {}
        self._samples: list[tuple[int, Tensor, list[bool], frozenset[str]]] = []
        self._inputs: dict[str, tuple[torch.dtype, list[Tensor]]] = {}
        self._labels: list[Tensor] = []
        self.init_findings = check_init(model) if check_initialisation else []
        self._arm()

    @property
    def transform(self) -> Transform:
        """This diagnostics as a step transform.

        A gradient transform that only reads: after loss-scale unscaling and micro-batch
        weighting, before clipping, so the norms are the true, unclipped gradients of the
        update.
        """

        def capture(grads: list[Tensor], params: list[Tensor], state: None) -> None:
            if self._armed:
                self._capture_from_grads()

        return Transform("diagnostics", GradientTransform("diagnostics", capture),
                         label=f"diagnostics(every={self.every})")

    # -- sampling -----------------------------------------------------------------------------

    def _arm(self) -> None:
        self._armed = True
        self._param_norms = {}
        for i, (_, p) in enumerate(self._named):
            hook = p.register_post_accumulate_grad_hook  # unannotated in torch:
            self._handles.append(hook(self._hook(i)))  # type: ignore[no-untyped-call]

    def _hook(self, i: int) -> Callable[[Tensor], None]:
        def hook(p: Tensor) -> None:
            if p.grad is not None:
                with torch.no_grad():
                    self._param_norms[i] = torch.linalg.vector_norm(p.grad.detach().float())
        return hook

    def _disarm(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []
        self._armed = False

    def _capture_from_grads(self) -> None:
        self._unscaled = True
        with torch.no_grad():
            for i, (_, p) in enumerate(self._named):
                if p.grad is not None:
                    self._param_norms[i] = torch.linalg.vector_norm(p.grad.detach().float())

    def step(self, metrics: Mapping[str, Any] | None = None, batch: Any = None) -> None:
        """Mark the end of one training step (cheap unless this step is sampled).

        On a sampled step this stacks the gradient norms seen (on the device) and, when a
        ``batch`` is given, its input statistics and labels. Nothing is read on the host.
        """
        if self._armed:
            self._disarm()
            norms, self._param_norms = self._param_norms, {}
            unscaled, self._unscaled = self._unscaled, False
            missing = frozenset(self._named[i][0] for i in range(len(self._named))
                                if i not in norms)
            if norms:
                idx = sorted(norms)
                grouped = group_norms([norms[i] for i in idx],
                                       [self._index[i] for i in idx], len(self._layers))
                scale = metrics.get("loss_scale") if metrics is not None and hasattr(
                    metrics, "get") else None
                if isinstance(scale, Tensor) and not unscaled:
                    grouped = grouped / scale.float().to(grouped.device)
                present = [False] * len(self._layers)
                for i in idx:
                    present[self._index[i]] = True
                self._samples.append((self._steps, grouped, present, missing))
            if batch is not None:
                self._sample_batch(batch)
        self._steps += 1
        if self._steps % self.every == 0:
            self._arm()

    def _sample_batch(self, batch: Any) -> None:
        inputs, labels = inputs_and_labels(batch, self.label_key)
        with torch.no_grad():
            for key, x in inputs:
                self._inputs.setdefault(key, (x.dtype, []))[1].append(input_stats(x))
            if labels is not None:
                self._labels.append(labels.detach().reshape(-1).clone())

    # -- reporting ----------------------------------------------------------------------------

    def report(self) -> DiagnosticsReport:
        """Read the samples (the only host reads) and turn them into findings."""
        findings: list[Finding] = list(self.init_findings)
        history: list[dict[str, Any]] = []
        unused: set[str] = set()
        for step, norms, present, missing in self._samples:
            values = norms.tolist()
            history.append({"step": step, "norms": {k: v for k, v, ok in
                                                    zip(self._layers, values, present) if ok}})
            unused |= missing
        findings += gradient_findings(history, explode=self.explode, vanish=self.vanish,
                                      ratio=self.ratio)
        if unused and history:
            findings.append(Finding(
                "gradients", "info",
                f"{len(unused)} parameter(s) got no gradient on sampled steps: "
                f"{sorted(unused)[:5]}{'...' if len(unused) > 5 else ''}",
                "unused parameters: remove them, or DDP needs find_unused_parameters=True"))
        inputs: dict[str, dict[str, float]] = {}
        for key, (dtype, stats) in self._inputs.items():
            mat = torch.stack(stats)  # on the device: one host read per key, below
            agg = torch.stack([mat[:, 0].min(), mat[:, 1].max(), mat[:, 2].mean(),
                               mat[:, 3].mean(), mat[:, 4].min(), mat[:, 5].min()]).tolist()
            inputs[key] = dict(zip(("min", "max", "mean", "std"), agg[:4]))
            findings += input_findings(key, dtype, agg)
        counts: dict[int, int] = {}
        if self._labels:
            labels = torch.cat(self._labels).long().cpu()  # one transfer
            if labels.numel() and labels.min() >= 0:
                bins = torch.bincount(labels, minlength=self.num_classes or 0).tolist()
                counts = dict(enumerate(bins))
                if self.num_classes is None:
                    counts = {k: v for k, v in counts.items() if v}
                findings += label_findings(counts, self.num_classes, self.imbalance)
        last = history[-1]["norms"] if history else {}
        return DiagnosticsReport(findings, dict(last), history, inputs, counts)

    def close(self) -> None:
        """Remove any hooks still registered."""
        self._disarm()
