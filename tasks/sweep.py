"""A sweep's parts outside the flow: its points, its id, its MLflow parent run, and the comparison of its children.

flows/sweep.py runs the points; this module says what the points are (`expand_grid`), names the sweep
(`sweep_id`), opens or reopens the MLflow parent run (`SweepRecord`), finds the points a previous attempt
finished (`SweepRecord.finished_points`), and turns the children's MLflow histories into the comparison
table (`comparison_row`) and plot (`comparison_plot`). Tags, all on the parent and every child:

    atrlhf.sweep_id      the sweep's id (a hash of base config, grid and seeds, or the user's --sweep-id)
    atrlhf.sweep_role    parent | child
    atrlhf.sweep_point   the child's point name (children only), e.g. algorithm.loss=m2po,seed=1
    <varied key>         the child's value of each varied key, e.g. runtime.max_staleness=4 (also a param)
"""

from __future__ import annotations

import csv
import hashlib
import io
import itertools
import json
import math
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from rlhf_core.config import ConfigError, TrainConfig, apply_overrides
from tasks.tracking import (
    MLFLOW_PARENT_RUN,
    PARAM_VALUE_MAX,
    MlflowTracker,
    _client,
    resolve_tracking_uri,
)

SWEEP_ID_TAG = "atrlhf.sweep_id"
SWEEP_ROLE_TAG = "atrlhf.sweep_role"
SWEEP_POINT_TAG = "atrlhf.sweep_point"
SEED_KEY = "trainer.seed"
TABLE_COLUMNS = (
    "point",
    "final eval/accuracy",
    "best eval/accuracy",
    "time to target (s)",
    "mean staleness",
    "samples/s",
    "steps",
    "status",
    "error",
)


@dataclass(frozen=True)
class SweepPoint:
    """One training run of a sweep: the varied values (grid order) and its trainer.seed."""

    values: tuple[tuple[str, Any], ...]
    seed: int

    @property
    def name(self) -> str:
        """Readable and unique in the sweep: `algorithm.loss=m2po,runtime.max_staleness=4,seed=1`."""
        return ",".join([*(f"{k}={_text(v)}" for k, v in self.values), f"seed={self.seed}"])

    @property
    def dirname(self) -> str:
        """The name as a directory name (no '/', no '=')."""
        return "".join(c if c.isalnum() or c in "-_." else "_" for c in self.name.replace("=", "-"))

    @property
    def group(self) -> str:
        """The point without its seed: what the plot averages over seeds."""
        return ",".join(f"{k}={_text(v)}" for k, v in self.values) or "base"

    def tags(self, sweep: str) -> dict[str, str]:
        return {
            SWEEP_ID_TAG: sweep,
            SWEEP_ROLE_TAG: "child",
            SWEEP_POINT_TAG: self.name,
            **{k: _text(v) for k, v in self.values},
            SEED_KEY: str(self.seed),
        }


def _text(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value)


def seed_list(base: TrainConfig, seeds: int | list[int]) -> list[int]:
    """`seeds` as a count (base trainer.seed, +1, +2, ...) or an explicit list."""
    if isinstance(seeds, bool) or not isinstance(seeds, (int, list)):
        raise ConfigError(f"sweep seeds: expected a count or a list of integers, got {seeds!r}")
    if isinstance(seeds, int):
        if seeds < 1:
            raise ConfigError(f"sweep seeds: the count must be at least 1, got {seeds}")
        return [base.trainer.seed + i for i in range(seeds)]
    if not seeds or not all(isinstance(s, int) and not isinstance(s, bool) for s in seeds):
        raise ConfigError(f"sweep seeds: expected a non-empty list of integers, got {seeds!r}")
    return list(seeds)


