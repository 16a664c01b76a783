"""A run's own config travels with its checkpoints and exports, and a tiny policy of another shape is refused."""

from __future__ import annotations

import json

import pytest

from flows.cli import main
from rlhf_core.config import load_config
from rlhf_core.loop import build_run, save_run_checkpoint
from rlhf_core.model.policy import ModelLoadError, ensure_policy


def test_a_tiny_policy_of_another_shape_is_refused_not_ignored(tmp_path):
    cfg = load_config(None, [f"run.output_dir={tmp_path}", "model.preset=micro"])
    ensure_policy(cfg.model, cfg.data.task, cfg.run.output_dir)
    wider = load_config(None, [f"run.output_dir={tmp_path}", "model.preset=word:1x64x2"])
    with pytest.raises(ModelLoadError, match=r"model.preset=word:1x64x2 asks for hidden 64 but it has 32"):
        ensure_policy(wider.model, wider.data.task, wider.run.output_dir)


def test_evaluate_uses_the_config_inside_the_checkpoint(tmp_path, capsys):
    """Without --config, `atrlhf evaluate` scores a checkpoint on its own run's task and held-out size."""
    cfg = load_config(
        None,
        [
            f"run.output_dir={tmp_path}",
            "model.preset=micro",
            "data.task=sum2",
            "data.eval_size=7",
        ],
    )
    parts = build_run(cfg)
    ckpt = save_run_checkpoint(parts, tmp_path / "checkpoints" / "step_000000")
    assert main(["evaluate", "--checkpoint", str(ckpt), "--json"]) == 0
    captured = capsys.readouterr()
    assert "using the run's config" in captured.err
    result = json.loads(captured.out)
    assert result["eval/prompts"] == 7  # the run's data.eval_size, not the default 200
    # --set still applies on top of the run's config
    assert main(["evaluate", "--checkpoint", str(ckpt), "--json", "--set", "data.eval_size=3"]) == 0
    assert json.loads(capsys.readouterr().out)["eval/prompts"] == 3


@pytest.mark.slow
def test_evaluate_an_mlflow_run_id_uses_the_logged_models_config_and_names_the_run(tmp_path, mlflow_db, capsys):
    """`atrlhf evaluate --checkpoint <MLflow run id>` scores on the run's own task (the train_config.yaml its
    logged model holds, as a local path does) and names the run id, not a temporary download directory."""
    from rlhf_core.run.build import export_run_policy
    from tracking import MlflowTracker
    from tracking.artifacts import log_model

    uri = f"sqlite:///{mlflow_db}"
    cfg = load_config(
        None,
        [
            f"run.output_dir={tmp_path / 'runs'}",
            "model.preset=micro",
            "data.task=sum2",
            "data.eval_size=7",
            f"tracking.tracking_uri={uri}",
            "tracking.log_system_metrics=false",
        ],
    )
    parts = build_run(cfg)
    export = export_run_policy(cfg, parts.model, parts.tokenizer, tmp_path / "policy")
    tracker = MlflowTracker.start(cfg)
    log_model(tracker, export)
    tracker.end("FINISHED")
    run_id = tracker.run_id

    # the default config would score 200 max3 prompts: the run's own config says 7 sum2 ones
    assert main(["evaluate", "--checkpoint", run_id, "--set", f"tracking.tracking_uri={uri}"]) == 0
    captured = capsys.readouterr()
    assert "7 sum2 prompts" in captured.out and f"MLflow run {run_id}" in captured.out, captured.out
    assert "atrlhf-model-" not in captured.out + captured.err  # no temporary directory named
    assert f"MLflow run {run_id}'s logged model" in captured.err  # says whose config it used
    assert main(["evaluate", "--checkpoint", run_id, "--json", "--set", f"tracking.tracking_uri={uri}"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["policy"] == run_id and result["eval/prompts"] == 7
