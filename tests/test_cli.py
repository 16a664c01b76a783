"""`atrlhf`: argument handling, fast failure on bad configs (nothing started), and `atrlhf evaluate`.

Training through the CLI end to end (with resume) is in tests/test_flow.py, which has the Prefect server.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

from flows.cli import main
from rlhf_core.checkpoint import save_checkpoint

REPO = Path(__file__).resolve().parents[1]
ATRLHF = str(Path(sys.executable).with_name("atrlhf"))
TINY_EVAL = ["data.eval_size=10", "model.tiny_hidden=32", "model.tiny_heads=2", "model.tiny_layers=1"]


def test_help_lists_the_commands():
    out = subprocess.run([ATRLHF, "--help"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0
    assert "train" in out.stdout and "evaluate" in out.stdout


def test_bad_config_on_the_command_line_exits_fast_and_starts_nothing():
    """Exit 2 with every bad field named, before prefect, ray or mlflow is even imported."""
    code = (
        "import sys; from flows.cli import main; rc = main(['train', '--set', 'trainer.total_steps=0', "
        "'rollout.engine=nope', 'foo.bar=1']); "
        "print(rc, [m for m in ('prefect', 'ray', 'mlflow', 'flows.train') if m in sys.modules])"
    )
    start = time.perf_counter()
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=REPO)
    elapsed = time.perf_counter() - start
    assert out.stdout.strip() == "2 []", out.stdout + out.stderr
    for field in ("trainer.total_steps", "rollout.engine", "foo"):
        assert field in out.stderr
    assert elapsed < 30


def test_bad_config_file_through_the_console_script(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("trainer:\n  lr: -1\n")
    out = subprocess.run([ATRLHF, "train", "--config", str(bad)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2
    assert "trainer.lr" in out.stderr and str(bad) in out.stderr
    missing = subprocess.run(
        [ATRLHF, "train", "--config", str(tmp_path / "nope.yaml")], capture_output=True, text=True, timeout=60
    )
    assert missing.returncode == 2 and "does not exist" in missing.stderr


def test_cli_module_imports_no_orchestration_at_top_level():
    code = (
        "import sys, flows.cli; "
        "print([m for m in ('prefect', 'mlflow', 'ray', 'flows.train', 'tasks') if m in sys.modules])"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=REPO)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


def bare_state(step: int):
    from rlhf_core.checkpoint import CheckpointState

    return CheckpointState(trainer={"step": step, "version": step}, data={}, rng={})


def test_evaluate_an_exported_model_dir(tiny_policy_dir, capsys):
    assert main(["evaluate", "--checkpoint", str(tiny_policy_dir), "--set", *TINY_EVAL]) == 0
    out = capsys.readouterr().out
    assert "held-out accuracy" in out and "10 max3 prompts" in out


def test_evaluate_a_checkpoint_dir_as_json(tiny_policy_dir, tiny_model, tmp_path, capsys):
    ckpt = save_checkpoint(tmp_path / "step_000001", tiny_model, bare_state(step=1))
    rc = main(["evaluate", "--checkpoint", str(ckpt), "--json", "--set", *TINY_EVAL, f"model.path={tiny_policy_dir}"])
    assert rc == 0
    result = json.loads(capsys.readouterr().out)
    assert result["policy"] == str(ckpt)
    assert 0.0 <= result["eval/accuracy"] <= 1.0 and result["eval/prompts"] == 10


def test_evaluate_a_checkpoint_of_another_shape_fails_clearly(tiny_model, tmp_path, capsys):
    ckpt = save_checkpoint(tmp_path / "run" / "checkpoints" / "step_000001", tiny_model, bare_state(step=1))
    rc = main(
        [
            "evaluate",
            "--checkpoint",
            str(ckpt),
            "--set",
            "data.eval_size=10",
            "model.tiny_hidden=64",
            f"run.output_dir={tmp_path / 'other'}",
        ]
    )
    assert rc == 1
    assert "does not match the model" in capsys.readouterr().err


def test_evaluate_something_that_is_not_a_policy(tmp_path, capsys):
    assert main(["evaluate", "--checkpoint", str(tmp_path / "missing")]) == 1
    assert "is not a checkpoint directory" in capsys.readouterr().err
