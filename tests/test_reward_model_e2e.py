"""`atrlhf train` with a learned reward model, end to end: the real console script (its own temporary Prefect
API, a local Ray with the reward-model actor, MLflow on SQLite), a few async steps of the tiny task with the
tiny sequence-classification RM; reward/reward_model must reach MLflow at every step."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[1]
ATRLHF = str(Path(sys.executable).with_name("atrlhf"))


def test_atrlhf_train_with_a_reward_model_logs_it_to_mlflow(tmp_path, tiny_reward_model_dir):
    env = {
        **os.environ,
        "PREFECT_HOME": str(tmp_path / "prefect"),
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "RAY_USAGE_STATS_ENABLED": "0",
        "MLFLOW_DISABLE_TELEMETRY": "true",
    }
    env.pop("PREFECT_API_URL", None)
    steps = 3
    cmd = [
        ATRLHF,
        "train",
        "--config",
        "configs/tiny.yaml",
        "--set",
        f"run.output_dir={tmp_path / 'run'}",
        f"tracking.tracking_uri=sqlite:///{tmp_path / 'mlflow.db'}",
        "tracking.run_name=with-rm",
        f"trainer.total_steps={steps}",
        "tracking.checkpoint_every=0",
        "tracking.eval_every=0",
        "tracking.log_system_metrics=false",
        "model.tiny_hidden=32",
        "model.tiny_heads=2",
        "model.tiny_layers=1",
        "data.eval_size=8",
        "rollout.prompts_per_batch=4",
        "trainer.prompts_per_step=4",
        "rollout.samples_per_prompt=4",
        "cluster.num_cpus=3",
        "supervision.supervise_interval_s=0.5",
        f"reward.model.path={tiny_reward_model_dir}",
        "reward.model.weight=0.5",
        "reward.model.batch_size=8",
    ]
    out = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, (out.stdout + out.stderr)[-6000:]

    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    (run,) = [r for e in client.search_experiments() for r in client.search_runs([e.experiment_id])]
    assert run.info.status == "FINISHED"
    assert run.data.params["reward.model.path"] == str(tiny_reward_model_dir)
    history = client.get_metric_history(run.info.run_id, "reward/reward_model")
    assert [m.step for m in history] == list(range(1, steps + 1))
    assert all(math.isfinite(m.value) for m in history)
    assert any(m.value != 0 for m in history)  # a random RM's score is not 0
    assert len(client.get_metric_history(run.info.run_id, "reward/exact_match")) == steps
