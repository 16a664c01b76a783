"""Environments that fail, on the Ray runtime (slow: a local Ray instance): an environment whose every step raises
stops the run quickly with its own error in the one line the CLI prints; the chaos environment trains through
in lockstep and asynchronously."""

from __future__ import annotations

import time

import pytest

from flows.terminal import failure_line
from rlhf_core.config import validate_config
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
