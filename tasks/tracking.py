"""MLflow tracking for one training run: params, per-step metrics, plots, checkpoints, the final model.

One MLflow run per Prefect flow run, in experiment `cfg.tracking.experiment`. The MLflow run carries the
tag `prefect.flow_run_id` and, unless tracking.run_name says otherwise, the flow run's name; the flow puts
the MLflow run id on the Prefect flow run (tag and artifact). An experiment this module creates is tagged
`mlflow.experimentKind = custom_model_development`, so that MLflow 3's UI opens it on its runs (model
training) rather than on its GenAI traces view, where training runs do not show.

The tracking URI is `cfg.tracking.tracking_uri` (which `validate_config` fills from MLFLOW_TRACKING_URI),
else `sqlite:///<cwd>/mlflow.db`; with a SQLite store, artifacts go to `mlartifacts/` beside the database.

The final policy is logged as a plain Hugging Face directory twice over: as an MLflow 3 LoggedModel
(named `policy`, output of the run: it shows under the run's "Logged models", `models:/<model_id>`) and
under the run's artifact path `model/`. `load_logged_policy(run_id)` downloads it (from `model/`, else
from the run's logged model) and loads it with `rlhf_core.models.load_policy`.
"""

from __future__ import annotations

import os
import re
import tempfile
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, Optional

from prefect import task
from prefect.cache_policies import NO_CACHE

from rlhf_core.config import TrainConfig, flatten_config

MODEL_ARTIFACT_PATH = "model"  # where runs of earlier versions also copied the policy; still read
LOGGED_MODEL_NAME = "policy"
LOGGED_MODEL_TYPE = "hf-causal-lm"
EXPERIMENT_KIND_TAG = "mlflow.experimentKind"  # read by the MLflow 3 UI to pick the experiment's view
EXPERIMENT_KIND = "custom_model_development"  # (the other values: genai_development, finetuning, ...)
CHECKPOINT_ARTIFACT_PATH = "checkpoints"
CHECKPOINT_COMPLETE = "COMPLETE"  # written last into an uploaded checkpoint
RESUMED_FROM_RUN = "atrlhf.resumed_from_run"  # tags of a run that resumed another
RESUMED_FROM_STEP = "atrlhf.resumed_from_step"
MLFLOW_PARENT_RUN = "mlflow.parentRunId"  # MLflow's own tag: the UI nests a run under this parent
PARAM_BATCH = 100  # MLflow accepts at most 100 params per log_batch call
PARAM_VALUE_MAX = 6000  # and param values of at most 6000 characters
METRIC_BATCH = 1000  # and at most 1000 metrics per call
TERMINAL_STATUSES = ("FINISHED", "FAILED", "KILLED")


def _quiet_mlflow_env() -> None:
    """Offline and quiet defaults (telemetry off, no progress bars); explicit settings win."""
    for key, value in {"MLFLOW_DISABLE_TELEMETRY": "true", "MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR": "false"}.items():
        os.environ.setdefault(key, value)


def resolve_tracking_uri(cfg: TrainConfig) -> str:
    """cfg.tracking.tracking_uri, else sqlite:///<cwd>/mlflow.db (absolute, so every process agrees)."""
    if cfg.tracking.tracking_uri:
        return cfg.tracking.tracking_uri
    return f"sqlite:///{Path.cwd().resolve() / 'mlflow.db'}"


def _sqlite_path(uri: str) -> Optional[Path]:
    if uri.startswith("sqlite:///"):
        return Path(uri[len("sqlite:///") :])
    return None


def ui_command(uri: str) -> str:
    """The command that opens the MLflow UI on this store."""
    if uri.startswith(("http://", "https://")):
        return f"open {uri}"
    return f"mlflow ui --backend-store-uri {uri} --host 127.0.0.1 --port 5000"


def run_url(uri: str, experiment_id: str, run_id: str) -> str:
    """Where the run shows in the MLflow UI (a tracking server's own URL, or `mlflow ui`'s default)."""
    base = uri.rstrip("/") if uri.startswith(("http://", "https://")) else "http://127.0.0.1:5000"
    return f"{base}/#/experiments/{experiment_id}/runs/{run_id}"


def _client(uri: str):
    _quiet_mlflow_env()
    from mlflow.tracking import MlflowClient

    return MlflowClient(tracking_uri=uri)


