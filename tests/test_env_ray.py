"""Environments that fail, on the Ray runtime (slow: a local Ray instance): an environment whose every step raises
stops the run quickly with its own error in the one line the CLI prints; the chaos environment trains through
in lockstep and asynchronously."""

from __future__ import annotations

import time

import pytest

from flows.terminal import failure_line
from rlhf_core.config import validate_config
from tests.ledger_checks import assert_ledger_balances
from tests.test_env import loop_cfg

pytestmark = pytest.mark.slow


def ray_cfg(tmp_path, name: str, steps: int, max_staleness: int, rollout=None, trainer=None, **env):
    cfg = loop_cfg(tmp_path, name, **env)
    dumped = cfg.model_dump(mode="json")
    return validate_config(
        {
            **dumped,
            "cluster": {"num_cpus": 2},
            "supervision": {"supervise_interval_s": 0.2},
            "runtime": {"max_staleness": max_staleness, "wait_timeout_s": 60},
            "trainer": {**dumped["trainer"], "total_steps": steps, **(trainer or {})},
            "rollout": {**dumped["rollout"], **(rollout or {})},
            "eval": {**dumped["eval"], "every": 0},
        }
    )


def test_an_always_raising_step_stops_the_ray_run_with_the_envs_error(ray_local, tmp_path):
    """16 episodes per batch, every step raises: the run stops within 60 s (Ray's start included), and the
    RunFailed's one line (what `atrlhf train` prints) holds the environment's own error, file and line."""
    from rlhf_core.distributed import RunFailed, run_distributed

    cfg = ray_cfg(
        tmp_path,
        "ChaosEnv",
        steps=5,
        max_staleness=0,
        rollout={"prompts_per_batch": 8, "samples_per_prompt": 2},
        trainer={"prompts_per_step": 8},
        kwargs={"dir": str(tmp_path), "raises": 1.0},
    )
    start = time.monotonic()
    with pytest.raises(RunFailed) as info:
        run_distributed(cfg, poll_interval_s=0.2)
    elapsed = time.monotonic() - start
    line = failure_line(info.value)
    assert "EnvError" in line and "failed 20 calls in a row" in line, line
    assert "ValueError: injected failure at step 1" in line and "env_fixtures.py:" in line, line
    assert elapsed < 60, elapsed
    print(f"stopped after {elapsed:.1f} s: {line}")


@pytest.mark.parametrize("max_staleness", [0, 2])
def test_a_chaotic_environment_trains_on_the_ray_runtime(ray_local, tmp_path, max_staleness):
    """tests/test_env_chaos.py's environment (kills its process on 2 % of steps, raises on 5 %, hangs past the
    timeout on 2 %, returns a non-string observation on 2 %) on the Ray runtime, in lockstep (max_staleness 0)
    and asynchronously (2): the run completes its 12 steps; each kind is counted, never more than injected
    (the worker may inject more after the last step's count); every episode opened was closed once (but those
    killed with their process); every environment process is gone after the run."""
    import psutil
    from test_env_chaos import RATES, chaos_cfg
    from test_env_failures import assert_closed_once, events

    from rlhf_core.distributed import run_distributed

    base = chaos_cfg(tmp_path, steps=12, prompts=2, hang_s=0.8, **RATES)
    dumped = base.model_dump(mode="json")
    cfg = validate_config(
        {
            **dumped,
            "cluster": {"num_cpus": 2},
            "supervision": {"supervise_interval_s": 0.2},
            "runtime": {"max_staleness": max_staleness, "wait_timeout_s": 60},
        }
    )
    result = run_distributed(cfg, poll_interval_s=0.2)
    assert result["steps"] == 12
    assert_ledger_balances(result["reconcile"])  # every episode's tokens in one account, failures included
    counts, by_instance = events(tmp_path / "events")
    last = result["metrics"][-1]
    counted = {kind: last.get(f"env/errors/{kind}", 0) for kind in ("raised", "timeout", "bad_result", "process_died")}
    injected = {"raised": counts["raise"], "timeout": counts["hang"], "bad_result": counts["bad"]}
    injected["process_died"] = counts["crash"]
    print(f"\nray chaos (max_staleness {max_staleness}): {counts['step']} steps, {counts['open']} episodes; injected "
          f"{injected}; counted by the last step {counted}")  # fmt: skip
    assert counts["raise"] >= 1 and counted["raised"] >= 1
    for kind, n in injected.items():
        assert counted[kind] <= n + 2, (kind, counted, injected)
    assert_closed_once(by_instance)
    pids = [int(p.stem) for p in (tmp_path / "events").glob("*.log")]
    deadline = time.monotonic() + 15
    while any(psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE for p in pids):
        assert time.monotonic() < deadline, [p for p in pids if psutil.pid_exists(p)]
        time.sleep(0.2)
