"""The health checks (rlhf_core/supervision.py) on synthetic polls: no Ray, no Prefect server."""

from __future__ import annotations

from flows.progress import progress_line
from rlhf_core.config import load_config
from rlhf_core.supervision import HealthMonitor


def cfg(*extra):
    return load_config(
        None,
        [
            "trainer.prompts_per_step=4",
            "rollout.prompts_per_batch=4",
            "runtime.max_staleness=2",
            "supervision.staleness_warn=0.5",
            "supervision.nonfinite_limit=3",
            "cluster.max_restarts=1",
            "supervision.stall_timeout_s=10",
            "supervision.supervise_interval_s=1",
            "buffer.max_size=40",
            *extra,
        ],
    )


def poll(step, staleness=0.0, size=8, finite=(1.0,), dropped=0, workers=None, **kw):
    metrics = [{"step": step, "async/staleness_mean": staleness, "trainer/step_finite": f} for f in finite]
    return {
        "step": step,
        "version": step,
        "done": False,
        "metrics": metrics,
        "buffer": {"size": size, "dropped_overflow": dropped},
        "rollout": workers if workers is not None else [{"index": 0, "alive": True, "restarts": 0}],
        "trainer": {},
        "events": [],
        "failed": None,
        **kw,
    }


def test_high_staleness_publishes_early_and_never_changes_the_bound():
    """The supervisor once narrowed rollout admission on its own (every tau = 4 sweep point ran at tau <= 3, a
    default run at tau = 1 after step 30-90): it only publishes sooner now; the bound is the buffer's alone."""
    m = HealthMonitor(cfg("runtime.sync_every=4"), now=0)
    behind = [{"index": 0, "alive": True, "restarts": 0, "version": 0}]
    d = m.check(poll(1, staleness=1.5, workers=behind), now=1)
    assert d.request_sync and d.max_staleness is None and d.events == []  # within max_staleness: no event
    assert not m.check(poll(1, staleness=1.5, workers=behind), now=2).request_sync  # once per trainer version
    for t in range(2, 12):
        d = m.check(poll(t, staleness=1.9, workers=behind), now=t + 1)
        assert d.max_staleness is None and d.throttle is None
    assert not hasattr(d, "admission_window")
    assert [e.kind for e in m.events] == []  # nothing narrowed, nothing to report
    assert m.max_staleness == 2


def test_a_resumed_autopilot_starts_from_the_bound_its_checkpoint_saved():
    """The autopilot's bound is in every checkpoint; the runtime restores it into the buffer and the supervision
    goes on from it (a resumed run started again from runtime.max_staleness)."""
    from rlhf_core.supervision import Supervisor

    class Restored:
        restored_max_staleness = 3

    pilot = ["runtime.autopilot.enabled=true", "runtime.autopilot.max_staleness=4"]
    assert Supervisor(cfg(*pilot), Restored()).monitor.max_staleness == 3
    assert Supervisor(cfg(*pilot), object()).monitor.max_staleness == 2  # a fresh run: the configured start
    assert Supervisor(cfg(), Restored()).monitor.max_staleness == 2  # no autopilot: the configured bound


def test_the_checkpoint_to_bound_rule_is_the_checkpoints_own():
    """Every host's restore asks the checkpoint (CheckpointState.resumed_bound): its saved bound where the autopilot
    is on, None (the configured bound) where it is off or the checkpoint saved none."""
    from rlhf_core.run.checkpoint import CheckpointState

    pilot = cfg("runtime.autopilot.enabled=true", "runtime.autopilot.max_staleness=4")
    saved = CheckpointState(trainer={}, data={}, rng={}, run={"max_staleness": 3})
    assert saved.resumed_bound(pilot) == 3
    assert saved.resumed_bound(cfg()) is None
    assert CheckpointState(trainer={}, data={}, rng={}).resumed_bound(pilot) is None


def test_a_stall_under_filter_groups_names_filtering_as_the_cause():
    m = HealthMonitor(cfg("algorithm.filter_groups=true"), now=0)
    stuck = m.stuck_role(poll(3, size=1, buffer={"size": 1, "filtered_groups_frac": 0.9}))
    assert "filter_groups dropped 90%" in stuck and "filter_max_rounds" in stuck


def test_staleness_within_the_bound_is_no_event_above_it_a_warning():
    """A healthy async run sits near runtime.max_staleness by design: no health event (a default run printed a
    staleness_high line every time); a mean above the hard bound is warned about once, and its end reported."""
    m = HealthMonitor(cfg(), now=0)  # staleness_warn 0.5 x max_staleness 2 = 1.0
    for t in range(1, 3):
        assert m.check(poll(t, staleness=2.0), now=t).events == []  # at the bound
    assert not [e for e in m.events if e.kind.startswith("staleness")]
    m = HealthMonitor(cfg(), now=0)
    d = m.check(poll(1, staleness=2.5), now=1)  # above the hard bound: something is wrong
    assert [(e.kind, e.severity) for e in d.events] == [("staleness_high", "warning")]
    assert m.check(poll(2, staleness=2.5), now=2).events == []  # once
    assert [e.kind for e in m.check(poll(3, staleness=0.5), now=3).events] == ["staleness_ok"]


