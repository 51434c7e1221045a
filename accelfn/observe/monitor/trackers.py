"""Experiment trackers as monitor sinks: Weights & Biases and MLflow (optional extras).

    mon = Monitor(state=state, sinks=[WandbSink(project="digits", id="run-1")])
    mon = Monitor(state=state, sinks=[MlflowSink(experiment="digits", run_name="run-1")])

Neither package is imported until a sink is built; without it the sink says which extra to
install (``pip install 'accelfn[wandb]'``, ``pip install 'accelfn[mlflow]'``).

On a resumed run (the monitor opened at ``TrainState.step = k > 0``: its first row is step
``k + 1``, rows being numbered as ``state.step`` counts the updates) both continue the
same run: W&B with ``resume="allow"`` on the run's ``id``, MLflow in the run of that
``run_id`` or ``run_name``. A tracker's history is append-only, so the steps it already
holds (those run again after the checkpoint) keep their first values and the new rows start
after them; each step is logged once. ``WandbSink(rewind=True)`` instead rewinds the W&B run
to W&B step ``k`` (W&B's ``resume_from``, a feature the W&B server must offer) and logs the
steps from ``k + 1`` again.

W&B gets one row per monitor row, with the row's step as the metric ``update``: the x-axis
of the sink's charts (``run.define_metric``). W&B's own step is the update too, but under
``with_accumulation(n, mode="calls")``, where the ``n`` calls of one update share its step
and W&B would merge rows of one step into one, it counts the calls: each is a row, at its
``update``, as in the other sinks.
"""

from __future__ import annotations

import posixpath
import re
import time
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

from .sinks import Row, scalars

__all__ = ["MlflowSink", "WandbSink"]


