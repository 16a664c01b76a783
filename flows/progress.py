"""What the training flow shows of a run: health-event rows, the progress line, the reward's breakdown,
and whether the flow run was asked to cancel.

The supervision policy itself (HealthMonitor, Supervisor) lives in rlhf_core.supervision; this module holds
only presentation and the Prefect-side cancellation check (no @task: tasks/ holds the flow's task runs).
"""

from __future__ import annotations

from typing import Optional

from rlhf_core.supervision import HealthEvent
from rlhf_core.supervision.audit import AUDIT_FILE, audit_table


def event_rows(events: list[HealthEvent]) -> list[dict]:
    return [e.row() for e in events]


LEDGER_KEYS = (
    "mismatch/engine_kl",
    "mismatch/drift_kl",
    "correction/weight_mean",
    "correction/weight_max",
    "correction/clipped_frac",
    "correction/masked_frac",
)
"""The mismatch ledger's step metrics (rlhf_core.trainer.ledger, algorithms.correction) kept with each evaluation."""


def ledger_of(metrics: dict) -> dict:
    """The ledger's values among a step's metrics (those present)."""
    return {k: metrics[k] for k in LEDGER_KEYS if k in metrics}


def mismatch_markdown(evals: list[dict]) -> str:
    """A small markdown table of the ledger at each evaluation (the trainer step before it); '' when none has it."""
    keys = [k for k in LEDGER_KEYS if any(k in e for e in evals)]
    if not keys:
        return ""
    head = "| step | eval/accuracy | " + " | ".join(f"`{k}`" for k in keys) + " |"
    rows = [
        f"| {e.get('step', '')} | {e.get('eval/accuracy', float('nan')):.3f} | "
        + " | ".join(f"{e[k]:.3g}" if k in e else "" for k in keys)
        + " |"
        for e in evals
        if any(k in e for k in keys)
    ]
    return "\n".join(["## Mismatch ledger per evaluation", "", head, "|" + "---|" * (len(keys) + 2), *rows, "", ""])


def reward_component_keys(metrics: dict) -> list[str]:
    """The `reward/<component>` keys of a step's metrics (every configured reward component's batch mean,
    unweighted), in the order logged; reward/mean and reward/std are not components."""
    return [k for k in metrics if k.startswith("reward/") and k not in ("reward/mean", "reward/std")]


def reward_breakdown(metrics: dict) -> str:
    """The step's mean reward and, where the reward has several components, what it is made of:
    "0.100 (answer_after_marker 0.000, format 1.000)" reads as no correct answers, all well formatted.
    Component values are unweighted batch means (reward/mean is their weighted sum)."""
    text = f"{metrics['reward/mean']:.3f}"
    keys = [k for k in reward_component_keys(metrics) if "/" not in k[len("reward/") :]]  # not <fn>/failed etc.
    if len(keys) > 1:
        text += " (" + ", ".join(f"{k[len('reward/') :]} {metrics[k]:.3f}" for k in keys) + ")"
    return text


def progress_line(step: int, total: int, metrics: dict, last_eval: Optional[dict], poll: dict) -> str:
    """One compact terminal line: step/total, reward (and its components, when several), held-out accuracy,
    staleness, throughput, buffer."""
    parts = [f"step {step}/{total}"]
    if "reward/mean" in metrics:
        parts.append(f"reward {reward_breakdown(metrics)}")
    if last_eval:
        parts.append(f"acc {last_eval['eval/accuracy']:.3f}@{last_eval['step']}")
    if "async/staleness_mean" in metrics:
        parts.append(f"staleness {metrics['async/staleness_mean']:.2f}/{int(metrics.get('async/staleness_max', 0))}")
    if "throughput/samples_per_s" in metrics:
        parts.append(f"{metrics['throughput/samples_per_s']:.0f} samples/s")
    if "loss/policy" in metrics:
        parts.append(f"loss {metrics['loss/policy']:+.4f}")
    if "buffer/size" in metrics or poll.get("buffer"):
        parts.append(f"buffer {int(metrics.get('buffer/size', (poll.get('buffer') or {}).get('size', 0)))}")
    return " | ".join(parts)


class CancelWatch:
    """Asks the Prefect API whether this flow run was asked to cancel (from the UI, the CLI or a client).

    A worker or `serve` process also cancels by SIGTERM (Prefect raises TerminationSignal in the flow);
    this covers flows run in-process (`atrlhf train`, tests), where no process supervises the run.
    """

    def __init__(self, flow_run_id: Optional[str]):
        self.flow_run_id = flow_run_id

    def requested(self) -> bool:
        if not self.flow_run_id:
            return False
        from prefect.client.orchestration import get_client

        try:
            with get_client(sync_client=True) as client:
                state = client.read_flow_run(self.flow_run_id).state
        except Exception:  # the API being briefly unreachable is no reason to stop training
            return False
        return bool(state is not None and (state.is_cancelling() or state.is_cancelled()))


def audit_markdown(report: dict) -> str:
    """The run audit's table for the summary artifact (empty when the run kept no audit)."""
    return "\n" + audit_table(report) + "\n" if report else ""


def log_audit(tracker, report: dict, logger) -> None:
    """The run audit to MLflow (audit.json) and its verdict to the log; a failure to log it is a warning."""
    if not report:
        return
    try:
        tracker.log_dict(report, AUDIT_FILE)
    except Exception as exc:  # the tracking store may be what failed the run
        logger.warning("could not log %s to MLflow: %s", AUDIT_FILE, exc)
    flagged = [
        f"{c['name']} {c['verdict']}" for c in report.get("checks", ()) if c["verdict"] in ("inactive", "failed")
    ]
    logger.info("run audit: %s%s", report.get("verdict"), f" ({', '.join(flagged)})" if flagged else "")
