"""Your own reward all the way: a reward of only your functions trains and evaluates,
eval.metric names any reward column as the held-out score, data.task=jsonl runs on the small chat model.

Real parts only: the tiny and chat models of tests/conftest.py, reward functions in real spawned processes.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from rlhf_core.config import ConfigError, load_config
from rlhf_core.loop import run_sync
from rlhf_core.run import build

EXAMPLES = Path(__file__).resolve().parents[1] / "examples" / "rewards"
CALC = Path(__file__).resolve().parents[1] / "examples" / "envs" / "calculator.py"
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
            "model.preset=micro",
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
    with pytest.raises(ConfigError, match=r"eval.metric 'exact_match' applies to single-turn evaluation"):
        load_config(None, ["eval.metric=exact_match", f"env.tools=[{{path: {CALC}, name: add}}]"])
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
            "model.preset=micro-chat",
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


# ------------------------------------------------------------------------------------ one number parser
GOLD = {"50": ["$50", "50.00", "50.", "$ 50", "050", "50"], "5000": ["5,000", "$5,000.00", "5000"]}


def test_one_number_grammar_on_the_host_and_the_device(chat_policy_dir):
    """canonical_number (prompt builders, token spellings) reads every gold answer as the device's parser does."""
    import torch

    from rlhf_core.reward.answer_forms import canonical_number, number_forms
    from rlhf_core.reward.text import TextMatcher
    from rlhf_core.reward.text.answers import answer_fields

    tok = build.build_tokenizer(load_config(None, []), chat_policy_dir)
    texts = [g for golds in GOLD.values() for g in golds]
    texts += ["-7.50", "7,2", "1.2.3", "1.000,5", "+5", ".5", "-$5", "$-5", "72abc", "Paris", "-0", "1,00"]
    canonicals = [canonical_number(t) for t in texts]
    texts += [c for c in canonicals if c is not None]  # each canonical form, read on the device too
    ids = [tok.encode(t, add_special_tokens=False) for t in texts]
    width = max(map(len, ids))
    tokens = torch.tensor([[i + [0] * (width - len(i))] for i in ids])
    lengths = torch.tensor([[len(i)] for i in ids])
    _, _, canon, is_num = answer_fields(TextMatcher.build(tok, "####", []).on("cpu")[0], tokens, lengths, 64)
    for k, host in enumerate(canonicals):
        assert bool(is_num[k, 0]) == (host is not None), texts[k]
        if host is not None:  # the device's canonical value of the text = that of the host's canonical form
            assert torch.equal(canon[k, 0], canon[texts.index(host, len(canonicals)), 0]), (texts[k], host)
    for canonical, golds in GOLD.items():
        assert {canonical_number(g) for g in golds} == {canonical}
        assert all(number_forms(g)[0] == canonical for g in golds)


@pytest.mark.parametrize("match", ["text", "tokens"])
def test_a_gold_answer_parses_the_same_in_every_component(chat_policy_dir, match):
    """'$50', '50.00', '5,000' are the numbers 50 / 5000 to exact_match, contains and answer_after_marker alike,
    in both match modes, and load (prepare_answer) for each."""
    import torch

    from rlhf_core.config import RewardConfig
    from rlhf_core.data import answer_patterns, prepare_answer
    from rlhf_core.reward.components import build_reward_fn
    from rlhf_core.reward.tensor_native import pack_patterns

    tok = build.build_tokenizer(load_config(None, []), chat_policy_dir)
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    comps = {"exact_match": 1.0, "contains": 1.0, "answer_after_marker": 1.0}
    cfg = RewardConfig(components=comps, match=match)
    reward = build_reward_fn(cfg, tok, [eos], 16)
    for canonical, golds in GOLD.items():
        responses = {
            "exact_match": canonical,
            "contains": f"it is {canonical} now",
            "answer_after_marker": f"#### {canonical}",
        }
        for gold in golds:
            text = prepare_answer(gold, "row", reward_cfg=cfg)
            for name, response in responses.items():
                ids = torch.tensor([tok.encode(response, add_special_tokens=False) + [eos]])
                patterns = reward.prepare(pack_patterns([[torch.tensor(v) for v in answer_patterns(tok, text)]]))
                _, parts = reward(ids, patterns)
                assert float(parts[name][0]) == 1.0, (match, gold, name, response)


