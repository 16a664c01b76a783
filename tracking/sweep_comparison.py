"""A sweep's comparison: its children's MLflow histories read back (`read_child`), one table row per point
(`comparison_row`, as markdown or CSV) and a plot of a metric against steps, mean and spread over seeds
(`comparison_plot`)."""

from __future__ import annotations

import csv
import io
import math
from dataclasses import dataclass, field
from typing import Any, Optional

from rlhf_core.sweep_grid import SEED_KEY, SweepPoint
from tracking.sweep_record import SweepRecord

TIME_TO_TARGET = "time to target (s)"
NOT_REACHED = "not reached"  # a point's time to target when no evaluation reached it
TABLE_COLUMNS = (
    "point",
    "final eval/accuracy",
    "best eval/accuracy",
    TIME_TO_TARGET,
    "mean staleness",
    "samples/s",
    "steps",
    "status",
    "error",
)


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
    return ChildHistory(
        point,
        run.info.status,
        error=error or run.data.tags.get("error", ""),
        note=note,
        run_id=run.info.run_id,
        start_ms=run.info.start_time or 0,
        histories={k: record.metric_history(run.info.run_id, k) for k in keys},
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
            TIME_TO_TARGET: round(reached, 1) if reached is not None else None,
            "mean staleness": _mean([v for _, v, _ in child.histories.get("async/staleness_mean", [])]),
            "samples/s": _mean([v for _, v, _ in child.histories.get("throughput/samples_per_s", [])]),
            "steps": max(steps) if steps else 0,
            "status": child.status + (f" ({child.note})" if child.note else ""),
            "error": " ".join(child.error.split()),  # one line: a CSV row per point
            "mlflow_run_id": child.run_id,
        }
    )
    return row


def display_value(column: str, value: Any) -> Any:
    """A table value as a reader sees it: floats to 3 significant digits, a missing time to target "not reached"."""
    if value is None and column == TIME_TO_TARGET:
        return NOT_REACHED
    if isinstance(value, float) and math.isfinite(value):
        return float(f"{value:.3g}")
    return value


def display_rows(rows: list[dict]) -> list[dict]:
    """The rows as the Prefect table artifact shows them (display_value)."""
    return [{k: display_value(k, v) for k, v in row.items()} for row in rows]


def _cell(column: str, value: Any) -> str:
    value = display_value(column, value)
    if value is None:
        return "—"
    if isinstance(value, float):
        return f"{value:g}"
    return str(value).replace("|", "\\|").replace("\n", " ")


def table_columns(rows: list[dict]) -> list[str]:
    varied = [k for k in (rows[0] if rows else {}) if k not in TABLE_COLUMNS and k != "mlflow_run_id"]
    return [*varied, *(c for c in TABLE_COLUMNS if c != "point")]


def table_markdown(rows: list[dict], target: float) -> str:
    cols = table_columns(rows)
    head = [c if c != TIME_TO_TARGET else f"time to acc ≥ {target:g} (s)" for c in cols]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(_cell(c, r.get(c)) for c in cols) + " |" for r in rows]
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