class WandbSink:
    """Rows to a Weights & Biases run: one W&B row per monitor row, plotted against ``update``.

    Equivalent to ``run = wandb.init(**init)``, ``run.define_metric(name,
    step_metric="update")`` for each field, then ``run.log({**scalars(row), "update":
    row["step"]}, step=row["step"])`` for each row, the report in ``run.summary["report"]``
    and ``run.finish()`` (``run.finish(exit_code=1)`` when the monitored loop raised). Rows
    that share a step, the calls of one update in ``with_accumulation(n, mode="calls")``,
    get the next W&B steps instead (W&B merges rows of one step): W&B's step then counts
    calls, ``update`` the optimizer updates.

    Args:
        run: an existing run (from your own ``wandb.init``) to log into; it is not finished
            by the sink. Without it the sink calls ``wandb.init(**init)`` when opened.
        prefix: put before every field name (``"train/"`` groups the panels; the x-axis is
            then ``"train/update"``).
        rewind: on a resumed run, rewind the W&B run to just before the resumed step and
            log those steps again, instead of keeping the values it holds (needs ``id`` and
            a W&B server that offers run rewind). W&B rewinds to its own step ``k - 1``: the
            update's row only when each update is one row (not in ``mode="calls"``).
        **init: arguments of ``wandb.init`` (``project``, ``id``, ``name``, ``config``,
            ``dir``, ``mode``...). Give ``id`` so that a resumed run continues the same run.
    """

    def __init__(self, *, run: Any = None, prefix: str = "", rewind: bool = False,
                 **init: Any) -> None:
        try:
            import wandb
        except ImportError as exc:
            raise ImportError("WandbSink needs the wandb package: "
                              "pip install 'accelfn[wandb]'") from exc
        if run is not None and init:
            raise ValueError(f"WandbSink(run=..., {', '.join(sorted(init))}=...): pass an "
                             "existing run or wandb.init arguments, not both")
        if rewind and run is None and not init.get("id"):
            raise ValueError("WandbSink(rewind=True) needs id=...: the run to rewind")
        self._wandb, self._init, self.prefix, self.rewind = wandb, init, prefix, rewind
        self.run: Any = run
        self._owned = run is None
        self.update_key = f"{prefix}update"
        self._last = -1  # the last update the run holds: rows up to it are not logged again
        self._next = 0  # the W&B step of the next row: at least its update
        self._done = -1  # the last update this sink logged into self.run
        self._axes: set[str] = set()
        self._rewound = False
        self._prev: int | None = None

    def open(self, start_step: int) -> None:
        self._rewound = False
        if self.run is None:
            init = dict(self._init)
            if start_step > 1 and self.rewind:  # resumed: rows up to start_step - 1 done
                # W&B keeps the rewind step itself and logs on from the next one
                init["resume_from"] = f"{init.pop('id')}?_step={start_step - 1}"
                init.pop("resume", None)
                self._rewound = True
            elif start_step > 1 and init.get("id"):
                init.setdefault("resume", "allow")
            self.run, self._next, self._done = self._wandb.init(**init), 0, -1
        # a resumed online run goes on after the W&B steps the server holds
        first = int(getattr(self.run, "starting_step", 0) or 0)
        if not self._owned:  # your run: after what it holds, its pending step too
            try:
                now = int(self.run.step)
            except Exception:  # a run in mode="shared" has no step to ask for
                now = 0
            first = max(first, now + 1 if now else 0)
        self._next, self._axes, self._prev = max(self._next, first), set(), None
        # a resumed online run holds rows up to the update in its summary: those keep their
        # values (a run logged by an older accelfn, with step=update: up to its step counter)
        held = None if self._rewound else self.run.summary.get(self.update_key)
        if isinstance(held, (int, float)) and not isinstance(held, bool):
            self._last = max(int(held), self._done)
        else:
            self._last = max((start_step if self._rewound else first) - 1, self._done)

    def write(self, rows: Sequence[Row]) -> None:
        if self.run is None:
            raise RuntimeError("WandbSink.write before open(): the Monitor opens its sinks "
                               "when it starts")
        for r in rows:
            update = int(r["step"])
            if update <= self._last:
                continue
            if update == self._prev and self._rewound:
                self._rewound = False
                warnings.warn(f"WandbSink(rewind=True) rewound the run to W&B step "
                              f"{self._last}, but W&B's steps count calls here, several an "
                              "update (with_accumulation mode='calls'): the run lost the "
                              "rows after that step, not only those of the updates that run "
                              "again", stacklevel=2)
            self._prev = update
            values = scalars(r, self.prefix)
            if self.update_key not in self._axes:
                self.run.define_metric(self.update_key)
                self._axes.add(self.update_key)
            for name in sorted(values.keys() - self._axes):
                self.run.define_metric(name, step_metric=self.update_key)
                self._axes.add(name)
            step = max(update, self._next)  # calls sharing an update: the next W&B steps
            self._next, self._done = step + 1, max(self._done, update)
            self.run.log({**values, self.update_key: update}, step=step)

    def close(self, report: str | None = None) -> None:
        self._close(report, exit_code=0)

    def abort(self, report: str | None = None) -> None:
        """Close after the monitored loop raised: the run is finished as failed."""
        self._close(report, exit_code=1)

    def _close(self, report: str | None, *, exit_code: int) -> None:
        if self.run is None:
            return
        if report:
            self.run.summary[f"{self.prefix}report"] = report
        if self._owned:
            self.run.finish(exit_code=exit_code)
            self.run = None  # opened again (another monitor): wandb.init again


def mlflow_name(name: str) -> str:
    """``name`` as MLflow takes a metric name: characters other than letters, digits,
    ``_ - . : /`` and spaces become ``_``, and the name is a normalised relative path
    (no ``//``, ``./`` or leading ``/``), of at most 250 characters."""
    out = re.sub(r"[^/\w.\- :]", "_", name)
    if posixpath.normpath(out) != out or out.startswith("/"):
        out = "/".join(part if part not in ("", ".", "..") else "_"
                       for part in out.split("/"))
    return out[:250] or "_"