def test_no_extra_sync_when_weights_are_published_every_version_or_workers_are_current():
    m = HealthMonitor(cfg("runtime.sync_every=1"), now=0)
    assert not m.check(poll(1, staleness=1.5, workers=[{"index": 0, "alive": True, "version": 0}]), now=1).request_sync
    m = HealthMonitor(cfg("runtime.sync_every=4"), now=0)
    assert not m.check(poll(4, staleness=1.5, workers=[{"index": 0, "alive": True, "version": 4}]), now=1).request_sync


def test_overflow_throttles_until_half_empty_and_starvation_resumes():
    m = HealthMonitor(cfg(), now=0)
    d = m.check(poll(1, size=40, dropped=3), now=1)
    assert d.throttle is True and "buffer_overflow" in [e.kind for e in d.events]
    assert m.check(poll(2, size=30, dropped=3), now=2).throttle is None
    assert m.check(poll(3, size=20, dropped=3), now=3).throttle is False
    d = m.check(poll(3, size=0), now=8)  # no step for 5 s (> 3 polls) with an empty buffer
    assert "buffer_starving" in [e.kind for e in d.events] and d.top_up == 8


def test_nonfinite_steps_fail_after_the_limit():
    m = HealthMonitor(cfg(), now=0)
    assert m.check(poll(1, finite=(0.0, 0.0)), now=1).fail is None
    d = m.check(poll(2, finite=(0.0,)), now=2)
    assert d.fail and "supervision.nonfinite_limit=3" in d.fail
    m = HealthMonitor(cfg(), now=0)
    m.check(poll(1, finite=(0.0, 0.0)), now=1)
    assert m.check(poll(2, finite=(1.0, 0.0)), now=2).fail is None  # a finite step resets the count


def test_worker_restarts_are_waited_for_then_fail():
    m = HealthMonitor(cfg(), now=0)
    d = m.check(poll(1, workers=[{"index": 0, "alive": True, "restarts": 1}]), now=1)
    assert d.fail is None and "worker_restart" in [e.kind for e in d.events]
    d = m.check(poll(2, workers=[{"index": 0, "alive": True, "restarts": 2}]), now=2)
    assert d.fail and "cluster.max_restarts=1" in d.fail


def test_stall_fails_naming_the_stuck_role():
    m = HealthMonitor(cfg("runtime.max_staleness=0"), now=0)
    assert m.check(poll(1, size=0), now=1).fail is None
    d = m.check(poll(1, size=0), now=20)
    assert d.fail and "stuck: rollout" in d.fail
    m = HealthMonitor(cfg("runtime.max_staleness=0"), now=0)
    d = m.check(poll(0, size=8), now=20)
    assert d.fail and "stuck: trainer" in d.fail
    m = HealthMonitor(cfg("runtime.max_staleness=0"), now=0)
    d = m.check(poll(0, size=0, workers=[{"index": 0, "alive": False, "restarts": 0}]), now=20)
    assert "every rollout worker is down" in d.fail


def test_progress_line_is_compact():
    line = progress_line(
        3,
        6,
        {
            "reward/mean": 0.5,
            "async/staleness_mean": 1.0,
            "async/staleness_max": 2,
            "throughput/samples_per_s": 120.0,
            "buffer/size": 8,
        },
        {"eval/accuracy": 0.25, "step": 3},
        {},
    )
    assert line == "step 3/6 | reward 0.500 | acc 0.250@3 | staleness 1.00/2 | 120 samples/s | buffer 8"


def test_progress_line_shows_what_the_reward_is_made_of():
    """A reward that is all format bonus must not read like progress: the components show beside it."""
    from flows.progress import reward_breakdown, reward_component_keys

    metrics = {"reward/mean": 0.1, "reward/std": 0.0, "reward/answer_after_marker": 0.0, "reward/format": 1.0}
    line = progress_line(7, 10, metrics, None, {})
    assert line == "step 7/10 | reward 0.100 (answer_after_marker 0.000, format 1.000)"
    assert reward_component_keys(metrics) == ["reward/answer_after_marker", "reward/format"]
    # one component is the reward itself: nothing to add
    assert reward_breakdown({"reward/mean": 0.5, "reward/exact_match": 0.5}) == "0.500"


def test_run_summaries_show_the_reward_components():
    """The flow's summary artifact and the CLI's final summary show correctness apart from format."""
    from types import SimpleNamespace

    from flows.cli import _train_summary
    from flows.progress import summary_markdown

    config = cfg("reward.components={answer_after_marker: 1.0, format: 0.1}")
    result = {
        "eval/accuracy_start": 0.0,
        "eval/accuracy": 0.0,
        "eval/reward_mean": 0.1,
        "reward/mean": 0.1,
        "reward/answer_after_marker": 0.0,
        "reward/format": 1.0,
        "steps": 5,
        "checkpoint": "ckpt",
        "export": "export",
        "mlflow_run_id": "r" * 32,
        "mlflow_tracking_uri": "file:///tmp/mlruns",
    }
    tracker = SimpleNamespace(uri="file:///tmp/mlruns", experiment_id="1", run_id="r" * 32)
    md = summary_markdown(config, result, tracker)
    assert "| `reward/answer_after_marker` | 0 |" in md and "| `reward/format` | 1 |" in md
    assert "1 x answer_after_marker + 0.1 x format" in md
    state = SimpleNamespace(name="Completed", message=None)
    text = _train_summary(config, state, result, None)
    assert "train reward        0.100 (answer_after_marker 0.000, format 1.000) at the last step" in text
