"""Python reward functions end to end: real `atrlhf train` processes (their own Prefect API, a local Ray,
MLflow on SQLite) on the tiny task, with the example functions of examples/rewards/.

A run whose reward is the TRL-style and the verl-style example and a function that sleeps past its timeout
(no component) completes, and MLflow holds reward/<label> for each, the verl metric, the timeouts as failures,
and the held-out evaluation by the function eval.metric names. (A function that raises stops the run with its
error, the MLflow run FAILED: tests/test_flow.py, through the flow in-process.)
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[1]
ATRLHF = str(Path(sys.executable).with_name("atrlhf"))

HELPERS = """
import time


def sleeps(prompts, completions, **columns):
    time.sleep(30)
    return [1.0] * len(completions)
"""


def train(
    api: dict, tmp_path: Path, name: str, functions: str, *extra: str
) -> tuple[subprocess.CompletedProcess, object]:
    """`atrlhf train` in a subprocess against the session's Prefect server (`api`: the prefect_server fixture;
    the temporary API a run starts without one is covered in tests/test_signals.py)."""
    env = {
        **os.environ,
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "RAY_USAGE_STATS_ENABLED": "0",
        "PYTHONUNBUFFERED": "1",
        "PREFECT_API_URL": api["url"],
    }
    cmd = [
        ATRLHF,
        "train",
        "--config",
        "configs/tiny.yaml",
        "--set",
        f"run.output_dir={tmp_path / name}",
        f"tracking.tracking_uri=sqlite:///{tmp_path / 'mlflow.db'}",
        f"tracking.run_name={name}",
        "trainer.total_steps=3",
        "eval.every=0",
        "checkpoint.every=0",
        "tracking.log_model=false",
        "tracking.log_system_metrics=false",
        "model.preset=micro",
        "data.eval_size=20",
        "cluster.num_cpus=2",
        "rollout.prompts_per_batch=4",
        "trainer.prompts_per_step=4",
        "rollout.samples_per_prompt=4",
        "supervision.supervise_interval_s=0.5",
        f"reward.functions={functions}",
        *extra,
    ]
    out = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    exp = client.get_experiment_by_name("asynctensorrlhf")
    assert exp is not None, f"no MLflow experiment; atrlhf train said:\n{out.stdout[-4000:]}\n{out.stderr[-4000:]}"
    (run,) = client.search_runs([exp.experiment_id], filter_string=f"tags.`mlflow.runName` = '{name}'")
    return out, (client, run)


def test_trl_and_verl_examples_and_a_timeout_through_atrlhf_train(prefect_server, tmp_path, mlflow_db):
    """A reward of functions alone (reward.components {}): TRL's and verl's examples and one that times out,
    weighted; eval.metric a function's label: the trainer actor's held-out evaluation reports that function's
    mean as eval/accuracy and eval/<label>."""
    (tmp_path / "helpers.py").write_text(HELPERS)
    functions = (
        "[{path: examples/rewards/trl_style.py, name: last_number_matches, weight: 0.5}, "
        "{path: examples/rewards/verl_style.py, name: compute_score, label: verl_score, metrics: [length]}, "
        f"{{path: {tmp_path / 'helpers.py'}, name: sleeps, weight: 1.0}}]"
    )
    out, (client, run) = train(
        prefect_server,
        tmp_path,
        "functions",
        functions,
        "reward.function_timeout_s=0.5",
        "supervision.max_consecutive_failures=1000",
        "reward.components={}",
        "eval.metric=last_number_matches",
    )
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-4000:]
    assert run.info.status == "FINISHED"
    history = {
        key: [m.value for m in client.get_metric_history(run.info.run_id, key)]
        for key in [
            "reward/mean",
            "reward/exact_match",
            "reward/last_number_matches",
            "reward/last_number_matches/failed",
            "reward/verl_score",
            "reward/verl_score/length",
            "reward/sleeps",
            "reward/sleeps/failed",
        ]
    }
    assert history["reward/exact_match"] == []  # no component: the functions alone
    del history["reward/exact_match"]
    assert all(len(v) == 3 for v in history.values()), history  # one value per trainer step
    assert all(0 <= v <= 1 for v in history["reward/last_number_matches"] + history["reward/verl_score"])
    assert all(0 <= v <= 4 for v in history["reward/verl_score/length"])  # words of <= max_new_tokens tokens
    assert history["reward/last_number_matches/failed"] == [0.0] * 3
    assert history["reward/sleeps/failed"] == [1.0] * 3 and history["reward/sleeps"] == [0.0] * 3  # timed out: 0
    for s, mean in enumerate(history["reward/mean"]):  # the total adds up by weight (a failed call adds 0)
        expected = 0.5 * history["reward/last_number_matches"][s] + history["reward/verl_score"][s]
        assert mean == pytest.approx(expected, abs=1e-5)
    assert "timed out after 0.5 s (reward.function_timeout_s)" in out.stdout + out.stderr
    final = run.data.metrics
    assert final["eval/last_number_matches"] == final["eval/accuracy"]
    assert 0.0 <= final["eval/accuracy"] <= 1.0
