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


def test_atrlhf_train_with_a_reward_model_logs_it_to_mlflow(prefect_api, tmp_path, mlflow_db, tiny_reward_model_dir):
    from mlflow.tracking import MlflowClient

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
        "checkpoint.every=0",
        "eval.every=0",
        "tracking.log_system_metrics=false",
        "model.preset=micro",
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


def test_reward_model_actor_scores_as_the_in_process_scorer(ray_local, tmp_path, chat_reward_model_dir, max3_prompts):
    """Through Ray (the RewardModelActor found by name, rows and prompt messages sent as numpy arrays and
    lists), an RM with its own tokenizer scores a rollout batch exactly as the in-process scorer does; its
    resources count in the cluster check."""
    import ray
    import torch

    from rlhf_core.config import load_config
    from rlhf_core.distributed.cluster import required_resources
    from rlhf_core.distributed.reward_model_actor import RemoteRewardModel, RewardModelActor
    from rlhf_core.loop import build_run
    from rlhf_core.reward.model import REWARD_MODEL_NAME
    from rlhf_core.run import build

    cfg = load_config(
        None,
        [
            f"run.output_dir={tmp_path}",
            "model.preset=micro",
            "data.eval_size=4",
            f"reward.model.path={chat_reward_model_dir}",
            "reward.model.batch_size=5",
            "cluster.resources.reward.CPU=0.5",
        ],
    )
    assert required_resources(cfg)["CPU"] == cfg.rollout.num_workers * cfg.cluster.resources.rollout["CPU"] + 1.0 + 0.5
    parts = build_run(cfg)
    (local,) = parts.worker.external
    prompts = parts.train_prompts[:3]
    batch, _ = parts.worker.rollout(prompts)
    row_prompts = [p for p in prompts for _ in range(cfg.rollout.samples_per_prompt)]
    expected = local.score(row_prompts, batch)[REWARD_MODEL_NAME]

    name = "atrlhf-reward_model-test"
    actor = ray.remote(RewardModelActor).options(name=name, num_cpus=0).remote(cfg, str(parts.policy_dir))
    try:
        remote = RemoteRewardModel(ray.get_actor(name), cfg, build.build_tokenizer(cfg, parts.policy_dir))
        assert remote.shares_tokenizer is False and remote.weights == {REWARD_MODEL_NAME: 1.0}
        got = remote.score(row_prompts, batch)[REWARD_MODEL_NAME]
        assert got.dtype == torch.float32 and got.shape == (len(batch),)
        assert torch.allclose(got, expected, atol=1e-5)
        assert ray.get(actor.stats.remote())["rows"] == len(batch)
    finally:
        ray.kill(actor)
