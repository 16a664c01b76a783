"""An MLflow run of a training run: where the store is, the experiment, the run's lifecycle, its params, tags
and metrics, and the lineage of runs it resumed.

One MLflow run per Prefect flow run, in experiment `cfg.tracking.experiment`. The MLflow run carries the
tag `prefect.flow_run_id` and, unless tracking.run_name says otherwise, the flow run's name. An experiment
this module creates is tagged `mlflow.experimentKind = custom_model_development`, so that MLflow 3's UI
opens it on its runs (model training) rather than on its GenAI traces view, where training runs do not show.

The tracking URI is `cfg.tracking.tracking_uri` (which `validate_config` fills from MLFLOW_TRACKING_URI),
else `sqlite:///<cwd>/mlflow.db`; with a SQLite store, artifacts go to `mlartifacts/` beside the database.
"""

from __future__ import annotations

import logging
import os
import re
import sys
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Optional

from rlhf_core.config import TrainConfig, flatten_config

EXPERIMENT_KIND_TAG = "mlflow.experimentKind"  # read by the MLflow 3 UI to pick the experiment's view
EXPERIMENT_KIND = "custom_model_development"  # (the other values: genai_development, finetuning, ...)
RESUMED_FROM_RUN = "atrlhf.resumed_from_run"  # tags of a run that resumed another
RESUMED_FROM_STEP = "atrlhf.resumed_from_step"
MLFLOW_PARENT_RUN = "mlflow.parentRunId"  # MLflow's own tag: the UI nests a run under this parent
PER_RUN_KEYS = ("run.name", "run.output_dir", "tracking.run_name")  # differ between a sweep's children by construction
PARAM_BATCH = 100  # MLflow accepts at most 100 params per log_batch call
PARAM_VALUE_MAX = 6000  # and param values of at most 6000 characters
METRIC_BATCH = 1000  # and at most 1000 metrics per call
METRICS_IN_FLIGHT = 8  # queued per-poll metrics writes before log_metrics(wait=False) waits for the oldest
TERMINAL_STATUSES = ("FINISHED", "FAILED", "KILLED")
LR_METRIC = "policy/lr"
LR_MICRO_METRIC = "policy/lr_micro"  # the learning rate in millionths: 300 for 3e-4 (see numeric_metrics)
UI_URL_ENV = "ATRLHF_MLFLOW_UI_URL"  # where your MLflow UI answers, when not `mlflow ui`'s default
DEFAULT_UI_URL = "http://127.0.0.1:5000"


def quiet_mlflow_env() -> None:
    """Offline and quiet defaults (telemetry off, no progress bars); explicit settings win."""
    for key, value in {"MLFLOW_DISABLE_TELEMETRY": "true", "MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR": "false"}.items():
        os.environ.setdefault(key, value)


def resolve_tracking_uri(cfg: TrainConfig) -> str:
    """cfg.tracking.tracking_uri, else sqlite:///<cwd>/mlflow.db (absolute, so every process agrees)."""
    if cfg.tracking.tracking_uri:
        return cfg.tracking.tracking_uri
    return f"sqlite:///{Path.cwd().resolve() / 'mlflow.db'}"


def sqlite_path(uri: str) -> Optional[Path]:
    """The database file of a sqlite:/// URI, else None."""
    if uri.startswith("sqlite:///"):
        return Path(uri[len("sqlite:///") :])
    return None


def _console_script(name: str) -> str:
    """`name` as typed from the working directory: the console script beside this interpreter (.venv/bin/mlflow
    from the repository root), so the command runs without the virtualenv on PATH; else the bare name."""
    path = Path(sys.executable).parent / name
    if not path.exists():
        return name
    return os.path.relpath(path) if path.is_relative_to(Path.cwd()) else str(path)


