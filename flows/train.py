"""The training flow: launch the Ray runtime, supervise it to cfg.trainer.total_steps, record everything.

    launch (task) -> open the MLflow run (task) -> evaluate at the start (task)
    the trainer's loop and each rollout worker's loop, task runs that span the run (submitted; they wait on
        their Ray actors; in lockstep at runtime.max_staleness 0)
    supervise, beside them: every supervision.supervise_interval_s, one Supervisor tick (poll, health checks
        and their actions: sync weights, throttle, top up prompts, fail), then metrics to MLflow, the
        checkpoints the trainer wrote every checkpoint.every steps (task), an evaluation every
        eval.every steps (task), the progress artifact and a progress line
    finish: final evaluation, checkpoint, HF export, model + plots to MLflow, summary and health-event
        artifacts -> teardown (task)

What the run holds and how it is released (the runtime, the MLflow run, the run directory; signals during
cleanup) is `flows.lifecycle.RunResources`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from prefect import flow, get_run_logger
from prefect.artifacts import (
    create_markdown_artifact,
    create_progress_artifact,
    create_table_artifact,
    update_progress_artifact,
)
from prefect.futures import wait
from prefect.runtime import flow_run as current_flow_run
from prefect.states import Cancelled

from flows.lifecycle import RunResources, raise_if_pending, sigterm_kept
from flows.progress import (
    CancelWatch,
    audit_markdown,
    event_rows,
    ledger_of,
    log_audit,
    mismatch_markdown,
    pacing,
    progress_line,
    summary_markdown,
)
from flows.terminal import quiet_terminal
from rlhf_core.config import TrainConfig, validate_config
from rlhf_core.run.preflight import LATEST, claim_run_dir, default_run_name
from rlhf_core.run.supervise import Every, Sinks
from rlhf_core.run.supervise import supervise as run_supervision
from rlhf_core.supervision import HealthEvent
from tasks.checkpoints import ResumeTarget, export_policy, record_checkpoint, resolve_resume, save_checkpoint
from tasks.cluster import (
    evaluate_heldout,
    evaluate_pinned,
    launch_runtime,
    rollout_loop,
    teardown_runtime,
    trainer_loop,
    warm_start_policy,
)
from tasks.tracking import link_mlflow_run, log_model, log_plots, start_tracking
from tracking import MlflowTracker, ui_command
from tracking.errors import ErrorTexts
from tracking.traces import trace_evaluation

CANCEL_CHECK_INTERVAL_S = 1.0
HEARTBEAT_S = 30.0
LOOP_END_WAIT_S = 30.0  # for the loops' task runs to record their end once the loops are stopped


@flow(name="atrlhf-train", validate_parameters=False, log_prints=True)
def train(
    config: TrainConfig = TrainConfig(),
    resume_from: Optional[str] = None,
    mlflow_parent_run_id: Optional[str] = None,
    mlflow_tags: Optional[dict[str, str]] = None,
) -> dict:
    """Asynchronous (or lockstep) RL fine-tuning of a language model on Ray, supervised by Prefect.

    `config` is the whole run (rlhf_core.config.TrainConfig; a dict is validated the same way and a bad
    field fails the run before anything starts). `resume_from` is a checkpoint directory or an MLflow run
    id (its newest complete checkpoint is downloaded; the resumed run is a new MLflow run that names it).

    Returns the final metrics, eval/accuracy_start and eval/accuracy, the MLflow run id, and the
    checkpoint and export paths.
    """
    quiet_terminal()  # as `atrlhf train` does; here for a worker's (deployment's) process: its console stays readable
    logger = get_run_logger()
    cfg = validate_config(config, " (flow parameter 'config')")
    if not cfg.run.name:  # each run its own directory under run.output_dir
        cfg = cfg.model_copy(deep=True)
        cfg.run.name = default_run_name(current_flow_run.name or "")
    flow_run_id = str(current_flow_run.id) if current_flow_run.id else ""

    resume = resolve_resume(cfg, resume_from)  # a bad checkpoint fails before the run directory exists
    if resume.finished:  # nothing to train: said so, nothing started, nothing written
        return {"nothing_to_train": resume.finished, "flow_run_id": flow_run_id}
    with RunResources(logger) as resources:
        resources.hold(claim_run_dir(cfg.run.output_dir, cfg.run.name))
        logger.info(
            "run directory %s (%s points to it once it holds a checkpoint)",
            cfg.run.run_dir,
            Path(cfg.run.output_dir) / LATEST,
        )
        with sigterm_kept():  # ray.init would leave SIGTERM to sys.exit
            runtime, info = launch_runtime(cfg, resume.checkpoint, hold=resources.hold)
        tracker = start_tracking(
            cfg,
            flow_run_id,
            resume.mlflow_run_id,
            tags={
                "prefect.flow_run_name": current_flow_run.name or "",
                **({"resumed_from": resume_from} if resume_from else {}),  # only on resumed runs
                "atrlhf.run_dir": str(resources.run_dir.path),
                **(mlflow_tags or {}),
            },
            resume_step=resume.step if resume.checkpoint else None,
            parent_run_id=mlflow_parent_run_id,
            hold=resources.hold,
        )
        link_mlflow_run(flow_run_id, tracker.uri, tracker.experiment_id, tracker.run_id)
        logger.info(
            "MLflow run %s in experiment %s (%s); UI: %s",
            tracker.run_id,
            tracker.experiment_id,
            tracker.uri,
            ui_command(tracker.uri),
        )
        run = RunState(cfg, runtime, tracker, logger, step=info["step"], run_dir=resources.run_dir)

        evaluate_at_start(run, resume)
        if not supervise(run, CancelWatch(flow_run_id)):
            resources.status = "KILLED"
            return Cancelled(
                message="Flow run was cancelled; the runtime was torn down and the MLflow run ended KILLED."
            )
        result = finish(run)
        teardown_runtime(run.runtime)
        result["flow_run_id"] = flow_run_id
        result["run_dir"] = str(resources.run_dir.path)
        resources.status = "FINISHED"
        return result


@dataclass
class RunState:
    """One run as the flow sees it: its parts and what it has recorded so far."""

    cfg: TrainConfig
    runtime: Any  # rlhf_core.distributed.DistributedRun
    tracker: MlflowTracker
    logger: Any
    step: int = 0
    run_dir: Any = None  # rlhf_core.run.preflight.RunDirClaim: output_dir/latest moves here at the first checkpoint
    eval_start: Optional[float] = None  # held-out accuracy at the lineage's start (before its first step)
    eval_resumed: Optional[float] = None  # held-out accuracy at the step this run resumed at
    history: list[dict] = field(default_factory=list)  # per-step trainer metrics
    evals: list[dict] = field(default_factory=list)  # held-out evaluations, with their step
    last_metrics: dict = field(default_factory=dict)
    final_poll: dict = field(default_factory=dict)
    events: list[HealthEvent] = field(default_factory=list)
    errors: ErrorTexts = field(default_factory=ErrorTexts)  # the agents' error texts (MLflow: agent_errors.json)
    audit: dict = field(default_factory=dict)  # the run audit's latest report (rlhf_core.supervision.audit)

    @property
    def checkpoint_facts(self) -> dict:
        """What every checkpoint records about the run, for resuming it."""
        return {"eval_start": self.eval_start, "mlflow_run_id": self.tracker.run_id}


# ------------------------------------------------------------------------------------------- the run
def evaluate_at_start(run: RunState, resume: ResumeTarget) -> None:
    """Held-out accuracy before training. On resume, eval_start stays the lineage's start (the value the original
    run recorded) and the accuracy at the resume point is measured as eval/accuracy_resumed."""
    if resume.eval_start is not None:
        run.eval_start = resume.eval_start
        run.logger.info("start-up: the held-out evaluation at the resume point (step %d)", run.step)
        at_resume = evaluate_heldout(run.runtime, run.step)
        run.eval_resumed = at_resume["eval/accuracy"]
        run.evals.append({**at_resume, "step": run.step})
        run.tracker.log_metrics_at({**at_resume, "eval/accuracy_resumed": run.eval_resumed}, run.step)
        return
    run.logger.info("start-up: the first held-out evaluation (before training)")
    first = evaluate_heldout(run.runtime, run.step)
    trace_evaluation(run.tracker, first, run.step)  # a multi-turn run's episodes as MLflow traces
    run.eval_start = first["eval/accuracy"]
    run.evals.append({**first, "step": run.step})
    run.tracker.log_metrics_at({**first, "eval/accuracy_start": run.eval_start}, run.step)
    if run.cfg.trainer.warm_start.steps:
        run.tracker.log_metrics_at(warm_start_policy(run.runtime, run.cfg.trainer.warm_start.steps), run.step)


def supervise(run: RunState, cancel: CancelWatch) -> bool:
    """Poll, act and record until the trainer reaches total_steps: the one supervision loop
    (rlhf_core.run.supervise), with MLflow and Prefect as its sinks. Returns False when the run was cancelled."""
    cfg, total = run.cfg, run.cfg.trainer.total_steps
    lines = Every(cfg.run.log_every, run.step)
    progress_id = create_progress_artifact(
        progress=100.0 * run.step / total, key="atrlhf-progress", description=f"trainer steps out of {total}"
    )
    last_line = time.monotonic()

    def tick(poll: dict) -> None:
        nonlocal last_line
        raise_if_pending()  # a Ctrl-C whose KeyboardInterrupt a finalizer swallowed
        now = time.monotonic()
        if lines.due(run.step) or poll["done"] or now - last_line > HEARTBEAT_S:
            run.logger.info(
                progress_line(run.step, total, run.last_metrics, run.evals[-1] if run.evals else None, poll)
            )
            update_progress_artifact(artifact_id=progress_id, progress=100.0 * min(run.step, total) / total)
            last_line = now

    def cancelled() -> bool:
        if not cancel.requested():
            return False
        run.logger.warning("cancellation requested at step %d: stopping the loops", run.step)
        return True

    run.logger.info(
        "training %s to step %d (from step %d); loss %s, %d rollout worker(s)",
        pacing(cfg),
        total,
        run.step,
        cfg.algorithm.loss,
        cfg.rollout.num_workers,
    )
    run.runtime.run_facts = run.checkpoint_facts  # the trainer writes its own checkpoints with these
    loops: list = []
    evaluating: list = []  # (task run, versions it waits for) of the pinned evaluations
    uploading: list = []  # the record-checkpoint task runs in flight, oldest first (each waits for the one before)
    sinks = Sinks(
        on_event=lambda ev: _log_event(run.logger, ev),
        on_poll=lambda poll: _record(run, poll),
        on_checkpoint=lambda c: _record_checkpoint(run, c, uploading),
        evaluate=lambda step: _evaluate_pinned(run, evaluating),
        on_tick=tick,
        cancelled=cancelled,
        cancel_check_s=CANCEL_CHECK_INTERVAL_S,
        after_stop=lambda: wait(loops + [f for f, _ in evaluating], timeout=LOOP_END_WAIT_S),  # their task runs end
        on_audit=lambda report: setattr(run, "audit", report),
    )
    run.events = sinks.events
    loops.extend(watch_loops(run, start=True))
    try:
        finished = run_supervision(cfg, run.runtime, run.step, sinks)
        _uploaded(uploading)  # the last checkpoint is in MLflow before the run's final records (its failure fails)
    finally:  # final on every way out: finished, failed or cancelled
        wait(uploading)  # an upload is never cut off mid-way
        log_audit(run.tracker, run.audit, run.logger)
    run.events = sinks.events
    if finished:
        update_progress_artifact(artifact_id=progress_id, progress=100.0)
    return finished


def watch_loops(run: RunState, start: bool = False) -> list:
    """One task run per long-running loop (the trainer's, each rollout worker's), submitted to run
    beside the supervision for as long as the loop does; a worker Ray restarted is a new attempt of its task.
    start: start the loops first (the supervision's own start is then a no-op)."""
    cfg = run.cfg
    if start:
        run.runtime.start()
    workers = rollout_loop.with_options(retries=cfg.cluster.max_restarts)
    return [
        trainer_loop.submit(run.runtime, cfg.trainer.total_steps),
        *(workers.submit(run.runtime, i) for i in range(cfg.rollout.num_workers)),
    ]


def finish(run: RunState) -> dict:
    """Final evaluation, checkpoint, export and records; returns the run's result."""
    cfg, tracker = run.cfg, run.tracker
    for result in run.runtime.evaluations():  # pinned evaluations that finished after the last poll
        _record_eval(run, result)
    final_eval = _evaluate(run)
    checkpoint = _recorded(run, save_checkpoint(run.runtime, cfg, run.step, tracker, run=run.checkpoint_facts))
    exported = export_policy(run.runtime, cfg)
    if cfg.tracking.log_model:
        log_model(tracker, exported, step=run.step)
    plots = log_plots(
        tracker, run.history, (run.final_poll.get("trainer") or {}).get("staleness_hist") or {}, run.evals
    )
    rows = event_rows(run.events)
    tracker.log_dict(rows, "health_events.json")

    result = {k: v for k, v in run.last_metrics.items() if isinstance(v, (int, float))}
    result.update(final_eval)
    result.update(
        {
            "eval/accuracy_start": run.eval_start,
            **({"eval/accuracy_resumed": run.eval_resumed} if run.eval_resumed is not None else {}),
            "resumed_at": run.tracker.resumed_from_step,
            "steps": run.step,
            "mlflow_run_id": tracker.run_id,
            "mlflow_experiment_id": tracker.experiment_id,
            "mlflow_tracking_uri": tracker.uri,
            "checkpoint": checkpoint,
            "export": exported,
            "health_events": len(rows),
        }
    )
    tracker.log_metrics_at({"eval/accuracy_start": run.eval_start}, run.step)

    create_table_artifact(
        table=rows
        or [
            {
                "step": run.step,
                "kind": "none",
                "severity": "info",
                "action": "none",
                "detail": "no health events",
                "time": "",
            }
        ],
        key="atrlhf-health-events",
        description="Health events found by the supervising flow",
    )
    create_markdown_artifact(
        markdown=summary_markdown(cfg, result, tracker)
        + mismatch_markdown(run.evals)
        + audit_markdown(run.audit)
        + plots.markdown,
        key="atrlhf-summary",
        description="Run summary",
    )
    resumed = f", {run.eval_resumed:.3f} at the resume" if run.eval_resumed is not None else ""
    run.logger.info(
        "done: step %d, held-out accuracy %.3f (%.3f at the %s%s); MLflow run %s; policy exported to %s",
        run.step,
        result["eval/accuracy"],
        run.eval_start,
        "lineage's start" if run.eval_resumed is not None else "start",
        resumed,
        tracker.run_id,
        exported,
    )
    return result


# ------------------------------------------------------------------------------------------- helpers


def _record(run: RunState, poll: dict) -> None:
    """A poll's step and trainer metrics into the run state and MLflow."""
    run.step, run.final_poll = poll["step"], poll
    run.errors.update(poll, run.tracker, run.step)
    if poll["metrics"]:
        run.history.extend(poll["metrics"])
        run.tracker.log_metrics(poll["metrics"], wait=False)  # written while the supervision goes on
        run.last_metrics = poll["metrics"][-1]


def _record_checkpoint(run: RunState, written: dict, uploading: list) -> None:
    """A checkpoint the trainer wrote: output_dir/latest points to the run now, and its MLflow upload and retention
    run as a task run beside the supervision (a large model's upload must not hold up the polls), in step order:
    each starts once the one before has ended (`wait_for`; several may arrive in one poll; after a failed one the
    later ones do not run: Prefect leaves them NotReady). An upload that failed raises here at the next checkpoint,
    or at the end, and ends the run, as it did when the supervision uploaded each itself."""
    _recorded(run, written["path"])
    for done in [f for f in uploading[:-1] if f.state.is_final()]:  # the newest stays: the next one waits for it
        uploading.remove(done)
        done.result()
    uploading.append(record_checkpoint.submit(run.tracker, written["path"], written["step"], wait_for=uploading[-1:]))


def _uploaded(uploading: list) -> None:
    """Wait for the record-checkpoint task runs in flight, oldest first; raises the first one's error."""
    while uploading:
        uploading.pop(0).result()


def _recorded(run: RunState, checkpoint: str) -> str:
    """A checkpoint is on disk: the run has produced something, so output_dir/latest points to it now."""
    if run.run_dir is not None:
        run.run_dir.point_latest()
    return checkpoint


def _evaluate(run: RunState) -> dict:
    result = evaluate_heldout(run.runtime, run.step)
    trace_evaluation(run.tracker, result, run.step)  # a multi-turn run's episodes as MLflow traces
    run.evals.append({**result, **ledger_of(run.last_metrics), "step": run.step})  # ledger: the summary's table
    run.tracker.log_metrics_at(result, run.step)
    return result


def _evaluate_pinned(run: RunState, evaluating: list) -> None:
    """eval.every: a pinned evaluation of the newest published version, off the critical path (its own task run
    while it runs; one at a time: a request meanwhile replaces the version waiting)."""
    version = run.runtime.submit_evaluation()  # pinned now, at the version the trainer published last
    if evaluating and not evaluating[-1][0].state.is_final():
        evaluating[-1][1].append(version)  # the running task run records it too
        return
    wanted = [version]
    evaluating.append((evaluate_pinned.submit(run.runtime, wanted, lambda result: _record_eval(run, result)), wanted))


def _record_eval(run: RunState, result: dict) -> None:
    version = int(result["eval/version"])  # logged at the step of the version it evaluated
    trace_evaluation(run.tracker, result, version)
    run.evals.append({**result, **ledger_of(run.last_metrics), "step": version})
    run.tracker.log_metrics_at({k: v for k, v in result.items() if k != "skipped"}, version)


def _log_event(logger, ev: HealthEvent) -> None:
    level = {"error": logger.error, "warning": logger.warning}.get(ev.severity, logger.info)
    level("health: %s at step %d -> %s: %s", ev.kind, ev.step, ev.action, ev.detail)
