"""`atrlhf train` with a learned reward model, end to end, in-process (as tests/test_flow.py runs it): the CLI's
train command under a Prefect test server, a local Ray started by the run with the reward-model actor, MLflow
on SQLite; a few async steps of the tiny task with the tiny sequence-classification RM. reward/reward_model
must reach MLflow at every step."""

from __future__ import annotations

import math
import os
from pathlib import Path

import pytest

for _key, _value in {
    "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
    "RAY_USAGE_STATS_ENABLED": "0",
    "DO_NOT_TRACK": "1",
    "MLFLOW_DISABLE_TELEMETRY": "true",
}.items():
    os.environ.setdefault(_key, _value)

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[1]


def test_atrlhf_train_with_a_reward_model_logs_it_to_mlflow(tmp_path, tiny_reward_model_dir):
    from mlflow.tracking import MlflowClient
    from prefect.testing.utilities import prefect_test_harness

    from flows.cli import main as cli_main

    steps = 3
    args = [
        "train",
        "--config",
        str(REPO / "configs" / "tiny.yaml"),
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
    with prefect_test_harness(server_startup_timeout=600):
        assert cli_main(args) == 0
    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    (run,) = [r for e in client.search_experiments() for r in client.search_runs([e.experiment_id])]
    assert run.info.status == "FINISHED"
    assert run.data.params["reward.model.path"] == str(tiny_reward_model_dir)
    history = client.get_metric_history(run.info.run_id, "reward/reward_model")
    assert [m.step for m in history] == list(range(1, steps + 1))
    assert all(math.isfinite(m.value) for m in history)
    assert any(m.value != 0 for m in history)  # a random RM's score is not 0
    assert len(client.get_metric_history(run.info.run_id, "reward/exact_match")) == steps
