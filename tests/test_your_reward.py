"""Your own reward all the way (issue 38, item 4): a reward of only your functions trains and evaluates,
eval.metric names any reward column as the held-out score, data.task=jsonl runs on the small chat model.

Real parts only: the tiny and chat models of tests/conftest.py, reward functions in real spawned processes.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from rlhf_core import build
from rlhf_core.config import ConfigError, load_config
from rlhf_core.loop import run_sync

EXAMPLES = Path(__file__).resolve().parents[1] / "examples" / "rewards"
TRL = f"{{path: {EXAMPLES / 'trl_style.py'}, name: last_number_matches, weight: 1.0}}"
QUARTER = '''
def quarter(prompts, completions, **columns):
    """0.25 for every row but those whose answer is '5' (None: does not apply)."""
    return [None if a == "5" else 0.25 for a in columns["answer"]]
'''


def small(output_dir, *overrides):
    return load_config(
        None,
        [
            f"run.output_dir={output_dir}",
            "model.tiny_hidden=32",
            "model.tiny_layers=1",
            "model.tiny_heads=2",
            "trainer.total_steps=2",
            "trainer.prompts_per_step=4",
            "rollout.samples_per_prompt=4",
            "rollout.prompts_per_batch=2",
            "data.eval_size=16",
            "eval.every=1",
            "checkpoint.every=0",
            "reward.function_workers=1",
            *overrides,
        ],
    )


def test_a_reward_of_only_functions_is_valid_and_an_empty_one_is_not(tmp_path):
    cfg = load_config(None, ["reward.components={}", f"reward.functions=[{TRL}]"])
    assert cfg.reward.components == {} and cfg.reward.column_names() == [
        "last_number_matches",
        "last_number_matches/failed",
    ]
    with pytest.raises(ConfigError, match=r"the reward is empty: reward.components is \{\}"):
        load_config(None, ["reward.components={}"])


def test_functions_only_trains_and_logs_the_function(tmp_path):
    cfg = small(tmp_path, "reward.components={}", f"reward.functions=[{TRL}]")
    seen = []
    result = run_sync(cfg, on_step=seen.append)
    assert result["steps"] == 2 and len(seen) == 2
    for m in seen:
        assert "reward/last_number_matches" in m and "reward/exact_match" not in m
        assert 0.0 <= m["reward/last_number_matches"] <= 1.0
        assert m["reward/mean"] == pytest.approx(m["reward/last_number_matches"])  # the tensor part adds 0
        assert math.isfinite(m["loss/policy"])
    assert 0.0 <= result["eval/accuracy"] <= 1.0  # a total above 0: the function's score on held-out answers


def test_eval_metric_is_validated_against_the_reward_columns():
    with pytest.raises(ConfigError, match=r"eval.metric 'nope' is not a reward column; choose one of \['accuracy', "):
        load_config(None, ["eval.metric=nope"])
    with pytest.raises(ConfigError, match=r"'last_number_matches/failed'\]"):
        load_config(None, ["eval.metric=nope", f"reward.functions=[{TRL}]"])
    assert load_config(None, ["eval.metric=exact_match"]).eval.metric == "exact_match"
    cfg = load_config(None, ["eval.metric=last_number_matches", f"reward.functions=[{TRL}]"])
    assert build.evaluation_needs_functions(cfg)
    assert not build.evaluation_needs_functions(load_config(None, [f"reward.functions=[{TRL}]"]))


def test_eval_metric_names_a_component(tiny_policy_dir, tiny_model, max3_prompts):
    heldout = max3_prompts[1][:24]
    results = {}
    for metric in ("accuracy", "exact_match"):
        cfg = load_config(None, ["rollout.max_new_tokens=2", f"eval.metric={metric}", "eval.n_samples=2"])
        tok = build.build_tokenizer(cfg, tiny_policy_dir)
        results[metric] = build.build_evaluator(cfg, tiny_model, tok, tiny_policy_dir, heldout)()
    assert results["exact_match"]["eval/exact_match"] == results["exact_match"]["eval/accuracy"]
    assert results["exact_match"]["eval/accuracy"] == results["accuracy"]["eval/accuracy"]  # same column
    assert "eval/exact_match" not in results["accuracy"]


def test_eval_metric_names_a_function_label(tiny_policy_dir, tiny_model, max3_prompts, tmp_path):
    (tmp_path / "quarter.py").write_text(QUARTER)
    fn = f"{{path: {tmp_path / 'quarter.py'}, name: quarter, weight: 2.0}}"
    cfg = load_config(
        None, ["rollout.max_new_tokens=2", "eval.metric=quarter", f"reward.functions=[{fn}]", "eval.n_samples=2"]
    )
    tok = build.build_tokenizer(cfg, tiny_policy_dir)
    heldout = max3_prompts[1][:24]
    assert any(p.answer_text == "5" for p in heldout) and any(p.answer_text != "5" for p in heldout)
    evaluator = build.build_evaluator(cfg, tiny_model, tok, tiny_policy_dir, heldout)
    try:
        assert evaluator.owns_external and len(evaluator.external) == 1
        out = evaluator()
    finally:
        evaluator.close()
    assert out["eval/accuracy"] == out["eval/quarter"] == pytest.approx(0.25)  # rows of answer '5' left out
    # a sampled answer is correct where the column is above 0 (a row it does not apply to is not)
    applies = sum(p.answer_text != "5" for p in heldout) / len(heldout)
    assert out["eval/pass@k"] == pytest.approx(applies)
    # the function adds to the total by weight, as in training (exact_match + 2 x 0.25 where it applies)
    assert out["eval/reward_mean"] >= 2 * 0.25 * applies - 1e-6


def test_jsonl_task_runs_on_the_built_chat_model(tmp_path):
    rows = [{"prompt": f"What is the largest of {a}, {b} and 1? End with #### n.", "answer": str(max(a, b, 1))}
            for a in range(10) for b in range(3)]  # fmt: skip
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = load_config(
        None,
        [
            f"run.output_dir={tmp_path / 'run'}",
            "model.tiny_kind=chat",
            "model.tiny_hidden=32",
            "model.tiny_layers=1",
            "model.tiny_heads=2",
            "data.task=jsonl",
            f"data.train_path={data}",
            "data.eval_size=6",
            "reward.components={answer_after_marker: 1.0}",
            "rollout.max_new_tokens=6",
            "trainer.total_steps=1",
            "trainer.prompts_per_step=2",
            "rollout.samples_per_prompt=2",
            "rollout.prompts_per_batch=2",
            "eval.every=0",
            "checkpoint.every=0",
        ],
    )
    assert cfg.model.path == ""
    result = run_sync(cfg)
    assert result["steps"] == 1 and 0.0 <= result["eval/accuracy"] <= 1.0
    assert (tmp_path / "run" / "tiny_chat_policy" / "config.json").is_file()