def check_grid(grid: dict[str, list]) -> dict[str, list]:
    """A grid is {dotted.key: [values]}. Only its shape is checked here: values are validated per point."""
    if not isinstance(grid, dict):
        raise ConfigError(f"sweep grid: expected a mapping of dotted keys to lists of values, got {grid!r}")
    for key, values in grid.items():
        if not isinstance(key, str) or not key or any(not part for part in key.split(".")):
            raise ConfigError(f"sweep grid: {key!r} is not a dotted config key such as runtime.max_staleness")
        if not isinstance(values, list) or not values:
            raise ConfigError(f"sweep grid: {key} needs a non-empty list of values, got {values!r}")
        if key == SEED_KEY:
            raise ConfigError(f"sweep grid: vary {SEED_KEY} with `seeds`, not in the grid")
    return grid


def expand_grid(grid: dict[str, list], seeds: list[int]) -> list[SweepPoint]:
    """Every combination of the grid's values (grid order, the last key fastest), times every seed."""
    keys = list(grid)
    return [
        SweepPoint(tuple(zip(keys, combo)), seed)
        for combo in itertools.product(*(grid[k] for k in keys))
        for seed in seeds
    ]


def sweep_id(base: TrainConfig, grid: dict[str, list], seeds: list[int]) -> str:
    """Deterministic: the same base config, grid and seeds give the same id (what a rerun resumes by)."""
    blob = json.dumps({"base": base.model_dump(mode="json"), "grid": grid, "seeds": seeds}, sort_keys=True)
    return "sweep-" + hashlib.sha256(blob.encode()).hexdigest()[:10]


def point_config(base: TrainConfig, point: SweepPoint, sweep: str) -> dict:
    """The child's config as a plain mapping, NOT validated (the child validates it: a bad value fails only
    that child). Its own output directory `<run.output_dir>/<sweep id>/<point>` and run name."""
    data = base.model_dump(mode="json")
    apply_overrides(data, [f"{k}={json.dumps(v)}" for k, v in point.values])
    apply_overrides(
        data,
        [
            f"{SEED_KEY}={point.seed}",
            f"run.output_dir={json.dumps(f'{base.run.output_dir}/{sweep}/{point.dirname}')}",
            f"tracking.run_name={json.dumps(f'{sweep}/{point.name}')}",
        ],
    )
    return data


