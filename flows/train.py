"""The training flow: launch the Ray runtime, supervise it to cfg.trainer.total_steps, record everything.

    launch (task) -> evaluate at start (task) -> start the loops
    every supervision.supervise_interval_s (sync mode: every lockstep step):
        poll stats -> log metrics to MLflow -> health checks and their actions (sync weights, throttle,
        top up prompts, fail) -> checkpoint every tracking.checkpoint_every steps (task) -> evaluate every
        tracking.eval_every steps (task) -> progress artifact and a progress line
    final checkpoint, held-out evaluation, HF export, model + plots to MLflow, summary and health-event
    artifacts -> teardown (task)

The runtime is torn down on success, failure and cancellation (try/finally in the flow; the flow hooks
cover what escapes it), and the MLflow run ends FINISHED, FAILED or KILLED to match the flow run.
"""

from __future__ import annotations

import time
from typing import Any, Optional

from prefect import flow, get_run_logger
from prefect.artifacts import (create_link_artifact, create_markdown_artifact, create_progress_artifact,
                               create_table_artifact, update_progress_artifact)
from prefect.exceptions import TerminationSignal
from prefect.runtime import flow_run as current_flow_run
from prefect.states import Cancelled

from rlhf_core.config import TrainConfig, validate_config
from tasks.checkpoints import ResumeTarget, export_policy, resolve_resume, save_checkpoint
from tasks.cluster import evaluate_heldout, launch_runtime, teardown_runtime
from tasks.supervision import CancelWatch, HealthMonitor, SupervisionError, event_rows, progress_line
from tasks.tracking import MlflowTracker, log_model, log_plots, run_url, start_tracking, ui_command

# Live runtimes and trackers by flow run id, so that the state hooks can clean up whatever the flow body's
# own try/finally did not (it normally does; the hooks are the second line).
_LIVE: dict[str, dict[str, Any]] = {}
CANCEL_CHECK_INTERVAL_S = 1.0
HEARTBEAT_S = 30.0


def _release(flow_run_id: str, status: str) -> None:
    live = _LIVE.pop(flow_run_id, {})
    runtime, tracker = live.get("runtime"), live.get("tracker")
    if runtime is not None:
        runtime.teardown()
    if tracker is not None:
        tracker.end(status)


def _hook(status: str):
    def hook(flow, flow_run, state) -> None:
        _release(str(flow_run.id), status)
    hook.__name__ = f"release_runtime_{status.lower()}"
    return hook


@flow(name="atrlhf-train", validate_parameters=False, log_prints=True,
      on_failure=[_hook("FAILED")], on_crashed=[_hook("FAILED")], on_cancellation=[_hook("KILLED")])
def train(config: TrainConfig = TrainConfig(), resume_from: Optional[str] = None) -> dict:
    """Asynchronous (or lockstep) RL fine-tuning of a language model on Ray, supervised by Prefect.

    `config` is the whole run (rlhf_core.config.TrainConfig; a dict is validated the same way and a bad
    field fails the run before anything starts). `resume_from` is a checkpoint directory or an MLflow run
    id (its newest checkpoint is downloaded, and logging continues in that MLflow run).

    Returns the final metrics, eval/accuracy_start and eval/accuracy, the MLflow run id, and the
    checkpoint and export paths.
    """
    logger = get_run_logger()
    cfg = validate_config(config, " (flow parameter 'config')")
    flow_run_id = str(current_flow_run.id) if current_flow_run.id else ""
    resume = resolve_resume(cfg, resume_from)

    runtime = tracker = None
    status = "FAILED"
    try:
        runtime, info = launch_runtime(cfg, resume.checkpoint)
        _LIVE[flow_run_id] = {"runtime": runtime}
        tracker = start_tracking(cfg, flow_run_id, resume.mlflow_run_id,
                                 tags={"prefect.flow_run_name": current_flow_run.name or "",
                                       "resumed_from": resume_from or ""})
        _LIVE[flow_run_id]["tracker"] = tracker
        _link_mlflow_run(tracker, flow_run_id, logger)

        result = _supervise(cfg, runtime, tracker, info, resume, logger, CancelWatch(flow_run_id))
        if result is None:
            status = "KILLED"
            return Cancelled(message="Flow run was cancelled; the runtime was torn down and the MLflow run ended KILLED.")
        teardown_runtime(runtime)
        result["flow_run_id"] = flow_run_id
        status = "FINISHED"
        return result
    except (KeyboardInterrupt, TerminationSignal, SystemExit):
        status = "KILLED"
        logger.warning("interrupted: tearing down the runtime and ending the MLflow run as KILLED")
        raise
    except BaseException as exc:
        logger.error("run failed: %s: %s", type(exc).__name__, exc)
        if tracker is not None:
            try:
                tracker.set_tags({"error": f"{type(exc).__name__}: {exc}"[:5000]})
            except Exception:
                pass
        raise
    finally:
        # the MLflow status first (one quick write): a worker kills the process if teardown outlasts its grace period
        if tracker is not None:
            _shielded(lambda: tracker.end(status), logger, "ending the MLflow run")
        if runtime is not None:
            _shielded(runtime.teardown, logger, "teardown")  # idempotent; a no-op after the teardown task
        _LIVE.pop(flow_run_id, None)


