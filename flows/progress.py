"""What the training flow shows of a run: health-event rows, the progress line, the reward's breakdown, the
run summary and audit, and whether the flow run was asked to cancel.

The supervision policy itself (HealthMonitor, Supervisor) lives in rlhf_core.supervision; this module holds
only presentation and the Prefect-side cancellation check (no @task: tasks/ holds the flow's task runs).
"""

from __future__ import annotations

from typing import Any, Optional

from rlhf_core.config import TrainConfig
from rlhf_core.supervision import HealthEvent
from rlhf_core.supervision.audit import AUDIT_FILE, audit_table
from tracking import MlflowTracker, run_url, ui_command


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


def pacing(cfg: TrainConfig) -> str:
    """How rollout and training interleave, in words: lockstep at max_staleness 0, else the bound (or the
    autopilot's range)."""
    pilot = cfg.runtime.autopilot
    if pilot.enabled:
        return f"async (staleness autopilot, tau {pilot.min_staleness}..{pilot.max_staleness})"
    tau = cfg.runtime.max_staleness
    return "lockstep (tau = 0)" if tau == 0 else f"async (tau <= {tau})"


def fmt(value: Any) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def summary_markdown(cfg: TrainConfig, result: dict, tracker: MlflowTracker) -> str:
    keys = [
        "eval/accuracy_start",
        "eval/accuracy_resumed",
        "eval/accuracy",
        "eval/reward_mean",
        "eval/pass@k",
        "eval/mean@k",
        "reward/mean",
        *reward_component_keys(result),  # what the reward is made of: correctness apart from format
        "loss/policy",
        "policy/entropy",
        "async/staleness_mean",
        "throughput/samples_per_s",
        "steps",
        "health_events",
    ]
    rows = "\n".join(f"| `{k}` | {fmt(result[k])} |" for k in keys if k in result)
    url = run_url(tracker.uri, tracker.experiment_id, tracker.run_id)
    model = cfg.model.path or "tiny default"
    lines = [
        "# AsyncTensorRLHF run summary",
        "",
        f"**{cfg.algorithm.loss}**, **{pacing(cfg)}**, task `{cfg.data.task}`, model `{model}`, "
        f"{cfg.trainer.total_steps} trainer steps.",
        "",
        "| metric | value |",
        "|---|---|",
        rows,
        "",
    ]
    if result.get("resumed_at") is not None:
        lines += [
            f"Resumed at step {result['resumed_at']}: `eval/accuracy_start` is the lineage's start (before its first "
            "step), `eval/accuracy_resumed` the accuracy at the resume point.",
            "",
        ]
    if reward_component_keys(result):
        terms = [*cfg.reward.components.items(), *((f.metric_name, f.weight) for f in cfg.reward.functions)]
        weights = " + ".join(f"{w:g} x {name}" for name, w in terms)
        if cfg.reward.model.path:
            weights += f" + {cfg.reward.model.weight:g} x reward_model"
        lines += [
            f"`reward/<component>`: each reward component's mean over the last step's batch, unweighted "
            f"(`reward/mean` = {weights}).",
            "",
        ]
    if "eval/pass@k" in result:
        lines += [
            f"`eval/pass@k`, `eval/mean@k`: k = {cfg.eval.k} of {cfg.eval.n_samples} samples per held-out prompt "
            f"(temperature {cfg.eval.temperature:g}, top_p {cfg.eval.top_p:g}); in MLflow `eval/pass_at_k`, "
            "`eval/mean_at_k` (MLflow refuses '@').",
            "",
        ]
    lines += [
        f"- MLflow run: `{tracker.run_id}` (experiment `{cfg.tracking.experiment}`, store `{tracker.uri}`): "
        f"[{url}]({url}) — open the UI with `{ui_command(tracker.uri)}`",
        f"- Final checkpoint: `{result['checkpoint']}`",
        f"- Exported policy (Hugging Face directory): `{result['export']}`",
    ]
    if cfg.tracking.log_model:
        lines.append(
            f"- Load the logged model: `from tracking import load_logged_policy; "
            f'model, tok = load_logged_policy("{tracker.run_id}", "{tracker.uri}")`'
        )
    return "\n".join(lines) + "\n"