def looks_like_run_id(text: str) -> bool:
    return len(text) == 32 and all(c in "0123456789abcdef" for c in text.lower())


_MLFLOW_ILLEGAL = re.compile(r"[^/\w.\- :]")


def mlflow_metric_name(key: str) -> str:
    """The name a metric is stored under in MLflow, which refuses '@' and most punctuation: '@' becomes '_at_'
    (MLflow's own autologging spelling: eval/pass@k -> eval/pass_at_k), anything else illegal '_'."""
    return _MLFLOW_ILLEGAL.sub("_", key.replace("@", "_at_"))


def _numeric_metrics(metrics: dict) -> dict[str, float]:
    """The numeric values of a metrics row, under their MLflow names (`mlflow_metric_name`)."""
    out = {}
    for key, value in metrics.items():
        if isinstance(value, bool):
            value = float(value)
        if isinstance(value, (int, float)) and key not in ("step",):
            out[mlflow_metric_name(key)] = float(value)
    return out


class MlflowTracker:
    """The MLflow side of one run. Every call goes through an explicit MlflowClient (no global active run)."""

    def __init__(
        self,
        uri: str,
        run_id: str,
        experiment_id: str,
        parent_run_id: Optional[str] = None,
        resumed_from_step: Optional[int] = None,
    ):
        self.uri = uri
        self.client = _client(uri)
        self.run_id = run_id
        self.experiment_id = experiment_id
        self.parent_run_id = parent_run_id  # the run this one resumed, if any
        self.resumed_from_step = resumed_from_step
        self.system_monitor = None
        self.ended: Optional[str] = None
        self.flow_run_id: Optional[str] = None  # the Prefect flow run that started it (held until it ends)

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
        in the parent's experiment), which MLflow's UI nests under it.

        The run is named cfg.tracking.run_name, else `run_name` (the Prefect flow run's name), else MLflow
        picks a name. `hold(tracker)` is called as soon as the run exists (the flow's cleanup then ends it, even
        if a signal lands before this returns)."""
        from mlflow.entities import RunStatus

        uri = resolve_tracking_uri(cfg)
        client = _client(uri)
        experiment_id = cls._experiment_id(client, cfg.tracking.experiment, uri)
        run_tags = {"mlflow.source.name": "flows/train.py:train", "mlflow.source.type": "JOB"}
        name = cfg.tracking.run_name or run_name or None
        if resume_run_id:  # a resumed run is a run of its own that names its parent and the step it resumed at
            parent = client.get_run(resume_run_id)
            experiment_id = parent.info.experiment_id
            run_tags.update({RESUMED_FROM_RUN: resume_run_id, RESUMED_FROM_STEP: str(int(resume_step or 0))})
            name = name or f"{parent.info.run_name}-resumed-{int(resume_step or 0)}"
            if parent.info.status == RunStatus.to_string(RunStatus.RUNNING):  # its driver died without ending it
                client.set_tag(
                    resume_run_id,
                    "atrlhf.ended",
                    "its driver stopped without ending the run; marked FAILED "
                    f"when it was resumed at step {int(resume_step or 0)}",
                )
                client.set_terminated(resume_run_id, status="FAILED")
        if parent_run_id:
            experiment_id = client.get_run(parent_run_id).info.experiment_id
            run_tags[MLFLOW_PARENT_RUN] = parent_run_id
        run = client.create_run(experiment_id, run_name=name, tags=run_tags)
        tracker = cls(uri, run.info.run_id, experiment_id, parent_run_id=resume_run_id, resumed_from_step=resume_step)
        tracker.flow_run_id = str(flow_run_id) if flow_run_id else None
        if hold is not None:  # the flow's cleanup ends it even if a signal lands before start returns
            hold(tracker)
        try:
            all_tags = dict(tags or {})
            if flow_run_id:
                all_tags["prefect.flow_run_id"] = str(flow_run_id)
            tracker.set_tags(all_tags)
            tracker.log_params(cfg)
            if cfg.tracking.log_system_metrics:
                tracker._start_system_metrics(cfg)
        except BaseException as exc:  # a run created here is never left RUNNING
            tracker.end("FAILED" if isinstance(exc, Exception) else "KILLED")
            raise
        return tracker

    @staticmethod
    def _experiment_id(client, name: str, uri: str) -> str:
        from mlflow.exceptions import MlflowException

        exp = client.get_experiment_by_name(name)
        if exp is not None:
            if EXPERIMENT_KIND_TAG not in exp.tags:  # made before this tag was set; a kind chosen in the UI stays
                try:
                    client.set_experiment_tag(exp.experiment_id, EXPERIMENT_KIND_TAG, EXPERIMENT_KIND)
                except MlflowException:  # a read-only or restricted store: the UI's view is cosmetic
                    pass
            return exp.experiment_id
        location = None
        db = _sqlite_path(uri)
        if db is not None:  # keep artifacts beside the database (what `mlflow ui` in that directory serves)
            location = (db.parent.resolve() / "mlartifacts" / name).as_uri()
        try:
            return client.create_experiment(
                name, artifact_location=location, tags={EXPERIMENT_KIND_TAG: EXPERIMENT_KIND}
            )
        except MlflowException:  # created concurrently by another run
            exp = client.get_experiment_by_name(name)
            if exp is None:
                raise
            return exp.experiment_id

    def _start_system_metrics(self, cfg: TrainConfig) -> None:
        """CPU/memory/disk/network (and GPU with nvidia-ml-py) under system/*, sampled by MLflow's monitor."""
        import logging

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
            logging.getLogger("tasks.tracking").warning("system metrics are off: %s", exc)
            self.set_tags({"system_metrics": f"off: {exc}"[:500]})
            return
        self.system_monitor = monitor

    def end(self, status: str) -> None:
        """End the run FINISHED / FAILED / KILLED (idempotent: the first status wins)."""
        if self.ended is not None:
            return
        if status not in TERMINAL_STATUSES:
            raise ValueError(f"status must be one of {TERMINAL_STATUSES}, got {status!r}")
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

    def log_params(self, cfg: TrainConfig) -> None:
        """flatten_config(cfg) as params, ≤100 per call."""
        from mlflow.entities import Param

        params = {k: str(v)[:PARAM_VALUE_MAX] for k, v in flatten_config(cfg).items()}
        items = sorted(params.items())
        for s in range(0, len(items), PARAM_BATCH):
            self.client.log_batch(self.run_id, params=[Param(k, v) for k, v in items[s : s + PARAM_BATCH]])

    def log_metrics(self, rows: Iterable[dict], step_key: str = "step") -> int:
        """One MLflow metric point per numeric key of each row, at step = row[step_key]. Returns the count."""
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        points = []
        for row in rows:
            step = int(row.get(step_key, 0))
            for key, value in _numeric_metrics(row).items():
                points.append(Metric(key, value, now, step))
        for s in range(0, len(points), METRIC_BATCH):
            self.client.log_batch(self.run_id, metrics=points[s : s + METRIC_BATCH])
        return len(points)

    def log_metrics_at(self, metrics: dict, step: int) -> None:
        self.log_metrics([{**metrics, "step": step}])

    def log_dict(self, data: Any, artifact_file: str) -> None:
        self.client.log_dict(self.run_id, data, artifact_file)

    def log_checkpoint(self, local_dir: str | Path) -> str:
        """A checkpoint directory as artifacts under checkpoints/<dir name>, marked complete LAST (a file
        COMPLETE), so that a driver killed mid-upload leaves a checkpoint that resume skips, never a half
        one that it downloads; returns the artifact path."""
        name = Path(local_dir).name
        path = f"{CHECKPOINT_ARTIFACT_PATH}/{name}"
        self.client.log_artifacts(self.run_id, str(local_dir), path)
        self.client.log_text(self.run_id, name, f"{path}/{CHECKPOINT_COMPLETE}")
        return path

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

    def log_model(self, export_dir: str | Path, step: Optional[int] = None) -> str:
        """The exported Hugging Face directory as an MLflow 3 LoggedModel output by this run: it shows under the
        run's "Logged models", stored once (runs logged by earlier versions also hold a model/ copy among the
        run's artifacts). Load it with load_logged_policy(run_id).

        Returns the model's URI, models:/<id>; the id is also the run tag `model.id`."""
        from mlflow.entities import LoggedModelOutput, LoggedModelStatus

        load = f"tasks.tracking.load_logged_policy('{self.run_id}')"
        model = self.client.create_logged_model(
            experiment_id=self.experiment_id,
            name=LOGGED_MODEL_NAME,
            source_run_id=self.run_id,
            tags={"format": "huggingface", "load": load},
            model_type=LOGGED_MODEL_TYPE,
        )
        try:
            self.client.log_model_artifacts(model.model_id, str(export_dir))
        except BaseException:
            self.client.finalize_logged_model(model.model_id, LoggedModelStatus.FAILED)
            raise
        self.client.finalize_logged_model(model.model_id, LoggedModelStatus.READY)
        self.client.log_outputs(self.run_id, [LoggedModelOutput(model.model_id, step=int(step or 0))])
        uri = f"models:/{model.model_id}"
        self.set_tags({"model.id": model.model_id, "model.uri": uri, "model.load": load})
        return uri

    def log_plots(self, history: list[dict], staleness_hist: dict, evals: list[dict]) -> list[str]:
        """Reward curve (with held-out accuracy) and staleness histogram as PNG artifacts; the curve's data as
        plots/reward_curve.json. A resumed run's curve starts with the runs it resumed (lineage_history)."""
        import matplotlib

        matplotlib.use("Agg", force=False)
        import matplotlib.pyplot as plt

        earlier_history, earlier_evals = self.lineage_history()
        history, evals = earlier_history + list(history), earlier_evals + list(evals)
        written = []
        steps = [m["step"] for m in history if "reward/mean" in m]
        rewards = [m["reward/mean"] for m in history if "reward/mean" in m]
        self.client.log_dict(
            self.run_id,
            {
                "reward/mean": {"step": steps, "value": rewards},
                "eval/accuracy": {"step": [e["step"] for e in evals], "value": [e["eval/accuracy"] for e in evals]},
            },
            "plots/reward_curve.json",
        )
        written.append("plots/reward_curve.json")
        fig, ax = plt.subplots(figsize=(6, 3.5))
        ax.plot(steps, rewards, label="reward/mean (train)")
        if evals:
            ax.plot(
                [e["step"] for e in evals], [e["eval/accuracy"] for e in evals], "o-", label="eval/accuracy (held-out)"
            )
        ax.set_xlabel("trainer step")
        ax.set_ylabel("reward / accuracy")
        ax.set_title("Reward curve")
        ax.legend(loc="best")
        fig.tight_layout()
        self.client.log_figure(self.run_id, fig, "plots/reward_curve.png")
        plt.close(fig)
        written.append("plots/reward_curve.png")

        fig, ax = plt.subplots(figsize=(5, 3.5))
        if staleness_hist:
            taus = sorted(int(t) for t in staleness_hist)
            ax.bar(taus, [staleness_hist.get(t, staleness_hist.get(str(t), 0)) for t in taus])
            ax.set_xticks(taus)
        ax.set_xlabel("staleness τ = trainer version − sample version")
        ax.set_ylabel("samples consumed")
        ax.set_title("Staleness histogram")
        fig.tight_layout()
        self.client.log_figure(self.run_id, fig, "plots/staleness_histogram.png")
        plt.close(fig)
        written.append("plots/staleness_histogram.png")
        return written

    # ------------------------------------------------------------------ reading back
    def metric_history(self, key: str) -> list:
        return self.client.get_metric_history(self.run_id, key)


def latest_checkpoint_artifact(run_id: str, uri: str) -> Optional[str]:
    """The artifact path of the newest COMPLETE checkpoint of an MLflow run (checkpoints/step_NNNNNN), or
    None. A checkpoint whose upload never finished (no COMPLETE marker) is skipped."""
    client = _client(uri)
    entries = sorted(
        (e.path for e in client.list_artifacts(run_id, CHECKPOINT_ARTIFACT_PATH) if e.is_dir),
        key=lambda p: Path(p).name,
        reverse=True,
    )
    for path in entries:
        if any(Path(f.path).name == CHECKPOINT_COMPLETE for f in client.list_artifacts(run_id, path)):
            return path
    return None


def download_artifact(run_id: str, artifact_path: str, uri: str, dst: str | Path) -> Path:
    _quiet_mlflow_env()
    import mlflow.artifacts

    Path(dst).mkdir(parents=True, exist_ok=True)
    return Path(
        mlflow.artifacts.download_artifacts(
            run_id=run_id, artifact_path=artifact_path, dst_path=str(dst), tracking_uri=uri
        )
    )


def run_exists(run_id: str, uri: str) -> bool:
    from mlflow.exceptions import MlflowException

    try:
        _client(uri).get_run(run_id)
        return True
    except MlflowException:
        return False


def logged_model_id(run_id: str, uri: str) -> Optional[str]:
    """The id of the policy LoggedModel a run output (run tag `model.id`, else a search by source run), or None."""
    client = _client(uri)
    run = client.get_run(run_id)
    if run.data.tags.get("model.id"):
        return run.data.tags["model.id"]
    found = client.search_logged_models(
        experiment_ids=[run.info.experiment_id],
        filter_string=f"source_run_id = '{run_id}' AND name = '{LOGGED_MODEL_NAME}'",
        max_results=1,
    )
    return found[0].model_id if found else None


def download_logged_policy(run_id: str, tracking_uri: Optional[str] = None, dst: Optional[str | Path] = None) -> Path:
    """Download the policy a run logged (its `model/` artifact, else its LoggedModel) into `dst` (default: a new
    temporary directory that the caller removes); returns the local Hugging Face directory."""
    uri = tracking_uri or os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{Path.cwd().resolve() / 'mlflow.db'}"
    dst = Path(dst) if dst else Path(tempfile.mkdtemp(prefix=f"atrlhf-model-{run_id[:8]}-"))
    if _client(uri).list_artifacts(run_id, MODEL_ARTIFACT_PATH):
        return download_artifact(run_id, MODEL_ARTIFACT_PATH, uri, dst)
    model_id = logged_model_id(run_id, uri)
    if model_id is None:
        raise FileNotFoundError(f"MLflow run {run_id} in {uri} logged no model (no model/ artifact, no LoggedModel)")
    import mlflow.artifacts

    location = _client(uri).get_logged_model(model_id).artifact_location
    dst.mkdir(parents=True, exist_ok=True)
    return Path(mlflow.artifacts.download_artifacts(artifact_uri=location, dst_path=str(dst), tracking_uri=uri))


def load_logged_policy(run_id: str, tracking_uri: Optional[str] = None, dtype: str = "float32", device: str = "cpu"):
    """(model, tokenizer) of the policy a run logged (its LoggedModel).

    >>> model, tokenizer = load_logged_policy("0123456789abcdef0123456789abcdef",
    ...                                       tracking_uri="sqlite:///mlflow.db")   # doctest: +SKIP
    """
    from rlhf_core.models import load_policy

    with tempfile.TemporaryDirectory(prefix=f"atrlhf-model-{run_id[:8]}-") as scratch:  # removed once loaded
        return load_policy(download_logged_policy(run_id, tracking_uri, scratch), dtype=dtype, device=device)


# ---------------------------------------------------------------------------------------- Prefect tasks
@task(name="start-mlflow-run", cache_policy=NO_CACHE, persist_result=False)
def start_tracking(
    cfg: TrainConfig,
    flow_run_id: Optional[str],
    resume_run_id: Optional[str] = None,
    tags: Optional[dict[str, str]] = None,
    run_name: Optional[str] = None,
    resume_step: Optional[int] = None,
    parent_run_id: Optional[str] = None,
    hold: Optional[Callable[[MlflowTracker], object]] = None,
) -> MlflowTracker:
    """Open the MLflow run of this flow run and log the config as params. A resumed run is a new MLflow run
    that names the run it resumed (`resume_run_id`) and the step (`resume_step`). With `parent_run_id` it is
    a child of that run (a sweep's parent). `hold`: see MlflowTracker.start.

    It is named cfg.tracking.run_name, else `run_name`, else this flow run's name."""
    if not run_name:
        from prefect.runtime import flow_run

        run_name = flow_run.name or None
    return MlflowTracker.start(
        cfg,
        flow_run_id=flow_run_id,
        resume_run_id=resume_run_id,
        tags=tags,
        run_name=run_name,
        resume_step=resume_step,
        parent_run_id=parent_run_id,
        hold=hold,
    )


@task(name="log-model", cache_policy=NO_CACHE, persist_result=False)
def log_model(tracker: MlflowTracker, export_dir: str, step: Optional[int] = None) -> str:
    """Log the exported policy as the run's LoggedModel; load_logged_policy(run_id) loads it back."""
    return tracker.log_model(export_dir, step=step)


@task(name="log-plots", cache_policy=NO_CACHE, persist_result=False)
def log_plots(tracker: MlflowTracker, history: list[dict], staleness_hist: dict, evals: list[dict]) -> list[str]:
    """Reward curve and staleness histogram as PNG artifacts of the MLflow run."""
    return tracker.log_plots(history, staleness_hist, evals)