# ------------------------------------------------------------------------------------------ MLflow parent
class SweepRecord:
    """The sweep's MLflow parent run: opened on the first attempt, reopened (RUNNING again) on a rerun."""

    def __init__(self, base: TrainConfig, sweep: str):
        self.uri = resolve_tracking_uri(base)
        self.client = _client(self.uri)
        self.sweep = sweep
        self.experiment_id = MlflowTracker._experiment_id(self.client, base.tracking.experiment, self.uri)
        self.run_id: Optional[str] = None
        self.resumed = False

    def open(self, params: dict[str, Any], flow_run_id: str) -> str:
        from mlflow.entities import Param, RunTag

        found = self.client.search_runs(
            [self.experiment_id],
            filter_string=f"tags.`{SWEEP_ID_TAG}` = '{self.sweep}' and tags.`{SWEEP_ROLE_TAG}` = 'parent'",
            order_by=["attributes.start_time ASC"],
            max_results=1,
        )
        if found:
            self.run_id, self.resumed = found[0].info.run_id, True
            self.client.update_run(self.run_id, status="RUNNING")
        else:
            run = self.client.create_run(
                self.experiment_id,
                run_name=self.sweep,
                tags={
                    SWEEP_ID_TAG: self.sweep,
                    SWEEP_ROLE_TAG: "parent",
                    "mlflow.source.name": "flows/sweep.py:sweep",
                    "mlflow.source.type": "JOB",
                },
            )
            self.run_id = run.info.run_id
            self.client.log_batch(
                self.run_id, params=[Param(k, _text(v)[:PARAM_VALUE_MAX]) for k, v in sorted(params.items())]
            )
        self.client.log_batch(self.run_id, tags=[RunTag("prefect.flow_run_id", flow_run_id)] if flow_run_id else [])
        return self.run_id

    def children(self) -> list:
        return self.client.search_runs(
            [self.experiment_id],
            filter_string=f"tags.`{MLFLOW_PARENT_RUN}` = '{self.run_id}'",
            order_by=["attributes.start_time ASC"],
            max_results=5000,
        )

    def finished_points(self) -> dict[str, str]:
        """{point name: child run id} of the points a child finished (FINISHED) in any attempt."""
        return {
            r.data.tags[SWEEP_POINT_TAG]: r.info.run_id
            for r in self.children()
            if r.info.status == "FINISHED" and SWEEP_POINT_TAG in r.data.tags
        }

    def child_of(self, point: SweepPoint) -> Optional[Any]:
        """The point's newest child run (a FINISHED one first), or None when the child never opened one."""
        runs = [r for r in self.children() if r.data.tags.get(SWEEP_POINT_TAG) == point.name]
        done = [r for r in runs if r.info.status == "FINISHED"]
        return (done or runs or [None])[-1]

    def opened_by(self, point: SweepPoint, flow_run_id: str) -> bool:
        """Whether this attempt's child flow run opened an MLflow run for the point (else the flow records a
        FAILED one, so that every attempt at a point shows in the parent)."""
        return any(
            r.data.tags.get(SWEEP_POINT_TAG) == point.name and r.data.tags.get("prefect.flow_run_id") == flow_run_id
            for r in self.children()
        )

    def record_failed_point(self, point: SweepPoint, error: str, flow_run_id: str) -> str:
        """A FAILED child run for a point that failed before its training run opened one (a bad value): the
        parent shows every point."""
        from mlflow.entities import RunTag

        run = self.client.create_run(
            self.experiment_id,
            run_name=f"{self.sweep}/{point.name}",
            tags={MLFLOW_PARENT_RUN: self.run_id, **point.tags(self.sweep)},
        )
        tags = {"error": error[:5000]}
        if flow_run_id:
            tags["prefect.flow_run_id"] = flow_run_id
        self.client.log_batch(run.info.run_id, tags=[RunTag(k, v) for k, v in tags.items()])
        self.client.set_terminated(run.info.run_id, status="FAILED")
        return run.info.run_id

    def log_comparison(self, rows: list[dict], markdown: str, png: Optional[bytes], metric: str) -> None:
        self.client.log_text(self.run_id, table_csv(rows), "comparison/comparison.csv")
        self.client.log_text(self.run_id, markdown, "comparison/comparison.md")
        self.client.log_dict(self.run_id, rows, "comparison/comparison.json")
        if png is not None:
            with tempfile.TemporaryDirectory() as tmp:
                path = Path(tmp) / plot_name(metric)
                path.write_bytes(png)
                self.client.log_artifact(self.run_id, str(path), "comparison")

    def end(self, failed: int, skipped: int, total: int) -> None:
        from mlflow.entities import Metric, RunTag

        now = int(time.time() * 1000)
        self.client.log_batch(
            self.run_id,
            metrics=[Metric("sweep/points", total, now, 0), Metric("sweep/failed", failed, now, 0)],
            tags=[RunTag("atrlhf.sweep_failed_points", str(failed)), RunTag("atrlhf.sweep_skipped", str(skipped))],
        )
        self.client.set_terminated(self.run_id, status="FINISHED" if not failed else "FAILED")


def plot_name(metric: str) -> str:
    return "sweep_" + metric.replace("/", "_") + ".png"


# ----------------------------------------------------------------------------------------- comparison
@dataclass
class ChildHistory:
    """What the comparison reads back from one child run."""

    point: SweepPoint
    status: str
    error: str = ""
    note: str = ""
    run_id: str = ""
    start_ms: int = 0
    histories: dict[str, list[tuple[int, float, int]]] = field(default_factory=dict)  # key -> (step, value, ms)


def read_child(record: SweepRecord, point: SweepPoint, metric: str, error: str = "", note: str = "") -> ChildHistory:
    run = record.child_of(point)
    if run is None:
        return ChildHistory(point, "FAILED", error=error or "no MLflow run was opened", note=note)
    keys = {"eval/accuracy", "async/staleness_mean", "throughput/samples_per_s", metric}
    histories = {
        k: sorted((m.step, m.value, m.timestamp) for m in record.client.get_metric_history(run.info.run_id, k))
        for k in keys
    }
    return ChildHistory(
        point,
        run.info.status,
        error=error or run.data.tags.get("error", ""),
        note=note,
        run_id=run.info.run_id,
        start_ms=run.info.start_time or 0,
        histories=histories,
    )


