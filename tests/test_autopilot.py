"""The staleness autopilot: its decisions on scripted metric streams, and the supervisor applying them to the
buffer's bound (plain-Python control objects: no Ray, no Prefect)."""

from __future__ import annotations

import pytest

from rlhf_core.autopilot import StalenessAutopilot
from rlhf_core.config import ConfigError, load_config
from rlhf_core.run.control import ExperienceBuffer
from rlhf_core.supervision import HealthMonitor, Supervisor

PILOT = [
    "runtime.autopilot.enabled=true",
    "runtime.autopilot.min_staleness=0",
    "runtime.autopilot.max_staleness=4",
    "runtime.autopilot.target_m2=0.04",
    "runtime.autopilot.cooldown_steps=2",
    "runtime.max_staleness=1",
    "trainer.prompts_per_step=4",
    "rollout.prompts_per_batch=4",
]


def steps(n, m2, wait=0.0, train=1.0, **extra):
    return [{"async/mismatch_m2": m2, "time/wait_s": wait, "time/train_s": train, **extra} for _ in range(n)]


def pilot(start=1):
    return StalenessAutopilot(load_config(None, PILOT).runtime.autopilot, start)


def test_raises_while_the_trainer_waits_and_the_mismatch_is_low_up_to_the_ceiling():
    p = pilot()
    bounds = []
    for step in range(2, 20, 2):  # every poll: two steps in which the trainer waited half its time
        change = p.observe(steps(2, m2=0.01, wait=1.0), step)
        bounds.append(p.bound)
        if change:
            assert change.kind == "autopilot_raise" and "waited 50%" in change.reason
    assert bounds[:3] == [2, 3, 4] and p.bound == 4  # never past max_staleness
    assert [c.bound for c in p.changes] == [2, 3, 4]


def test_lowers_when_the_mismatch_passes_the_target_even_if_the_trainer_waits():
    p = pilot(start=3)
    change = p.observe(steps(2, m2=0.09, wait=5.0), 2)
    assert change.bound == 2 and change.kind == "autopilot_lower" and "> target_m2 0.04" in change.reason
    assert p.observe(steps(1, m2=0.09), 3) is None  # cooldown: the new bound takes effect first
    assert p.observe(steps(1, m2=0.09), 4).bound == 1
    p.observe(steps(2, m2=0.09), 6)
    assert p.bound == 0 and p.observe(steps(2, m2=0.09), 8) is None  # never below min_staleness


def test_keeps_the_bound_when_the_trainer_is_busy_or_without_steps():
    p = pilot()
    assert p.observe(steps(4, m2=0.0, wait=0.05), 4) is None  # waits 5 %: not starving
    assert p.observe([], 10) is None  # no steps since the last poll: nothing to judge
    assert p.observe([{"step": 11}], 11) is None  # metrics without the mismatch are not counted
    assert p.bound == 1 and not p.changes


def test_steady_mismatch_oscillation_settles_between_two_bounds():
    # a stream in which the mismatch grows with the bound: under target at 2, over it at 3
    p = pilot()
    for step in range(2, 40, 2):
        m2 = 0.02 * p.bound
        p.observe(steps(2, m2=m2, wait=1.0), step)
        assert 1 <= p.bound <= 3
    assert {c.bound for c in p.changes} <= {2, 3}


def test_config_checks():
    with pytest.raises(ConfigError, match="within runtime.autopilot.min_staleness"):
        load_config(None, [*PILOT, "runtime.max_staleness=6"])
    with pytest.raises(ConfigError, match="within runtime.autopilot.min_staleness"):  # sync: tau 0, below 1
        load_config(None, [*PILOT, "runtime.autopilot.min_staleness=1", "runtime.max_staleness=0"])
    with pytest.raises(ConfigError, match="runtime.autopilot.min_staleness=0"):
        load_config(None, [*PILOT, "rollout.prompts_per_batch=8"])  # 4 x (0 + 1) < 8: would stall at the floor


class BufferRuntime:
    """The part of DistributedRun the supervisor drives here: the real ExperienceBuffer's bound; polls scripted."""

    def __init__(self, buffer, polls):
        self.buffer, self.polls = buffer, list(polls)

    def advance(self):
        pass

    def poll(self):
        return self.polls.pop(0)

    def set_max_staleness(self, bound):
        return self.buffer.set_max_staleness(bound)

    def top_up_prompts(self, n=None):
        pass


def test_the_supervisor_moves_the_buffers_bound_and_reports_each_change():
    cfg = load_config(None, PILOT)
    buffer = ExperienceBuffer(max_size=64, max_staleness=1, prompts_per_step=4, ceiling=4)

    def poll(step, m2, wait):
        return {
            "step": step,
            "version": step,
            "done": False,
            "metrics": steps(2, m2=m2, wait=wait),
            "buffer": {"size": 8, "dropped_overflow": 0},
            "rollout": [{"index": 0, "alive": True, "restarts": 0}],
            "trainer": {},
            "events": [],
            "failed": None,
        }

    reported = []
    sup = Supervisor(
        cfg, BufferRuntime(buffer, [poll(2, 0.0, 1.0), poll(4, 0.0, 1.0), poll(6, 0.5, 0.0)]), 0, reported.append
    )
    seen = []
    for _ in range(3):
        sup.tick()
        seen.append(buffer.stats()["max_staleness"])
    assert seen == [2, 3, 2]
    reported = [e for e in reported if not e.kind.startswith("audit_")]  # the run audit's findings on these polls
    assert [e.kind for e in reported] == ["autopilot_raise", "autopilot_raise", "autopilot_lower"]
    assert reported[-1].action == "runtime.max_staleness 3 -> 2" and "mismatch" in reported[-1].detail
    assert buffer.capacity() == (2 + 0 + 1) * 4  # admission counts with the new bound
    assert HealthMonitor(load_config(None, ["runtime.max_staleness=3"])).autopilot is None  # off by default


def test_a_waiting_trainer_fed_fresher_data_than_the_bound_keeps_the_bound():
    """The rollout is the slower role: the trainer waits, but its data is fresher than the bound (admission is not
    what holds the rollout back), so a wider bound would only add staleness; at the bound it raises as before."""
    p = pilot(start=2)
    for step in range(2, 20, 2):
        assert p.observe(steps(2, m2=0.01, wait=1.0, **{"async/staleness_max": 1}), step) is None
    assert p.bound == 2
    change = p.observe(steps(2, m2=0.01, wait=1.0, **{"async/staleness_max": 2}), 22)
    assert change is not None and change.bound == 3 and "staleness 2" in change.reason