def test_text_answers_load_and_score_after_the_marker(chat_policy_dir):
    """answer_after_marker matches text answers (docs/rewards.md): they load, and score where the docs say."""
    import torch

    from rlhf_core.config import RewardConfig
    from rlhf_core.data import answer_patterns, prepare_answer
    from rlhf_core.reward.components import build_reward_fn
    from rlhf_core.reward.tensor_native import pack_patterns

    tok = build.build_tokenizer(load_config(None, []), chat_policy_dir)
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    cfg = RewardConfig(components={"answer_after_marker": 1.0})
    reward = build_reward_fn(cfg, tok, [eos], 16)
    answer = prepare_answer("Paris", "row", reward_cfg=cfg)
    for response, want in (("#### Paris.", 1.0), ("so #### Paris", 1.0), ("#### Parisian", 0.0), ("Paris", 0.0)):
        ids = torch.tensor([tok.encode(response, add_special_tokens=False) + [eos]])
        patterns = reward.prepare(pack_patterns([[torch.tensor(v) for v in answer_patterns(tok, answer)]]))
        assert float(reward(ids, patterns)[1]["answer_after_marker"][0]) == want, response


# ------------------------------------------------------------------------------------ \boxed{...} answers
BOXED = r"""
data: {task: max3_chat}
reward:
  components: {answer_after_marker: 1.0}
  marker: '\boxed{'
  functions: [{name: math_verify, label: mv, weight: 1.0}]
eval: {metric: mv}
"""


def test_boxed_answers_with_the_marker_and_math_verify(chat_policy_dir, tmp_path):
    """`reward.marker: '\\boxed{'` reads the answer in the last \\boxed{...} (a number, or a text answer closed by
    '}'); the math_verify function compares it symbolically. Both through `atrlhf score`'s Scorer."""
    pytest.importorskip("math_verify")
    from rlhf_core.run.warm_start import marked
    from rlhf_core.scoring import Scorer

    (tmp_path / "boxed.yaml").write_text(BOXED)
    cfg = load_config(tmp_path / "boxed.yaml", [f"model.path={chat_policy_dir}", "rollout.max_new_tokens=32"])
    assert cfg.reward.marker == "\\boxed{" and marked(cfg, "72") == "\\boxed{72}"
    cases = [  # (response, answer, marker score, math_verify score)
        (r"so \boxed{72}", "72", 1.0, 1.0),
        (r"\boxed{ $72.00 }.", "72", 1.0, 1.0),
        (r"first \boxed{7}, then \boxed{72}", "72", 1.0, None),  # the last \boxed (math-verify: its own pick)
        (r"\boxed{720}", "72", 0.0, 0.0),
        (r"\boxed{1,000}", "1000", 1.0, 1.0),
        (r"\boxed{\frac{1}{2}}", r"\frac{1}{2}", 1.0, 1.0),  # a text answer, closed by '}'
        (r"\boxed{0.5}", r"\frac{1}{2}", 0.0, 1.0),  # equal in value: math_verify only
        (r"\boxed{Paris}", "Paris", 1.0, None),
        ("the answer is 72", "72", 0.0, None),  # no \boxed: the marker scores 0
    ]
    with Scorer(cfg) as s:
        out = s.score([s.tokenize(r + "<|im_end|>") for r, _, _, _ in cases], [a for _, a, _, _ in cases])
    for i, (response, answer, by_marker, by_function) in enumerate(cases):
        assert out["answer_after_marker"][i] == by_marker, (response, answer)
        if by_function is not None:
            assert out["mv"][i] == by_function, (response, answer)


def test_atrlhf_evaluate_reports_the_metric(tiny_policy_dir, capsys):
    from flows.cli import main

    overrides = [f"model.path={tiny_policy_dir}", "data.eval_size=10", "rollout.max_new_tokens=2"]
    assert main(["evaluate", "--checkpoint", str(tiny_policy_dir), "--set", *overrides, f"reward.functions=[{TRL}]",
                 "eval.metric=last_number_matches", "--json"]) == 0  # fmt: skip
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["eval/accuracy"] == result["eval/last_number_matches"]
    assert main(["evaluate", "--checkpoint", str(tiny_policy_dir), "--set", *overrides, "eval.metric=exact_match"]) == 0
    assert "held-out mean exact_match" in capsys.readouterr().out