def _mean(values: list[float]) -> Optional[float]:
    values = [v for v in values if math.isfinite(v)]
    return sum(values) / len(values) if values else None


def comparison_row(child: ChildHistory, target: float) -> dict:
    """One table row: the varied values, final and best eval/accuracy, seconds from the child's start to the
    first evaluation at or above `target` (None: never reached), mean staleness, mean samples/s, status."""
    acc = child.histories.get("eval/accuracy", [])
    reached = next(((ms - child.start_ms) / 1000.0 for _, v, ms in acc if v >= target), None)
    steps = [s for h in child.histories.values() for s, _, _ in h]
    row: dict[str, Any] = {"point": child.point.name}
    row.update({k: v for k, v in child.point.values})
    row[SEED_KEY] = child.point.seed
    row.update(
        {
            "final eval/accuracy": acc[-1][1] if acc else None,
            "best eval/accuracy": max(v for _, v, _ in acc) if acc else None,
            "time to target (s)": round(reached, 1) if reached is not None else None,
            "mean staleness": _mean([v for _, v, _ in child.histories.get("async/staleness_mean", [])]),
            "samples/s": _mean([v for _, v, _ in child.histories.get("throughput/samples_per_s", [])]),
            "steps": max(steps) if steps else 0,
            "status": child.status + (f" ({child.note})" if child.note else ""),
            "error": " ".join(child.error.split()),  # one line: a CSV row per point
            "mlflow_run_id": child.run_id,
        }
    )
    return row


def _cell(value: Any) -> str:
    if value is None:
        return "—"
    if isinstance(value, float):
        return f"{value:.3g}"
    return str(value).replace("|", "\\|").replace("\n", " ")


def table_columns(rows: list[dict]) -> list[str]:
    varied = [k for k in (rows[0] if rows else {}) if k not in TABLE_COLUMNS and k != "mlflow_run_id"]
    return [*varied, *(c for c in TABLE_COLUMNS if c != "point")]


def table_markdown(rows: list[dict], target: float) -> str:
    cols = table_columns(rows)
    head = [c if c != "time to target (s)" else f"time to acc ≥ {target:g} (s)" for c in cols]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(_cell(r.get(c)) for c in cols) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def table_csv(rows: list[dict]) -> str:
    out = io.StringIO()
    cols = ["point", *table_columns(rows), "mlflow_run_id"]
    writer = csv.DictWriter(out, fieldnames=cols, extrasaction="ignore")
    writer.writeheader()
    writer.writerows(rows)
    return out.getvalue()


def comparison_plot(children: list[ChildHistory], metric: str) -> Optional[bytes]:
    """PNG of `metric` against steps: one line per group of points that differ only in seed (the mean over
    seeds at each step), shaded between the seeds' min and max. None when no child logged the metric."""
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    groups: dict[str, dict[int, list[float]]] = {}
    for child in children:
        for step, value, _ in child.histories.get(metric, []):
            groups.setdefault(child.point.group, {}).setdefault(step, []).append(value)
    if not groups:
        return None
    fig, ax = plt.subplots(figsize=(7, 4))
    for name, by_step in groups.items():
        steps = sorted(by_step)
        mean = [sum(by_step[s]) / len(by_step[s]) for s in steps]
        ax.plot(steps, mean, marker="o" if len(steps) < 30 else None, label=name)
        ax.fill_between(steps, [min(by_step[s]) for s in steps], [max(by_step[s]) for s in steps], alpha=0.2)
    ax.set_xlabel("trainer step")
    ax.set_ylabel(metric)
    ax.set_title(f"{metric}: mean over seeds, shaded min–max")
    ax.legend(loc="best", fontsize=7)
    fig.tight_layout()
    out = io.BytesIO()
    fig.savefig(out, format="png", dpi=80)
    plt.close(fig)
    return out.getvalue()