def ui_url(uri: str) -> str:
    """Where the MLflow UI answers: $ATRLHF_MLFLOW_UI_URL when set, else a tracking server's own URL, else
    `mlflow ui`'s default (http://127.0.0.1:5000)."""
    configured = os.environ.get(UI_URL_ENV, "").strip()
    if configured:
        return configured.rstrip("/")
    return uri.rstrip("/") if uri.startswith(("http://", "https://")) else DEFAULT_UI_URL


def ui_command(uri: str) -> str:
    """The command that opens the MLflow UI on this store (serving at `ui_url`'s host and port)."""
    if uri.startswith(("http://", "https://")):
        return f"open {ui_url(uri)}"
    from urllib.parse import urlsplit

    where = urlsplit(ui_url(uri))
    host, port = where.hostname or "127.0.0.1", where.port or 5000
    return f"{_console_script('mlflow')} ui --backend-store-uri {uri} --host {host} --port {port}"


def run_url(uri: str, experiment_id: str, run_id: str) -> str:
    """Where the run shows in the MLflow UI (`ui_url`)."""
    return f"{ui_url(uri)}/#/experiments/{experiment_id}/runs/{run_id}"


def client(uri: str):
    """An MlflowClient on this store (quiet and offline), whose writes a signal cannot cut in half
    (tracking/uninterrupted.py)."""
    quiet_mlflow_env()
    from mlflow.tracking import MlflowClient

    from tracking.uninterrupted import Uninterrupted

    return Uninterrupted(MlflowClient(tracking_uri=uri))


def looks_like_run_id(text: str) -> bool:
    return len(text) == 32 and all(c in "0123456789abcdef" for c in text.lower())


def run_exists(run_id: str, uri: str) -> bool:
    from mlflow.exceptions import MlflowException

    try:
        client(uri).get_run(run_id)
        return True
    except MlflowException:
        return False


_MLFLOW_ILLEGAL = re.compile(r"[^/\w.\- :]")


def mlflow_metric_name(key: str) -> str:
    """The name a metric is stored under in MLflow, which refuses '@' and most punctuation: '@' becomes '_at_'
    (MLflow's own autologging spelling: eval/pass@k -> eval/pass_at_k), anything else illegal '_'."""
    return _MLFLOW_ILLEGAL.sub("_", key.replace("@", "_at_"))


def numeric_metrics(metrics: dict) -> dict[str, float]:
    """The numeric values of a metrics row, under their MLflow names (`mlflow_metric_name`).

    `policy/lr` also goes in millionths as `policy/lr_micro` (300 for 3e-4): MLflow's charts draw a constant
    series on an axis of its value ± 1 (plotly's autorange), so a constant learning rate of 3e-4 reads as a
    flat 0 there while 300 reads as 300. `policy/lr` itself keeps the exact value."""
    out = {}
    for key, value in metrics.items():
        if isinstance(value, bool):
            value = float(value)
        if isinstance(value, (int, float)) and key not in ("step",):
            out[mlflow_metric_name(key)] = float(value)
    if LR_METRIC in out:
        out[LR_MICRO_METRIC] = out[LR_METRIC] * 1e6
    return out


def experiment_id(mlflow_client, name: str, uri: str) -> str:
    """The id of experiment `name`, created (tagged for model training, artifacts beside a SQLite store) if
    it does not exist yet."""
    from mlflow.exceptions import MlflowException

    exp = mlflow_client.get_experiment_by_name(name)
    if exp is not None:
        if EXPERIMENT_KIND_TAG not in exp.tags:  # made before this tag was set; a kind chosen in the UI stays
            try:
                mlflow_client.set_experiment_tag(exp.experiment_id, EXPERIMENT_KIND_TAG, EXPERIMENT_KIND)
            except MlflowException:  # a read-only or restricted store: the UI's view is cosmetic
                pass
        return exp.experiment_id
    location = None
    db = sqlite_path(uri)
    if db is not None:  # keep artifacts beside the database (what `mlflow ui` in that directory serves)
        location = (db.parent.resolve() / "mlartifacts" / name).as_uri()
    try:
        return mlflow_client.create_experiment(
            name, artifact_location=location, tags={EXPERIMENT_KIND_TAG: EXPERIMENT_KIND}
        )
    except MlflowException:  # created concurrently by another run
        exp = mlflow_client.get_experiment_by_name(name)
        if exp is None:
            raise
        return exp.experiment_id