class MlflowSink:
    """Rows to an MLflow run: each numeric field as a metric at its step.

    Equivalent to ``MlflowClient(tracking_uri).log_batch(run_id, [Metric(name, value, t,
    row["step"]), ...])`` for the rows, the report as the artifact ``accelfn_report.txt``
    and ``set_terminated(run_id)`` (``status="FAILED"`` when the monitored loop raised).

    Which run: ``run_id`` when given; else, on a resumed run, the newest run named
    ``run_name`` in the experiment; else the active run of ``mlflow.start_run()`` (left
    open); else a new run named ``run_name``.

    Args:
        experiment: experiment name, created when missing (default: MLflow's default one).
        run_id: continue this run.
        run_name: the run's name, and how a resumed run finds it again.
        tracking_uri: where runs are stored (default: ``mlflow.get_tracking_uri()``, e.g.
            ``MLFLOW_TRACKING_URI``); ``"file:/path/mlruns"`` is a local file store (MLflow
            3 refuses it unless ``MLFLOW_ALLOW_FILE_STORE=true``).
        tags: tags of a new run.
        prefix: put before every metric name.
    """

    def __init__(self, *, experiment: str | None = None, run_id: str | None = None,
                 run_name: str | None = None, tracking_uri: str | None = None,
                 tags: Mapping[str, str] | None = None, prefix: str = "") -> None:
        try:
            import mlflow
            from mlflow.entities import Metric
            from mlflow.tracking import MlflowClient
        except ImportError as exc:
            raise ImportError("MlflowSink needs MLflow: pip install 'accelfn[mlflow]' "
                              "(mlflow-skinny is enough)") from exc
        self._mlflow, self._metric, self._client_type = mlflow, Metric, MlflowClient
        self.experiment, self.run_name, self.tracking_uri = experiment, run_name, tracking_uri
        self.tags, self.prefix = dict(tags or {}), prefix
        self.run_id = run_id
        self._client: Any = None
        self._owned = True
        self._last = -1
        self._names: dict[str, str] = {}  # row field -> the MLflow metric name

    def _experiment_id(self) -> str:
        if self.experiment is None:
            return "0"
        found = self._client.get_experiment_by_name(self.experiment)
        return str(found.experiment_id if found is not None
                   else self._client.create_experiment(self.experiment))

    def _find_by_name(self, experiment_id: str) -> str | None:
        name = str(self.run_name).replace("'", "\\'")
        runs = self._client.search_runs([experiment_id], f"tags.`mlflow.runName` = '{name}'",
                                        max_results=1, order_by=["attributes.start_time DESC"])
        return str(runs[0].info.run_id) if runs else None

    def open(self, start_step: int) -> None:
        self._client = self._client_type(tracking_uri=self.tracking_uri)
        run_id = self.run_id
        if run_id is None and start_step > 1 and self.run_name:
            run_id = self._find_by_name(self._experiment_id())
        active = self._mlflow.active_run() if self.tracking_uri is None else None
        if run_id is None and active is not None:
            run_id, self._owned = str(active.info.run_id), False
        if run_id is None:
            run = self._client.create_run(self._experiment_id(), run_name=self.run_name,
                                          tags=self.tags)
            self.run_id = str(run.info.run_id)
            return
        self.run_id = run_id
        if self._owned:
            self._client.update_run(run_id, status="RUNNING")
        history = self._client.get_metric_history(run_id, self._name(f"{self.prefix}iter_s"))
        self._last = max((int(m.step) for m in history), default=-1)

    def write(self, rows: Sequence[Row]) -> None:
        if self._client is None or self.run_id is None:
            raise RuntimeError("MlflowSink.write before open(): the Monitor opens its sinks "
                               "when it starts")
        now = int(time.time() * 1000)
        metrics = [self._metric(self._name(k), v, now, int(r["step"])) for r in rows
                   if int(r["step"]) > self._last
                   for k, v in scalars(r, self.prefix).items()]
        for i in range(0, len(metrics), 1000):  # MLflow takes at most 1000 per batch
            self._client.log_batch(self.run_id, metrics=metrics[i:i + 1000])

    def _name(self, field: str) -> str:
        """The MLflow name of ``field``; a field MLflow would refuse (and end the run for)
        is renamed with a warning, once."""
        name = self._names.get(field)
        if name is None:
            name = self._names[field] = mlflow_name(field)
            if name != field:
                warnings.warn(f"MlflowSink: MLflow refuses the metric name {field!r}; it is "
                              f"logged as {name!r} (letters, digits, _ - . : / and spaces "
                              "only)", stacklevel=4)
        return name

    def close(self, report: str | None = None) -> None:
        self._close(report, status="FINISHED")

    def abort(self, report: str | None = None) -> None:
        """Close after the monitored loop raised: the run ends with status ``FAILED``."""
        self._close(report, status="FAILED")

    def _close(self, report: str | None, *, status: str) -> None:
        if self._client is None or self.run_id is None:
            return
        if report:
            self._client.log_text(self.run_id, report, "accelfn_report.txt")
        if self._owned:
            self._client.set_terminated(self.run_id, status=status)
