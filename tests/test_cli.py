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
from rlhf_core.run.checkpoint import save_checkpoint

REPO = Path(__file__).resolve().parents[1]
ATRLHF = str(Path(sys.executable).with_name("atrlhf"))
TINY_EVAL = ["data.eval_size=10", "model.preset=micro"]


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
    from rlhf_core.run.checkpoint import CheckpointState

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
            "model.preset=word:2x64x4",
            f"run.output_dir={tmp_path / 'other'}",
        ]
    )
    assert rc == 1
    assert "does not match the model" in capsys.readouterr().err


def test_evaluate_something_that_is_not_a_policy(tmp_path, capsys):
    """Refused before anything loads (exit 2, one line; tests/test_cli_checks.py has the rest)."""
    assert main(["evaluate", "--checkpoint", str(tmp_path / "missing")]) == 2
    assert "it does not exist" in capsys.readouterr().err
    (tmp_path / "junk").mkdir()
    assert main(["evaluate", "--checkpoint", str(tmp_path / "junk")]) == 2
    assert "not a checkpoint, an exported policy, a run directory or an MLflow run id" in capsys.readouterr().err


# ------------------------------------------------------------------------------------------------ score
SCORE_CHAT = ["rollout.max_new_tokens=16", "reward.components={answer_after_marker: 1.0, exact_match: 0.5}"]


def _lines(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows), encoding="utf-8")
    return path


def test_score_text_and_ids_per_line_and_means(chat_policy_dir, tmp_path, capsys):
    from rlhf_core.model.policy import load_tokenizer

    tok = load_tokenizer(chat_policy_dir)
    inp = _lines(
        tmp_path / "responses.jsonl",
        [
            {"answer": "72", "response": "so #### 72<|im_end|>"},
            {"answer": "72", "response_ids": tok.encode("72<|im_end|>", add_special_tokens=False)},
            "",
            {"answer": "72", "response": "#### 721<|im_end|>"},
        ],
    )
    args = ["score", "--input", str(inp), "--set", f"model.path={chat_policy_dir}", *SCORE_CHAT]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "3 responses; total = 1 x answer_after_marker + 0.5 x exact_match" in out
    table = [line.split() for line in out.splitlines()[2:]]
    assert table[0][0] == "1" and table[0][2:] == ["1.000", "1.000", "0.000"]
    assert table[1][0] == "2" and table[1][2:] == ["0.500", "0.000", "1.000"]
    assert table[2][0] == "4" and table[2][2:] == ["0.000", "0.000", "0.000"]
    assert table[3] == ["mean", "0.500", "0.333", "0.333"]

    assert main([*args, "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["count"] == 3 and [r["line"] for r in result["rows"]] == [1, 2, 4]
    assert [r["answer_after_marker"] for r in result["rows"]] == [1.0, 0.0, 0.0]
    assert result["rows"][1]["tokens"] == 3 and result["mean"]["total"] == 0.5


def test_score_with_the_whole_reward_functions_included(chat_policy_dir, tmp_path, capsys):
    """reward.functions are columns of their own and in the total, as in training; a row a function does not
    apply to (its None) is NaN in the table, null in JSON, and left out of that column's mean."""
    trl = Path(__file__).resolve().parents[1] / "examples" / "rewards" / "trl_style.py"
    inp = _lines(
        tmp_path / "responses.jsonl",
        [
            {"answer": "72", "response": "72<|im_end|>", "prompt": "max 70 72 3 ="},
            {"answer": "seventy-two", "response": "72<|im_end|>"},
            {"answer": "72", "response": "7<|im_end|>", "messages": [{"role": "user", "content": "max 7 72 ="}]},
        ],
    )
    args = [
        "score", "--input", str(inp), "--set", f"model.path={chat_policy_dir}", "rollout.max_new_tokens=16",
        "reward.components={exact_match: 1.0}", "reward.function_workers=1",
        f"reward.functions=[{{path: {trl}, name: last_number_matches, weight: 0.5}}]",
    ]  # fmt: skip
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "3 responses; total = 1 x exact_match + 0.5 x last_number_matches" in out
    lines = out.splitlines()
    assert lines[1].split() == [
        "line",
        "tokens",
        "total",
        "exact_match",
        "last_number_matches",
        "last_number_matches/failed",
    ]
    table = [line.split() for line in lines[2:]]
    assert table[0][2:] == ["1.500", "1.000", "1.000", "0.000"]
    assert table[1][2:] == ["0.000", "0.000", "nan", "0.000"]  # 'seventy-two' is no number: None, adds 0
    assert table[2][2:] == ["0.000", "0.000", "0.000", "0.000"]
    assert table[3] == ["mean", "0.500", "0.333", "0.500", "0.000"]
    assert main([*args, "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert [r["last_number_matches"] for r in result["rows"]] == [1.0, None, 0.0]
    assert result["mean"]["last_number_matches"] == 0.5 and result["mean"]["total"] == 0.5


def test_score_bad_input_names_file_and_line(chat_policy_dir, tmp_path, capsys):
    base = ["--set", f"model.path={chat_policy_dir}", *SCORE_CHAT]
    cases = [
        ({"response": "#### 72"}, "no 'answer' key (the line has keys ['response'])"),
        ({"answer": None, "response": "#### 72"}, "'answer' is null; write the answer"),
        ({"answer": "72"}, "exactly one of 'response' (text) or 'response_ids'"),
        ({"answer": "72", "response": "x", "response_ids": [1]}, "exactly one of"),
        ({"answer": "72", "response_ids": [1, 10**6]}, "token id 1000000"),
        ({"answer": "... #### 72", "response": "#### 72"}, "contains the reward marker '####'"),
        ('{"answer": "72", ', "invalid JSON"),
    ]
    for row, reason in cases:
        inp = _lines(tmp_path / "in.jsonl", [{"answer": "72", "response": "#### 72"}, row])
        assert main(["score", "--input", str(inp), *base]) == 1
        err = capsys.readouterr().err
        assert f"{inp}:2: " in err and reason in err, err
    latin = tmp_path / "latin1.jsonl"
    latin.write_bytes('{"answer": "72", "response": "caf\u00e9 #### 72"}\n'.encode("latin-1"))
    assert main(["score", "--input", str(latin), *base]) == 1
    assert f"{latin}:1: not UTF-8" in capsys.readouterr().err
    assert main(["score", "--input", str(tmp_path / "missing.jsonl"), *base]) == 1
    assert "does not exist" in capsys.readouterr().err


def test_score_help_says_how_text_is_tokenized():
    out = subprocess.run([ATRLHF, "score", "--help"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0
    assert "NO special tokens" in " ".join(out.stdout.split()) and "--input" in out.stdout
    top = subprocess.run([ATRLHF, "--help"], capture_output=True, text=True, timeout=60)
    assert "score" in top.stdout
