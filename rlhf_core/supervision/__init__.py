"""Health checks of a running training run, and the actions taken on them: the one supervision policy.

`HealthMonitor.check(poll)` reads one `DistributedRun.poll()` result and returns a `Decision`: whether to
publish weights now, pause or resume rollout admission, how many prompts to schedule, or to fail with a
message naming the cause. `Supervisor.tick()` polls the runtime, checks and applies the decision; the
Prefect flow and `run_distributed` both supervise through it, so there is one stall detector and one set
of limits. Every finding is a `HealthEvent` (the flow logs it and shows a table artifact at the end).
Thresholds come from `cfg.supervision`. Plain Python: no Ray, no Prefect.

Policies (the runtime enforces the hard bound max_staleness on its own; these keep the run healthy):

- staleness: mean staleness above staleness_warn x max_staleness -> publish weights now (once per trainer
  version, when runtime.sync_every > 1 leaves workers behind the trainer), with no event: staleness up to
  max_staleness is the design working (a `staleness_high` warning only for a mean above it). Supervision never
  changes the bound itself: the buffer owns the bound in force (`async/max_staleness` reports it at each step)
  and only the autopilot, when enabled, moves it.
- buffer: trainer starving (buffer below one step and no step since the last poll) -> resume admission,
  schedule more prompts; overflow (buffer/dropped_overflow grew) -> pause admission until the buffer is
  back under half its capacity.
- workers: a restart is reported and waited for; more than cluster.max_restarts restarts in the run (all workers
  together: the run's one restart budget), or a worker
  down for stall_timeout_s, fails the run.
- non-finite losses: trainer/step_finite == 0 counted; nonfinite_limit in a row fails the run.
- stall: no trainer step for stall_timeout_s fails the run, naming the role that is stuck.
- engine mismatch: mismatch/engine_kl (fresh tokens only) above engine_mismatch.kl for engine_mismatch.polls
  polls -> an engine_mismatch warning naming the likely causes (weights not loaded, dtype/sampling, adapter).
- fleet: the number of rollout workers (rlhf_core.autoscale.FleetPolicy: an `atrlhf scale` request, or the
  autoscaler when cluster.autoscale.enabled) -> applied through the runtime (`set_rollout_workers`), an info event
  with its reason; `cluster/rollout_workers` reports the size at every step.
- staleness autopilot (runtime.autopilot.enabled): `rlhf_core.autopilot.StalenessAutopilot` decides
  from the step metrics; a change of runtime.max_staleness is applied through the runtime
  (`set_max_staleness`) and reported as an info event (autopilot_raise / autopilot_lower) with its reason.

Modules: `monitor.py` holds the checks (HealthMonitor and its Decision, HealthEvent, SupervisionError);
`supervisor.py` the tick that applies them (Supervisor). Every name imports from `rlhf_core.supervision`.
"""

from rlhf_core.supervision.monitor import Decision, HealthEvent, HealthMonitor, SupervisionError
from rlhf_core.supervision.supervisor import Supervisor

__all__ = ["Decision", "HealthEvent", "HealthMonitor", "SupervisionError", "Supervisor"]
