"""MLflow tracking for one training run: params, per-step metrics, plots, checkpoints, the final model.

One MLflow run per Prefect flow run, in experiment `cfg.tracking.experiment`. The MLflow run carries the
tag `prefect.flow_run_id`; the flow puts the MLflow run id on the Prefect flow run (tag and artifact).

The tracking URI is `cfg.tracking.tracking_uri` (which `validate_config` fills from MLFLOW_TRACKING_URI),
else `sqlite:///<cwd>/mlflow.db`; with a SQLite store, artifacts go to `mlartifacts/` beside the database.

The final policy is logged as a plain Hugging Face directory under the artifact path `model/`;
`load_logged_policy(run_id)` downloads it and loads it with `rlhf_core.models.load_policy`.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Optional

from prefect import task
from prefect.cache_policies import NO_CACHE

from rlhf_core.config import TrainConfig, flatten_config

MODEL_ARTIFACT_PATH = "model"
CHECKPOINT_ARTIFACT_PATH = "checkpoints"
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


def _numeric_metrics(metrics: dict) -> dict[str, float]:
    out = {}
    for key, value in metrics.items():
        if isinstance(value, bool):
            value = float(value)
        if isinstance(value, (int, float)) and key not in ("step",):
            out[key] = float(value)
    return out


class MlflowTracker:
    """The MLflow side of one run. Every call goes through an explicit MlflowClient (no global active run)."""

    def __init__(self, uri: str, run_id: str, experiment_id: str, resumed: bool):
        self.uri = uri
        self.client = _client(uri)
        self.run_id = run_id
        self.experiment_id = experiment_id
        self.resumed = resumed
        self.system_monitor = None
        self.ended: Optional[str] = None

    # ------------------------------------------------------------------ lifecycle
    @classmethod
    def start(
        cls,
        cfg: TrainConfig,
        flow_run_id: Optional[str] = None,
        resume_run_id: Optional[str] = None,
        tags: Optional[dict[str, str]] = None,
    ) -> MlflowTracker:
        """Create the run (or reopen `resume_run_id`), log params and tags, start system metrics."""
        from mlflow.entities import RunStatus

        uri = resolve_tracking_uri(cfg)
        client = _client(uri)
        if resume_run_id:
            run = client.get_run(resume_run_id)
            experiment_id = run.info.experiment_id
            client.update_run(resume_run_id, status=RunStatus.to_string(RunStatus.RUNNING))
            tracker = cls(uri, resume_run_id, experiment_id, resumed=True)
        else:
            experiment_id = cls._experiment_id(client, cfg.tracking.experiment, uri)
            run_tags = {"mlflow.source.name": "flows/train.py:train", "mlflow.source.type": "JOB"}
            run = client.create_run(experiment_id, run_name=cfg.tracking.run_name or None, tags=run_tags)
            tracker = cls(uri, run.info.run_id, experiment_id, resumed=False)
        all_tags = dict(tags or {})
        if flow_run_id:
            all_tags["prefect.flow_run_id"] = str(flow_run_id)
        tracker.set_tags(all_tags)
        tracker.log_params(cfg)
        if cfg.tracking.log_system_metrics:
            tracker._start_system_metrics(cfg)
        return tracker

    @staticmethod
    def _experiment_id(client, name: str, uri: str) -> str:
        from mlflow.exceptions import MlflowException

        exp = client.get_experiment_by_name(name)
        if exp is not None:
            return exp.experiment_id
        location = None
        db = _sqlite_path(uri)
        if db is not None:  # keep artifacts beside the database (what `mlflow ui` in that directory serves)
            location = (db.parent.resolve() / "mlartifacts" / name).as_uri()
        try:
            return client.create_experiment(name, artifact_location=location)
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
                resume_logging=self.resumed,
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
        """flatten_config(cfg) as params, ≤100 per call. On resume, values that changed (total_steps, say)
        cannot be overwritten in MLflow: they are recorded in the tag `resume.changed_params` instead."""
        from mlflow.entities import Param

        params = {k: str(v)[:PARAM_VALUE_MAX] for k, v in flatten_config(cfg).items()}
        if self.resumed:
            existing = self.client.get_run(self.run_id).data.params
            changed = {k: v for k, v in params.items() if k in existing and existing[k] != v}
            params = {k: v for k, v in params.items() if k not in existing}
            if changed:
                self.set_tags({"resume.changed_params": json.dumps(changed)[:PARAM_VALUE_MAX]})
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
        """A checkpoint directory as artifacts under checkpoints/<dir name>; returns the artifact path."""
        name = Path(local_dir).name
        path = f"{CHECKPOINT_ARTIFACT_PATH}/{name}"
        self.client.log_artifacts(self.run_id, str(local_dir), path)
        return path

    def log_model(self, export_dir: str | Path) -> str:
        """The exported Hugging Face directory as artifacts under model/ (load with load_logged_policy)."""
        self.client.log_artifacts(self.run_id, str(export_dir), MODEL_ARTIFACT_PATH)
        self.set_tags(
            {
                "model.artifact_path": MODEL_ARTIFACT_PATH,
                "model.load": f"tasks.tracking.load_logged_policy('{self.run_id}')",
            }
        )
        return MODEL_ARTIFACT_PATH

    def log_plots(self, history: list[dict], staleness_hist: dict, evals: list[dict]) -> list[str]:
        """Reward curve (with held-out accuracy) and staleness histogram as PNG artifacts."""
        import matplotlib

        matplotlib.use("Agg", force=False)
        import matplotlib.pyplot as plt

        written = []
        steps = [m["step"] for m in history if "reward/mean" in m]
        rewards = [m["reward/mean"] for m in history if "reward/mean" in m]
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
    """The artifact path of the newest checkpoint of an MLflow run (checkpoints/step_NNNNNN), or None."""
    client = _client(uri)
    entries = [e.path for e in client.list_artifacts(run_id, CHECKPOINT_ARTIFACT_PATH) if e.is_dir]
    return max(entries, key=lambda p: Path(p).name) if entries else None


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


def download_logged_policy(run_id: str, tracking_uri: Optional[str] = None, dst: Optional[str | Path] = None) -> Path:
    """Download the `model/` artifact of a run; returns the local Hugging Face directory."""
    uri = tracking_uri or os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{Path.cwd().resolve() / 'mlflow.db'}"
    dst = Path(dst) if dst else Path(tempfile.mkdtemp(prefix=f"atrlhf-model-{run_id[:8]}-"))
    return download_artifact(run_id, MODEL_ARTIFACT_PATH, uri, dst)


def load_logged_policy(run_id: str, tracking_uri: Optional[str] = None, dtype: str = "float32", device: str = "cpu"):
    """(model, tokenizer) of the policy a run logged under `model/`.

    >>> model, tokenizer = load_logged_policy("0123456789abcdef0123456789abcdef",
    ...                                       tracking_uri="sqlite:///mlflow.db")   # doctest: +SKIP
    """
    from rlhf_core.models import load_policy

    return load_policy(download_logged_policy(run_id, tracking_uri), dtype=dtype, device=device)


# ---------------------------------------------------------------------------------------- Prefect tasks
@task(name="start-mlflow-run", cache_policy=NO_CACHE, persist_result=False)
def start_tracking(
    cfg: TrainConfig,
    flow_run_id: Optional[str],
    resume_run_id: Optional[str] = None,
    tags: Optional[dict[str, str]] = None,
) -> MlflowTracker:
    """Open the MLflow run of this flow run (a new one, or the resumed run) and log the config as params."""
    return MlflowTracker.start(cfg, flow_run_id=flow_run_id, resume_run_id=resume_run_id, tags=tags)


@task(name="log-model", cache_policy=NO_CACHE, persist_result=False)
def log_model(tracker: MlflowTracker, export_dir: str) -> str:
    """Log the exported policy directory under model/ so that load_logged_policy can load it back."""
    return tracker.log_model(export_dir)


@task(name="log-plots", cache_policy=NO_CACHE, persist_result=False)
def log_plots(tracker: MlflowTracker, history: list[dict], staleness_hist: dict, evals: list[dict]) -> list[str]:
    """Reward curve and staleness histogram as PNG artifacts of the MLflow run."""
    return tracker.log_plots(history, staleness_hist, evals)
