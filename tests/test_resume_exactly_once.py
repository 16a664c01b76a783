"""Exactly-once resume of an async run whose driver was SIGKILLed: real drivers in subprocesses (each starts its
own local Ray, num_cpus=2), the trained prompts counted from the trainers' per-step records."""

from __future__ import annotations

import os
import time

import pytest

from tests.ledger_checks import assert_ledger_balances

os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
pytest.importorskip("ray")

pytestmark = pytest.mark.slow  # two training drivers, each with its own Ray


_DRIVER = """
import json
import sys
from rlhf_core.config import load_config
from rlhf_core.distributed import run_distributed
cfg = load_config("configs/tiny.yaml", sys.argv[3:])
result = run_distributed(cfg, poll_interval_s=0.2, resume_from=sys.argv[2] or None)
print("DRIVER-DONE", sys.argv[1], json.dumps(result["reconcile"]), flush=True)
"""


def test_a_resumed_async_run_trains_on_every_prompt_of_each_epoch_exactly_once(tmp_path):
    """Exactly-once resume: the driver of an async run is SIGKILLed between checkpoints (groups queued,
    buffered and in flight at the last checkpoint die with it); a run resumed from that checkpoint regenerates
    them, so that across the two runs (the first counted up to its checkpoint's step) every prompt of every
    epoch was trained on exactly once, by the trainers' per-step records (trained_prompts.jsonl)."""
    import json
    import signal
    import subprocess
    import sys
    from pathlib import Path

    from rlhf_core.run.trainer_role import TRAINED_PROMPTS_FILE

    n_prompts, per_step = 40, 4  # max3 has 1000 problems: 4% of them train, an epoch is 10 steps
    common = [
        "data.heldout_frac=0.96",
        "data.eval_size=20",
        "cluster.num_cpus=2",
        f"trainer.prompts_per_step={per_step}",
        "rollout.prompts_per_batch=4",
        "rollout.samples_per_prompt=4",
        "eval.every=0",
        "checkpoint.every=3",
        "supervision.supervise_interval_s=0.2",
        "runtime.wait_timeout_s=60",
        "model.preset=word:1x128x4",
        "data.sampler=epochs",  # exactly once per epoch is the epochs sampler's property (tiny.yaml prioritizes)
    ]
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", "PYTHONUNBUFFERED": "1"}
    repo = Path(__file__).resolve().parents[1]

    def start(name: str, resume: str, *extra: str) -> subprocess.Popen:
        log = open(tmp_path / f"{name}.log", "w")
        cmd = [sys.executable, "-c", _DRIVER, name, resume, f"run.output_dir={tmp_path / name}", *common, *extra]
        return subprocess.Popen(cmd, cwd=repo, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)

    def records(name: str) -> list[dict]:
        path = tmp_path / name / TRAINED_PROMPTS_FILE
        lines = path.read_text().splitlines() if path.is_file() else []
        out = []
        for line in lines:
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:  # the line being written when the driver died
                pass
        return out

    def checkpoints(name: str) -> list[int]:
        return sorted(int(p.name[5:]) for p in (tmp_path / name / "checkpoints").glob("step_*") if p.name[5:].isdigit())

    first = start("first", "", "trainer.total_steps=100000")
    try:
        deadline = time.monotonic() + 300
        while True:  # past a checkpoint in the second epoch, and not at a checkpoint step
            steps = [r["step"] for r in records("first")]
            done = checkpoints("first")
            if done and done[-1] >= 12 and steps and steps[-1] % 3:
                break
            log = (tmp_path / "first.log").read_text()[-4000:]
            assert first.poll() is None, log
            assert time.monotonic() < deadline, "no checkpoint in time:\n" + log
            time.sleep(0.05)
    finally:
        os.killpg(first.pid, signal.SIGKILL)  # the driver and its Ray: nothing ends cleanly
        first.wait(30)
    last = checkpoints("first")[-1]
    trained_first = [r for r in records("first") if r["step"] <= last]
    assert [r["step"] for r in trained_first] == list(range(1, last + 1))

    total = (last // 10 + 2) * 10  # whole epochs: at least one more after the checkpoint's
    ckpt = tmp_path / "first" / "checkpoints" / f"step_{last:06d}"
    second = start("second", str(ckpt), f"trainer.total_steps={total}")
    try:
        assert second.wait(300) == 0, (tmp_path / "second.log").read_text()[-4000:]
    finally:
        if second.poll() is None:
            os.killpg(second.pid, signal.SIGKILL)
    # the token ledger across the resume: the checkpoint's accounts go on, what it held is carried
    from rlhf_core.run.checkpoint import read_checkpoint

    at_ckpt = read_checkpoint(ckpt)[0].run["ledger"]
    done_line = [ln for ln in (tmp_path / "second.log").read_text().splitlines() if ln.startswith("DRIVER-DONE")]
    rec = json.loads(done_line[-1].split(" ", 2)[2])
    assert_ledger_balances(rec)
    assert rec["trained_samples"] == total * per_step * 4, rec  # 4 samples a prompt, every step of both runs
    # (what was buffered or in flight at the checkpoint depends on timing: often some groups, sometimes none)
    assert rec["carried_samples"] == at_ckpt["buffered_samples"] + at_ckpt["in_flight_samples"], (at_ckpt, rec)
    trained_second = records("second")
    assert [r["step"] for r in trained_second] == list(range(last + 1, total + 1))

    counts: dict[int, int] = {}
    for r in trained_first + trained_second:
        assert len(r["prompt_ids"]) == per_step
        for uid in r["prompt_ids"]:
            counts[uid] = counts.get(uid, 0) + 1
    assert len(counts) == n_prompts
    epochs = total * per_step // n_prompts
    wrong = {uid: c for uid, c in counts.items() if c != epochs}
    assert not wrong, f"prompts not trained on exactly once in each of {epochs} epochs: {wrong}"
