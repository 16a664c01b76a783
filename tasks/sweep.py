"""Prefect tasks of a sweep: open its MLflow parent run, compare its points, publish the comparison.

The MLflow client code they call is `tracking` (sweep_record, sweep_comparison); the points
themselves are `rlhf_core.sweep_grid`.
"""

from __future__ import annotations

import base64
from typing import Any

from prefect import task
from prefect.artifacts import create_markdown_artifact, create_table_artifact
from prefect.cache_policies import NO_CACHE

from rlhf_core.config import TrainConfig
from rlhf_core.sweep_grid import SweepPoint
from tracking.runs import run_url, ui_command
from tracking.sweep_comparison import (
    ChildHistory,
    comparison_plot,
    comparison_row,
    display_rows,
    read_child,
    table_csv,
    table_markdown,
)
from tracking.sweep_record import SweepRecord, plot_name


@task(name="open-mlflow-sweep-run", cache_policy=NO_CACHE, persist_result=False)
def open_sweep_record(cfg: TrainConfig, sweep: str, params: dict[str, Any], flow_run_id: str) -> SweepRecord:
    """Open the sweep's MLflow parent run (reopen it on a rerun); a new one gets the grid as params and the
    base config as base_config.json."""
    record = SweepRecord(cfg, sweep)
    record.open(params, flow_run_id)
    if not record.resumed:
        record.log_base_config(cfg)
    return record


@task(name="compare-sweep-points", cache_policy=NO_CACHE, persist_result=False)
def compare_points(
    record: SweepRecord, points: list[SweepPoint], outcomes: dict[str, dict], metric: str, target: float
) -> tuple[list[dict], list[ChildHistory]]:
    """Every point's child run read back into a comparison row. A point of this attempt that failed before its
    training run opened an MLflow run gets a FAILED child run (the parent shows every point); a point with no
    outcome finished in an earlier attempt."""
    children = []
    for point in points:
        outcome = outcomes.get(point.name)
        if outcome is None:
            children.append(read_child(record, point, metric, note="done earlier"))
            continue
        if outcome["state"] != "COMPLETED" and not record.opened_by(point, outcome["flow_run_id"]):
            record.record_failed_point(point, outcome["message"], outcome["flow_run_id"])
        error = outcome["message"] if outcome["state"] != "COMPLETED" else ""
        children.append(read_child(record, point, metric, error=error))
    return [comparison_row(c, target) for c in children], children


@task(name="publish-sweep-comparison", cache_policy=NO_CACHE, persist_result=False)
def publish_comparison(
    record: SweepRecord, rows: list[dict], children: list[ChildHistory], metric: str, target: float
) -> None:
    """The comparison table and plot as Prefect artifacts (table + markdown with the plot inline) and as the
    MLflow parent's artifacts (comparison/comparison.csv, .md, .json and the PNG)."""
    png = comparison_plot(children, metric)
    url = run_url(record.uri, record.experiment_id, record.run_id)
    table = table_markdown(rows, target)
    markdown = "\n".join(
        [
            f"# Sweep {record.sweep}",
            "",
            table,
            f"Time to target: seconds from the child's start to its first `eval/accuracy` ≥ {target:g}. "
            "Mean staleness and samples/s: means over the run's steps.",
            "",
            f"MLflow parent run `{record.run_id}`: [{url}]({url}) — open the UI with `{ui_command(record.uri)}`; "
            f"the plot is `comparison/{plot_name(metric)}`.",
            "",
        ]
    )
    record.log_comparison(table_csv(rows), rows, markdown, png, metric)
    if png is not None:
        markdown += f"\n![{metric} against steps](data:image/png;base64,{base64.b64encode(png).decode()})\n"
    create_table_artifact(
        table=display_rows(rows),
        key="atrlhf-sweep-comparison",
        description=f"Sweep {record.sweep}: one row per point",
    )
    create_markdown_artifact(markdown=markdown, key="atrlhf-sweep-summary", description=f"Sweep {record.sweep}")
    print(table)
