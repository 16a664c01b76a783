"""A sweep in MLflow: its parent run, opened on the first attempt and reopened (RUNNING again) on a rerun, and
its children (one training run per point). Tags, all on the parent and every child:

    atrlhf.sweep_id      the sweep's id (a hash of base config, grid and seeds, or the user's --sweep-id)
    atrlhf.sweep_role    parent | child
    atrlhf.sweep_point   the child's point name (children only), e.g. algorithm.loss=m2po,seed=1
    <varied key>         the child's value of each varied key, e.g. runtime.max_staleness=4 (also a param)
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path
from typing import Any, Optional

from rlhf_core.config import TrainConfig
from rlhf_core.sweep_grid import SEED_KEY, SweepPoint, value_text
from tracking.runs import (
    MLFLOW_PARENT_RUN,
    PARAM_VALUE_MAX,
    client,
    experiment_id,
    resolve_tracking_uri,
)

SWEEP_ID_TAG = "atrlhf.sweep_id"
SWEEP_ROLE_TAG = "atrlhf.sweep_role"
SWEEP_POINT_TAG = "atrlhf.sweep_point"


def point_tags(point: SweepPoint, sweep: str) -> dict[str, str]:
    """The tags of a point's child run: the sweep, its role, the point's name, each varied value and trainer.seed."""
    return {
        SWEEP_ID_TAG: sweep,
        SWEEP_ROLE_TAG: "child",
        SWEEP_POINT_TAG: point.name,
        **{k: value_text(v) for k, v in point.values},
        SEED_KEY: str(point.seed),
    }


def plot_name(metric: str) -> str:
    """The file name of the comparison plot of `metric`."""
    return "sweep_" + metric.replace("/", "_") + ".png"


class SweepRecord:
    """The sweep's MLflow parent run: opened on the first attempt, reopened (RUNNING again) on a rerun."""

    def __init__(self, base: TrainConfig, sweep: str):
        self.uri = resolve_tracking_uri(base)
        self.client = client(self.uri)
        self.sweep = sweep
        self.experiment_id = experiment_id(self.client, base.tracking.experiment, self.uri)
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
                self.run_id, params=[Param(k, value_text(v)[:PARAM_VALUE_MAX]) for k, v in sorted(params.items())]
            )
        self.client.log_batch(self.run_id, tags=[RunTag("prefect.flow_run_id", flow_run_id)] if flow_run_id else [])
        return self.run_id

    def log_base_config(self, base: TrainConfig) -> None:
        """The sweep's base config as the parent's artifact base_config.json."""
        self.client.log_dict(self.run_id, base.model_dump(mode="json"), "base_config.json")

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
            run_name=point.run_name(self.sweep),
            tags={MLFLOW_PARENT_RUN: self.run_id, **point_tags(point, self.sweep)},
        )
        tags = {"error": error[:5000]}
        if flow_run_id:
            tags["prefect.flow_run_id"] = flow_run_id
        self.client.log_batch(run.info.run_id, tags=[RunTag(k, v) for k, v in tags.items()])
        self.client.set_terminated(run.info.run_id, status="FAILED")
        return run.info.run_id

    def metric_history(self, run_id: str, key: str) -> list[tuple[int, float, int]]:
        """(step, value, timestamp ms) of one metric of a child run, by step."""
        return sorted((m.step, m.value, m.timestamp) for m in self.client.get_metric_history(run_id, key))

    def log_comparison(self, csv_text: str, rows: list[dict], markdown: str, png: Optional[bytes], metric: str) -> None:
        """The comparison as the parent's artifacts under comparison/ (CSV, markdown, JSON rows, the plot)."""
        self.client.log_text(self.run_id, csv_text, "comparison/comparison.csv")
        self.client.log_text(self.run_id, markdown, "comparison/comparison.md")
        self.client.log_dict(self.run_id, rows, "comparison/comparison.json")
        if png is not None:
            with tempfile.TemporaryDirectory() as tmp:
                path = Path(tmp) / plot_name(metric)
                path.write_bytes(png)
                self.client.log_artifact(self.run_id, str(path), "comparison")

    def fail(self) -> None:
        """End the parent FAILED (the sweep stopped before its comparison)."""
        self.client.set_terminated(self.run_id, status="FAILED")

    def end(self, failed: int, skipped: int, total: int) -> None:
        from mlflow.entities import Metric, RunTag

        now = int(time.time() * 1000)
        self.client.log_batch(
            self.run_id,
            metrics=[Metric("sweep/points", total, now, 0), Metric("sweep/failed", failed, now, 0)],
            tags=[RunTag("atrlhf.sweep_failed_points", str(failed)), RunTag("atrlhf.sweep_skipped", str(skipped))],
        )
        self.client.set_terminated(self.run_id, status="FINISHED" if not failed else "FAILED")
