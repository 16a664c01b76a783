"""An agent through a whole run (the config's agent: section, build, the single-process loop, evaluation) and
`atrlhf serve` over the checkpoint it wrote, answering the real `openai` client."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import openai
import pytest

from rlhf_core.config import ConfigError, load_config, validate_config
from tests.ledger_checks import assert_ledger_balances

REPO = Path(__file__).resolve().parents[1]

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = str(Path(__file__).parent / "agent_fixtures.py")


def test_the_agent_section_names_the_field(tmp_path):
    with pytest.raises(ConfigError, match="agent.name.*no function named 'nope'"):
        validate_config({"agent": {"path": FIXTURES, "name": "nope"}})
    with pytest.raises(ConfigError, match="agent.path is empty"):
        validate_config({"agent": {"name": "run"}})
    env = {"path": str(Path(__file__).parent / "env_fixtures.py"), "name": "CountEnv"}
    with pytest.raises(ConfigError, match="agent and env are both set"):
        validate_config({"agent": {"path": FIXTURES, "name": "two_requests"}, "env": env})
    cfg = validate_config({"agent": {"path": FIXTURES, "name": "two_requests", "timeout_s": 5}})
    assert cfg.agent.enabled and cfg.agent.column_names()[0] == "agent" and not validate_config({}).agent.enabled
    recipe = load_config(str(ROOT / "configs" / "tiny-agent.yaml"))
    assert recipe.agent.enabled and recipe.agent.name == "run" and Path(recipe.agent.path).is_file()


def agent_run_config(tmp_path, name: str, **agent):
    cfg = load_config(
        None,
        [
            f"run.output_dir={tmp_path}",
            "model.preset=micro-chat",
            "data.task=max3_chat",
            "data.eval_size=3",
            "rollout.max_new_tokens=6",
            "trainer.total_steps=2",
            "trainer.prompts_per_step=2",
            "rollout.samples_per_prompt=2",
            "rollout.prompts_per_batch=2",
            "eval.every=1",
            "checkpoint.every=0",
        ],
    )
    cfg.agent = cfg.agent.model_validate({"path": FIXTURES, "name": name, **agent})
    return cfg


@pytest.mark.slow  # end to end: a whole run, then `atrlhf serve` in its own process on its checkpoint (~15 s)
def test_run_sync_trains_with_an_agent_and_serve_answers_on_its_checkpoint(tmp_path, capsys):
    from flows.cli import main
    from rlhf_core.loop import build_run, generate_step_batch, run_sync

    cfg = agent_run_config(tmp_path, "two_requests")
    parts = build_run(cfg)
    seen = []
    try:
        result = run_sync(cfg, parts=parts, on_step=seen.append)
        batch, metrics = generate_step_batch(parts)
    finally:
        parts.worker.close()
    assert result["steps"] == 2 and len(seen) == 2
    for m in seen:
        assert m["agent/requests_mean"] == 2 and m["agent/prefix_breaks"] == 0 and m["reward/agent"] == 1.0
        assert m["agent/errors"] == 0 and m["agent/timeouts"] == 0 and m["agent/latency_s"] > 0
        assert "reward/answer_after_marker" not in m  # the reward's components are not scored with an agent
    assert result["eval/accuracy"] == 1.0 and result["eval/requests_mean"] == 2  # reward 1.0 > 0: solved
    # the first held-out episodes as trajectory records, for MLflow traces: each request's new messages, its reply
    (record, *_) = result["eval/trajectories"]
    assert [m["role"] for m in record["messages"]] == ["user", "assistant", "user", "assistant"]
    assert record["turns"] == 2 and record["reward"] == 1.0 and record["messages"][1]["policy_version"] == 2
    assert len(batch) == 4 and batch.loss_mask.sum() < batch.response_mask.sum()
    assert metrics["reward/agent"] == 1.0

    # `atrlhf serve --checkpoint latest` (the CLI, in its own process) on the checkpoint the run wrote: latest is
    # run.output_dir/latest, the newest run's exported policy or else its newest checkpoint
    checkpoint = tmp_path / "checkpoints" / "step_000002"
    assert checkpoint.is_dir()
    assert main(["serve", "--checkpoint", str(tmp_path / "missing")]) == 2  # checked before anything starts
    assert "does not exist" in capsys.readouterr().err
    out_dir = tmp_path / "out"
    assert main(["serve", "--checkpoint", "latest", "--set", f"run.output_dir={out_dir}"]) == 2  # no run yet
    assert f"{out_dir / 'latest'} does not exist" in capsys.readouterr().err
    out_dir.mkdir()
    (out_dir / "latest").symlink_to(tmp_path)
    cmd = [sys.executable, "-m", "flows.cli", "serve", "--checkpoint", "latest", "--set", f"run.output_dir={out_dir}"]
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        lines: dict = {}
        while "OPENAI_API_KEY" not in lines:
            line = proc.stdout.readline()
            assert line, proc.stderr.read()[-3000:]  # it ended before serving
            if line.strip().startswith("OPENAI_"):
                key, value = line.strip().split("=", 1)
                lines[key] = value
        assert lines["OPENAI_BASE_URL"].startswith("http://127.0.0.1:")
        client = openai.OpenAI(base_url=lines["OPENAI_BASE_URL"], api_key=lines["OPENAI_API_KEY"], max_retries=0)
        assert [m.id for m in client.models.list().data] == ["step_000002"]
        answer = client.chat.completions.create(
            model="step_000002", messages=[{"role": "user", "content": "max of 1, 2, 3?"}], max_tokens=4
        )
        assert answer.choices[0].message.role == "assistant" and answer.system_fingerprint == "atrlhf-v0"
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)
    assert proc.returncode == 0


def test_serve_latest_finds_the_newest_policy(tmp_path):
    from flows.serve import latest_policy

    cfg = validate_config({"run": {"output_dir": str(tmp_path)}})
    with pytest.raises(FileNotFoundError, match="latest"):
        latest_policy(cfg)
    run = tmp_path / "run-1"
    for step in ("step_000002", "step_000010"):
        (run / "checkpoints" / step).mkdir(parents=True)
    (tmp_path / "latest").symlink_to(run)
    assert latest_policy(cfg).name == "step_000010"
    (run / "policy").mkdir()
    (run / "policy" / "config.json").write_text("{}")
    assert latest_policy(cfg) == tmp_path / "latest" / "policy"


@pytest.mark.slow
def test_the_ray_runtime_runs_agents(ray_local, tmp_path):
    """Each rollout actor serves its own endpoint and runs the episodes; with partial rollouts the weight-store
    hook reaches the endpoint's engine calls, and every model token trained on is within the staleness bound;
    the agent/* metrics travel with the groups; held-out evaluation runs the episodes in the trainer actor."""
    from rlhf_core.distributed import run_distributed

    base = agent_run_config(tmp_path, "two_requests")
    data = base.model_dump(mode="json")
    cfg = validate_config(
        {
            **data,
            "cluster": {"num_cpus": 2},
            "supervision": {"supervise_interval_s": 0.2},
            "runtime": {"max_staleness": 1, "wait_timeout_s": 60},
            "trainer": {**data["trainer"], "total_steps": 3},
            "rollout": {**data["rollout"], "partial_rollout": True},
        }
    )
    result = run_distributed(cfg, poll_interval_s=0.2)
    assert result["steps"] == 3
    for m in result["metrics"]:
        assert m["agent/requests_mean"] == 2 and m["reward/agent"] == 1.0 and m["agent/prefix_breaks"] == 0
        assert m["agent/errors"] == 0 and m["async/token_staleness_max"] <= 1
    assert result["eval/accuracy"] == 1.0
    assert_ledger_balances(result["reconcile"])
