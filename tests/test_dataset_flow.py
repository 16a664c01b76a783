"""`atrlhf train` end to end on verl-schema parquet files (train and held-out) with the local chat model: the
prompts travel through the Ray prompt queue, and sampled evaluation's eval/pass@k and eval/mean@k reach
MLflow (as eval/pass_at_k, eval/mean_at_k: MLflow refuses '@'), the run summary and the CLI's result.
Real Prefect (test harness), real local Ray, MLflow on SQLite; two lockstep steps."""

from __future__ import annotations

import os

import pytest

for _key, _value in {
    "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
    "RAY_USAGE_STATS_ENABLED": "0",
    "DO_NOT_TRACK": "1",
    "MLFLOW_DISABLE_TELEMETRY": "true",
    "MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR": "false",
}.items():
    os.environ.setdefault(_key, _value)

datasets = pytest.importorskip("datasets")

from mlflow.tracking import MlflowClient  # noqa: E402
from prefect.client.orchestration import get_client  # noqa: E402
from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId  # noqa: E402

from flows.cli import main as cli_main  # noqa: E402
from tracking import mlflow_metric_name  # noqa: E402

pytestmark = pytest.mark.slow


def verl_parquet(path, start: int, n: int):
    rows = [
        {
            "data_source": "openai/gsm8k",
            "prompt": [{"role": "user", "content": f"What is {i} + 1? Answer after ####."}],
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": str(i + 1)},
            "extra_info": {"split": "train", "index": i},
        }
        for i in range(start, start + n)
    ]
    datasets.Dataset.from_list(rows).to_parquet(str(path))
    return path


def test_atrlhf_train_on_verl_parquet_logs_pass_at_k(
    prefect_api, chat_policy_dir, ray_local, tmp_path, mlflow_db, capsys
):
    assert mlflow_metric_name("eval/pass@k") == "eval/pass_at_k"
    train, test = verl_parquet(tmp_path / "train.parquet", 0, 12), verl_parquet(tmp_path / "test.parquet", 50, 4)
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    overrides = [
        f"model.path={chat_policy_dir}",
        "data.task=dataset",
        f"data.train_path={train}",
        f"data.eval_path={test}",
        "data.eval_size=3",
        "reward.components={answer_after_marker: 1.0, format: 0.1}",
        "reward.format_sequences=['####']",
        "eval.n_samples=3",
        "eval.k=2",
        "eval.temperature=1.0",
        "trainer.total_steps=2",
        "rollout.prompts_per_batch=2",
        "trainer.prompts_per_step=2",
        "rollout.samples_per_prompt=2",
        "rollout.max_new_tokens=4",
        "runtime.max_staleness=0",
        "cluster.num_cpus=2",
        "eval.every=0",
        "checkpoint.every=0",
        "tracking.log_model=false",
        "tracking.log_system_metrics=false",
        "supervision.supervise_interval_s=0.2",
        f"tracking.tracking_uri={uri}",
        "tracking.run_name=verl-parquet",
        f"run.output_dir={tmp_path / 'run'}",
    ]
    assert cli_main(["train", "--set", *overrides]) == 0
    out = capsys.readouterr().out
    assert "sampled held-out    pass@2" in out

    client = MlflowClient(uri)
    (run,) = client.search_runs([client.get_experiment_by_name("asynctensorrlhf").experiment_id])
    assert run.info.status == "FINISHED"
    params = run.data.params
    assert (params["data.task"], params["eval.k"], params["eval.n_samples"]) == ("dataset", "2", "3")
    for key in ("eval/pass@k", "eval/mean@k"):
        history = client.get_metric_history(run.info.run_id, mlflow_metric_name(key))
        assert [m.step for m in history] == [0, 2]  # at the start and the final evaluation
        assert all(0.0 <= m.value <= 1.0 for m in history)
    passes = client.get_metric_history(run.info.run_id, "eval/pass_at_k")
    means = client.get_metric_history(run.info.run_id, "eval/mean_at_k")
    assert all(p.value >= m.value - 1e-12 for p, m in zip(passes, means))  # pass@2 >= pass@1 = mean
    assert len(client.get_metric_history(run.info.run_id, "reward/mean")) == 2

    with get_client(sync_client=True) as prefect:
        flow_run_id = run.data.tags["prefect.flow_run_id"]
        arts = prefect.read_artifacts(
            artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[flow_run_id]))
        )
    summary = next(a for a in arts if a.key == "atrlhf-summary").data
    assert "| `eval/pass@k` |" in summary and "| `eval/mean@k` |" in summary and "k = 2 of 3" in summary
