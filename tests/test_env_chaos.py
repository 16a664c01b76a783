"""Chaos: an environment that (seeded) kills its process, raises, hangs past env.step_timeout_s and returns
malformed observations, trained on with the single-process loop (rlhf_core.loop.run_sync) and the small chat
model; and one whose every step raises, which stops the run. Real environment processes, no mocks."""

from __future__ import annotations

import math
import time
from pathlib import Path

import psutil
import pytest
from test_env_failures import assert_closed_once, events, hangs_lost_with_their_process

from rlhf_core.config import load_config
from rlhf_core.rollout.multiturn import EnvError

FIXTURES = str(Path(__file__).parent / "env_fixtures.py")
RATES = {"crash": 0.02, "raises": 0.05, "hang": 0.02, "bad": 0.02}  # per step


def chaos_cfg(tmp_path, steps: int, prompts: int, **env_kwargs):
    cfg = load_config(
        None,
        [
            f"run.output_dir={tmp_path / 'run'}",
            "model.preset=micro-chat",
            "data.task=max3_chat",
            "data.eval_size=2",
            "reward.components={answer_after_marker: 1.0}",
            "rollout.max_new_tokens=6",
            f"trainer.total_steps={steps}",
            f"trainer.prompts_per_step={prompts}",
            "rollout.samples_per_prompt=2",
            f"rollout.prompts_per_batch={prompts}",
            "env.workers=2",
            "eval.every=0",
            "checkpoint.every=0",
        ],
    )
    (tmp_path / "events").mkdir()
    kwargs = {"dir": str(tmp_path / "events"), "seed": 0, "turns": 3, **env_kwargs}
    env = {"path": FIXTURES, "name": "ChaosEnv", "kwargs": kwargs, "max_turns": 3, "step_timeout_s": 0.3}
    cfg.env = cfg.env.model_validate(env)
    return cfg


def children() -> set[int]:
    """This process's live children, but multiprocessing's resource tracker (started once, by the first spawn)."""
    out = set()
    for p in psutil.Process().children(recursive=True):
        try:
            if p.status() != psutil.STATUS_ZOMBIE and "resource_tracker" not in " ".join(p.cmdline()):
                out.add(p.pid)
        except psutil.NoSuchProcess:
            pass
    return out


@pytest.mark.slow  # ~20 s: 30 training steps, ~600 environment steps, ~10 processes killed and replaced
def test_a_chaotic_environment_trains_and_every_failure_is_counted(tmp_path):
    """30 steps, 2 prompts x 2 samples each, 2 environment processes. The run completes; each failure kind is
    counted as injected (each crash charges one episode: at most one off, when a call beside it started after
    it; a timeout or other count may be off by a call whose reply was not sent yet, and a hang may be swallowed
    by a crash beside it in its process: that episode starts again elsewhere), within sampling error of
    the configured rates; every process killed was replaced; every episode opened was closed once (but those
    killed with their process); no process is left."""
    from rlhf_core.loop import build_run, run_sync

    before = children()
    cfg = chaos_cfg(tmp_path, steps=30, prompts=2, hang_s=0.8, **RATES)
    parts = build_run(cfg)
    try:
        result = run_sync(cfg, parts=parts)
        metrics, stats = parts.worker.env.metrics(), parts.worker.stats()
    finally:
        parts.worker.close()
    assert result["steps"] == 30
    assert all(stats[k] == v for k, v in metrics.items())
    counts, by_instance = events(tmp_path / "events")
    steps = counts["step"]
    counted = {kind: metrics[f"env/errors/{kind}"] for kind in ("raised", "timeout", "bad_result", "process_died")}
    injected = {"raised": counts["raise"], "timeout": counts["hang"], "bad_result": counts["bad"]}
    injected["process_died"] = counts["crash"]
    lost = hangs_lost_with_their_process(tmp_path / "events", hang_s=0.8)  # a crash beside a hang may swallow it
    print(f"\nchaos: {steps} steps, {counts['open']} episodes; injected {injected}; counted {counted}; "
          f"process restarts {metrics['env/process_restarts']:g}; hangs beside a crash {lost}")  # fmt: skip
    assert metrics["env/process_restarts"] == counts["crash"] >= 1
    for kind, n in injected.items():
        low = n - (1 if kind == "process_died" else 2) - (lost if kind == "timeout" else 0)
        assert low <= counted[kind] <= n + (1 if kind == "process_died" else 2), (kind, counted, injected, lost)
    assert metrics["env/errors"] == sum(counted.values())
    for kind, rate in zip(injected, (RATES["raises"], RATES["hang"], RATES["bad"], RATES["crash"])):
        sigma = math.sqrt(rate * (1 - rate) / steps)
        assert abs(counted[kind] / steps - rate) <= 4 * sigma + 2 / steps, (kind, counted[kind], steps)
    assert_closed_once(by_instance)
    assert children() <= before


def test_an_environment_whose_every_step_raises_stops_the_run_with_its_error(tmp_path):
    """16 episodes per batch, every step raises: the run stops within 30 s (supervision.max_consecutive_failures=20
    failed calls in a row; each batch's successful resets do not clear the count) with the environment's own message,
    file and line; every episode it opened was closed; no process is left."""
    from rlhf_core.loop import build_run, run_sync

    before = children()
    start = time.monotonic()
    cfg = chaos_cfg(tmp_path, steps=5, prompts=8, raises=1.0)
    parts = build_run(cfg)
    try:
        with pytest.raises(EnvError) as caught:
            run_sync(cfg, parts=parts)
    finally:
        parts.worker.close()
    assert time.monotonic() - start < 30
    message = str(caught.value)
    assert "failed 20 calls in a row (supervision.max_consecutive_failures=20)" in message
    assert "step: ValueError: injected failure at step 1 (at " in message and "env_fixtures.py:" in message
    _, by_instance = events(tmp_path / "events")
    assert_closed_once(by_instance)
    assert children() <= before