def _shielded(fn, logger, what: str, attempts: int = 3) -> None:
    """Run a cleanup step to completion even if a second SIGTERM (TerminationSignal) or Ctrl-C lands in it:
    a worker cancelling the run may signal while the flow is already tearing down on its own."""
    for _ in range(attempts):
        try:
            fn()
            return
        except (KeyboardInterrupt, TerminationSignal, SystemExit):
            logger.warning("%s interrupted by a signal; finishing it", what)
        except Exception as exc:
            logger.error("%s failed: %s: %s", what, type(exc).__name__, exc)
            return


def _supervise(cfg: TrainConfig, runtime, tracker: MlflowTracker, info: dict, resume: ResumeTarget, logger,
               cancel: CancelWatch) -> Optional[dict]:
    """Poll, act and record until the trainer reaches total_steps. Returns None when the run was cancelled."""
    total = cfg.trainer.total_steps
    sync_mode = cfg.runtime.mode == "sync"
    step = info["step"]
    monitor = HealthMonitor(cfg, start_step=step)
    history: list[dict] = []
    evals: list[dict] = []
    progress_id = create_progress_artifact(progress=100.0 * step / total, key="atrlhf-progress",
                                           description=f"trainer steps out of {total}")

    if resume.eval_start is not None:
        eval_start = resume.eval_start
    else:
        first = evaluate_heldout(runtime, step)
        eval_start = first["eval/accuracy"]
        evals.append({**first, "step": step})
        tracker.log_metrics_at({**first, "eval/accuracy_start": eval_start}, step)
    ckpt_extra = {"eval_start": eval_start, "mlflow_run_id": tracker.run_id}

    def next_multiple(every: int, current: int) -> Optional[int]:
        return (current // every + 1) * every if every else None

    next_ckpt = next_multiple(cfg.tracking.checkpoint_every, step)
    next_eval = next_multiple(cfg.tracking.eval_every, step)
    next_log = next_multiple(cfg.run.log_every, step)
    last_line = last_cancel_check = time.monotonic()
    last_metrics: dict = {}

    logger.info("training %s mode to step %d (from step %d); loss %s, %d rollout worker(s)", cfg.runtime.mode, total,
                step, cfg.algorithm.loss, cfg.rollout.num_workers)
    runtime.start()
    while True:
        runtime.advance()  # sync mode: one lockstep generate -> train -> sync step; async: nothing
        poll = runtime.poll()
        step = poll["step"]
        if poll["metrics"]:
            history.extend(poll["metrics"])
            tracker.log_metrics(poll["metrics"])
            last_metrics = poll["metrics"][-1]

        decision = monitor.check(poll)
        for ev in decision.events:
            level = {"error": logger.error, "warning": logger.warning}.get(ev.severity, logger.info)
            level("health: %s at step %d -> %s: %s", ev.kind, ev.step, ev.action, ev.detail)
        if decision.fail:
            raise SupervisionError(decision.fail)
        if decision.request_sync:
            runtime.request_sync()
        if decision.throttle is not None:
            runtime.throttle(decision.throttle)
        if decision.admission_window is not None:
            runtime.set_admission_window(decision.admission_window)
        if not sync_mode and not monitor.throttled:
            runtime.top_up_prompts(decision.top_up)

        if next_ckpt is not None and step >= next_ckpt and step < total:
            save_checkpoint(runtime, cfg, step, tracker, extra=ckpt_extra)
            next_ckpt = next_multiple(cfg.tracking.checkpoint_every, step)
        if next_eval is not None and step >= next_eval and step < total:
            ev = evaluate_heldout(runtime, step)
            evals.append({**ev, "step": step})
            tracker.log_metrics_at(ev, step)
            next_eval = next_multiple(cfg.tracking.eval_every, step)

        now = time.monotonic()
        if (next_log is not None and step >= next_log) or poll["done"] or now - last_line > HEARTBEAT_S:
            logger.info(progress_line(step, total, last_metrics, evals[-1] if evals else None, poll))
            update_progress_artifact(artifact_id=progress_id, progress=100.0 * min(step, total) / total)
            next_log = next_multiple(cfg.run.log_every, step)
            last_line = now
        if poll["done"]:
            break
        if now - last_cancel_check > CANCEL_CHECK_INTERVAL_S:
            last_cancel_check = now
            if cancel.requested():
                logger.warning("cancellation requested at step %d: stopping the loops", step)
                runtime.stop()
                return None
        if not sync_mode:
            time.sleep(cfg.supervision.supervise_interval_s)

    runtime.stop()
    final_poll = runtime.poll()
    if final_poll["metrics"]:
        history.extend(final_poll["metrics"])
        tracker.log_metrics(final_poll["metrics"])
        last_metrics = final_poll["metrics"][-1]
    step = final_poll["step"]
    update_progress_artifact(artifact_id=progress_id, progress=100.0)
    return _finish(cfg, runtime, tracker, step, eval_start, last_metrics, history, evals, monitor, final_poll, ckpt_extra,
                   logger)


def _finish(cfg, runtime, tracker: MlflowTracker, step: int, eval_start: float, last_metrics: dict, history: list,
            evals: list, monitor: HealthMonitor, final_poll: dict, ckpt_extra: dict, logger) -> dict:
    """Final evaluation, checkpoint, export and records."""
    final_eval = evaluate_heldout(runtime, step)
    evals.append({**final_eval, "step": step})
    tracker.log_metrics_at(final_eval, step)
    checkpoint = save_checkpoint(runtime, cfg, step, tracker, extra=ckpt_extra)
    exported = export_policy(runtime, cfg)
    if cfg.tracking.log_model:
        log_model(tracker, exported)
    log_plots(tracker, history, (final_poll.get("trainer") or {}).get("staleness_hist") or {}, evals)
    rows = event_rows(monitor.events)
    tracker.log_dict(rows, "health_events.json")

    result = {k: v for k, v in last_metrics.items() if isinstance(v, (int, float))}
    result.update(final_eval)
    result.update({"eval/accuracy_start": eval_start, "steps": step, "mlflow_run_id": tracker.run_id,
                   "mlflow_experiment_id": tracker.experiment_id, "mlflow_tracking_uri": tracker.uri,
                   "checkpoint": checkpoint, "export": exported, "health_events": len(rows)})
    tracker.log_metrics_at({"eval/accuracy_start": eval_start}, step)

    create_table_artifact(table=rows or [{"step": step, "kind": "none", "severity": "info", "action": "none",
                                          "detail": "no health events", "time": ""}],
                          key="atrlhf-health-events", description="Health events found by the supervising flow")
    create_markdown_artifact(markdown=_summary_markdown(cfg, result, tracker), key="atrlhf-summary",
                             description="Run summary")
    logger.info("done: step %d, held-out accuracy %.3f (start %.3f); MLflow run %s; policy exported to %s", step,
                result["eval/accuracy"], eval_start, tracker.run_id, exported)
    return result


def _link_mlflow_run(tracker: MlflowTracker, flow_run_id: str, logger) -> None:
    """Put the MLflow run id on the Prefect flow run: a tag `mlflow-run:<id>` and a link artifact."""
    url = run_url(tracker.uri, tracker.experiment_id, tracker.run_id)
    if flow_run_id:
        from prefect.client.orchestration import get_client

        try:
            with get_client(sync_client=True) as client:
                fr = client.read_flow_run(flow_run_id)
                client.update_flow_run(flow_run_id, tags=sorted(set(fr.tags) | {f"mlflow-run:{tracker.run_id}"}))
        except Exception as exc:  # cosmetic; never fail a run over a tag
            logger.warning("could not tag the flow run with the MLflow run id: %s", exc)
    create_link_artifact(link=url, link_text=f"MLflow run {tracker.run_id}", key="atrlhf-mlflow-run",
                         description=f"MLflow run of this flow run (store {tracker.uri}; open with `{ui_command(tracker.uri)}`)")
    logger.info("MLflow run %s in experiment %s (%s); UI: %s", tracker.run_id, tracker.experiment_id, tracker.uri,
                ui_command(tracker.uri))


def _fmt(value: Any) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def _summary_markdown(cfg: TrainConfig, result: dict, tracker: MlflowTracker) -> str:
    keys = ["eval/accuracy_start", "eval/accuracy", "eval/reward_mean", "reward/mean", "loss/policy", "policy/entropy",
            "async/staleness_mean", "throughput/samples_per_s", "steps", "health_events"]
    rows = "\n".join(f"| `{k}` | {_fmt(result[k])} |" for k in keys if k in result)
    url = run_url(tracker.uri, tracker.experiment_id, tracker.run_id)
    return f"""# AsyncTensorRLHF run summary

**{cfg.algorithm.loss}** in **{cfg.runtime.mode}** mode, task `{cfg.data.task}`, model `{cfg.model.path or 'tiny default'}`,
{cfg.trainer.total_steps} trainer steps.

| metric | value |
|---|---|
{rows}

- MLflow run: `{tracker.run_id}` (experiment `{cfg.tracking.experiment}`, store `{tracker.uri}`): [{url}]({url})
  — open the UI with `{ui_command(tracker.uri)}`
- Final checkpoint: `{result['checkpoint']}`
- Exported policy (Hugging Face directory): `{result['export']}`
""" + (f"""- Load the logged model: `from tasks.tracking import load_logged_policy; model, tok = load_logged_policy("{tracker.run_id}", "{tracker.uri}")`
""" if cfg.tracking.log_model else "")