class MlflowTracker:
    """The MLflow side of one run. Every call goes through an explicit MlflowClient (no global active run)."""

    def __init__(
        self,
        uri: str,
        run_id: str,
        experiment_id: str,
        parent_run_id: Optional[str] = None,
        resumed_from_step: Optional[int] = None,
        keep_checkpoints: int = 0,
    ):
        self.uri = uri
        self.client = client(uri)
        self.run_id = run_id
        self.experiment_id = experiment_id
        self.parent_run_id = parent_run_id  # the run this one resumed, if any
        self.resumed_from_step = resumed_from_step
        self.keep_checkpoints = keep_checkpoints  # checkpoint.keep (0: keep all)
        self.system_monitor = None
        self.ended: Optional[str] = None
        self.flow_run_id: Optional[str] = None  # the Prefect flow run that started it (held until it ends)
        self.in_flight: list = []  # the queued log_metrics(wait=False) writes, oldest first (futures of `writer`)
        self.writer: Optional[ThreadPoolExecutor] = None  # one thread, started by the first log_metrics(wait=False)

    # ------------------------------------------------------------------ lifecycle
    @classmethod
    def start(
        cls,
        cfg: TrainConfig,
        flow_run_id: Optional[str] = None,
        resume_run_id: Optional[str] = None,
        tags: Optional[dict[str, str]] = None,
        run_name: Optional[str] = None,
        resume_step: Optional[int] = None,
        parent_run_id: Optional[str] = None,
        hold: Optional[Callable[[MlflowTracker], object]] = None,
    ) -> MlflowTracker:
        """Create the run, log params and tags, start system metrics. With `resume_run_id` the new run resumes
        that one at `resume_step`: it is tagged with both, and a parent left RUNNING by a dead driver is
        marked FAILED. With `parent_run_id` (a sweep's parent run) the run is its child (`mlflow.parentRunId`,
        in the parent's experiment), which MLflow's UI nests under it; its params leave out PER_RUN_KEYS
        (tags instead), which differ between the children by construction and would otherwise head the
        compare view's varying params.

        The run is named cfg.tracking.run_name, else `run_name` (the Prefect flow run's name), else MLflow
        picks a name. A tag with an empty value is not set (`resumed_from` only on a resumed run, say).
        `hold(tracker)` is called as soon as the run exists (the flow's cleanup then ends it, even if a signal
        lands before this returns)."""
        from mlflow.entities import RunStatus

        uri = resolve_tracking_uri(cfg)
        mlflow_client = client(uri)
        exp_id = experiment_id(mlflow_client, cfg.tracking.experiment, uri)
        run_tags = {"mlflow.source.name": "flows/train.py:train", "mlflow.source.type": "JOB"}
        name = cfg.tracking.run_name or run_name or None
        if resume_run_id:  # a resumed run is a run of its own that names its parent and the step it resumed at
            parent = mlflow_client.get_run(resume_run_id)
            exp_id = parent.info.experiment_id
            run_tags.update({RESUMED_FROM_RUN: resume_run_id, RESUMED_FROM_STEP: str(int(resume_step or 0))})
            name = name or f"{parent.info.run_name}-resumed-{int(resume_step or 0)}"
            if parent.info.status == RunStatus.to_string(RunStatus.RUNNING):  # its driver died without ending it
                mlflow_client.set_tag(
                    resume_run_id,
                    "atrlhf.ended",
                    "its driver stopped without ending the run; marked FAILED "
                    f"when it was resumed at step {int(resume_step or 0)}",
                )
                mlflow_client.set_terminated(resume_run_id, status="FAILED")
        if parent_run_id:
            exp_id = mlflow_client.get_run(parent_run_id).info.experiment_id
            run_tags[MLFLOW_PARENT_RUN] = parent_run_id
        run = mlflow_client.create_run(exp_id, run_name=name, tags=run_tags)
        tracker = cls(
            uri,
            run.info.run_id,
            exp_id,
            parent_run_id=resume_run_id,
            resumed_from_step=resume_step,
            keep_checkpoints=cfg.checkpoint.keep,
        )
        tracker.flow_run_id = str(flow_run_id) if flow_run_id else None
        if hold is not None:  # the flow's cleanup ends it even if a signal lands before start returns
            hold(tracker)
        try:
            all_tags = {k: v for k, v in (tags or {}).items() if v not in (None, "")}
            if flow_run_id:
                all_tags["prefect.flow_run_id"] = str(flow_run_id)
            per_run = PER_RUN_KEYS if parent_run_id else ()
            if per_run:  # still on the run, but not among the params the compare view groups by
                flat = flatten_config(cfg)
                all_tags.update({k: flat[k] for k in per_run if flat.get(k) not in (None, "")})
            tracker.set_tags(all_tags)
            tracker.log_params(cfg, exclude=per_run)
            if cfg.tracking.log_system_metrics:
                tracker._start_system_metrics(cfg)
        except BaseException as exc:  # a run created here is never left RUNNING
            tracker.end("FAILED" if isinstance(exc, Exception) else "KILLED")
            raise
        return tracker

    def _start_system_metrics(self, cfg: TrainConfig) -> None:
        """CPU/memory/disk/network (and GPU with nvidia-ml-py) under system/*, sampled by MLflow's monitor."""
        from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor

        interval = max(1.0, min(10.0, cfg.supervision.supervise_interval_s * 5))
        try:
            monitor = SystemMetricsMonitor(
                self.run_id,
                sampling_interval=interval,
                samples_before_logging=1,
                resume_logging=False,
                tracking_uri=self.uri,
            )
            monitor.start()
        except Exception as exc:  # psutil missing, say: the run goes on without system metrics
            logging.getLogger("tracking").warning("system metrics are off: %s", exc)
            self.set_tags({"system_metrics": f"off: {exc}"[:500]})
            return
        self.system_monitor = monitor

    def end(self, status: str) -> None:
        """End the run FINISHED / FAILED / KILLED (idempotent: the first status wins)."""
        if self.ended is not None:
            return
        if status not in TERMINAL_STATUSES:
            raise ValueError(f"status must be one of {TERMINAL_STATUSES}, got {status!r}")
        try:
            self.flush()
        except Exception as exc:  # the run still ends with its status; the log names what was not written
            logging.getLogger("tracking").warning("metrics not written to MLflow: %s", exc)
        if self.writer is not None:
            self.writer.shutdown(wait=True)
            self.writer = None
        if self.system_monitor is not None:
            monitor, self.system_monitor = self.system_monitor, None
            try:
                monitor.finish()
                # one closing sample: a run shorter than the sampling interval would otherwise log none
                monitor.collect_metrics()
                monitor.publish_metrics(monitor.aggregate_metrics())
                monitor.mlflow_logger.flush()
            except Exception:
                pass
        self.client.set_terminated(self.run_id, status=status)
        self.ended = status

    # ------------------------------------------------------------------ logging
    def set_tags(self, tags: dict[str, Any]) -> None:
        from mlflow.entities import RunTag

        if tags:
            self.client.log_batch(self.run_id, tags=[RunTag(k, str(v)) for k, v in tags.items()])

    def log_params(self, cfg: TrainConfig, exclude: Iterable[str] = ()) -> None:
        """flatten_config(cfg) as params (but the keys in `exclude`), ≤100 per call."""
        from mlflow.entities import Param

        skip = set(exclude)
        params = {k: str(v)[:PARAM_VALUE_MAX] for k, v in flatten_config(cfg).items() if k not in skip}
        items = sorted(params.items())
        for s in range(0, len(items), PARAM_BATCH):
            self.client.log_batch(self.run_id, params=[Param(k, v) for k, v in items[s : s + PARAM_BATCH]])

    def log_metrics(self, rows: Iterable[dict], step_key: str = "step", wait: bool = True) -> int:
        """One MLflow metric point per numeric key of each row, at step = row[step_key]. Returns the count.
        `wait=False` (the supervision's per-poll metrics) queues the write on this run's writer thread and returns
        at once (it waits only when METRICS_IN_FLIGHT writes are queued); a write that failed raises at the next
        call, and `flush`, `end` and `metric_history` wait for every queued one. (Not MLflow's own asynchronous
        logging: ending a run that used it waits up to a second for MLflow's queue thread.)"""
        from mlflow.entities import Metric

        self._raise_failed()
        now = int(time.time() * 1000)
        points = []
        for row in rows:
            step = int(row.get(step_key, 0))
            for key, value in numeric_metrics(row).items():
                points.append(Metric(key, value, now, step))
        if wait:
            self._write(points)
        elif points:
            if self.writer is None:
                self.writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="atrlhf-mlflow-metrics")
            while len(self.in_flight) >= METRICS_IN_FLIGHT:
                self.in_flight.pop(0).result()
            self.in_flight.append(self.writer.submit(self._write, points))
        return len(points)

    def _write(self, points: list) -> None:
        for s in range(0, len(points), METRIC_BATCH):
            self.client.log_batch(self.run_id, metrics=points[s : s + METRIC_BATCH])

    def _raise_failed(self) -> None:
        """The queued writes that ended are dropped; the first that failed raises its error."""
        done = [w for w in self.in_flight if w.done()]  # once: one ending meanwhile stays queued for the next call
        self.in_flight = [w for w in self.in_flight if w not in done]
        for written in done:
            written.result()

    def flush(self) -> None:
        """Wait for every queued metrics write (log_metrics(wait=False)); raises if one failed."""
        in_flight, self.in_flight = self.in_flight, []
        for written in in_flight:
            written.result()

    def log_metrics_at(self, metrics: dict, step: int) -> None:
        self.log_metrics([{**metrics, "step": step}])

    def log_dict(self, data: Any, artifact_file: str) -> None:
        self.client.log_dict(self.run_id, data, artifact_file)

    # ------------------------------------------------------------------ reading back
    def metric_history(self, key: str) -> list:
        self.flush()
        return self.client.get_metric_history(self.run_id, key)

    def lineage_history(self) -> tuple[list[dict], list[dict]]:
        """The per-step reward/mean and the held-out evaluations of the runs this one resumed (each up to the
        step its successor resumed from), oldest first: what plots prepend to show the whole lineage."""
        segments = []
        run_id, until = self.parent_run_id, self.resumed_from_step
        while run_id and until is not None and len(segments) < 100:
            rows = {}
            for key in ("reward/mean", "eval/accuracy"):
                for m in self.client.get_metric_history(run_id, key):
                    if m.step <= until:
                        rows.setdefault((key, m.step), m.value)
            segments.append(rows)
            tags = self.client.get_run(run_id).data.tags
            run_id = tags.get(RESUMED_FROM_RUN)
            until = int(tags[RESUMED_FROM_STEP]) if run_id and RESUMED_FROM_STEP in tags else None
        history, evals = [], []
        for rows in reversed(segments):
            history += [
                {"step": s, "reward/mean": v}
                for (k, s), v in sorted(rows.items(), key=lambda x: x[0][1])
                if k == "reward/mean"
            ]
            evals += [
                {"step": s, "eval/accuracy": v}
                for (k, s), v in sorted(rows.items(), key=lambda x: x[0][1])
                if k == "eval/accuracy"
            ]
        return history, evals
