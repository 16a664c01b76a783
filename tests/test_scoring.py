"""`score_responses`: the configured reward scored by hand, checked against hand-computed values and against
the training path (prompt builder + collate_prompts + the built ComposedReward) on the same rows."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from rlhf_core.config import load_config
from rlhf_core.data import DatasetError, build_chat_task, collate_prompts
from rlhf_core.run import build
from rlhf_core.scoring import Scorer, score_responses

CHAT_REWARD = ["reward.components={answer_after_marker: 1.0, exact_match: 0.5, length_penalty: 0.25}"]
CHAT_COLUMNS = ["answer_after_marker", "exact_match", "length_penalty"]
FUNCTION_COLUMNS = ["last_number_matches", "last_number_matches/failed", "verl", "verl/failed", "verl/length"]


def chat_cfg(chat_policy_dir, *extra):
    overrides = [f"model.path={chat_policy_dir}", "data.task=max3_chat", "rollout.max_new_tokens=16", *CHAT_REWARD]
    return load_config(None, [*overrides, "reward.length_target=4", *extra])


@pytest.fixture(scope="module")
def chat_scorer(chat_policy_dir):
    return Scorer(chat_cfg(chat_policy_dir))


def test_scores_by_hand_on_a_chat_model(chat_scorer):
    s = chat_scorer
    texts = [
        "so #### 72<|im_end|>",  # the answer after the marker, then the turn end
        "#### 721<|im_end|>",  # a different number: continued by a digit
        "72<|im_end|>",  # exactly the answer
        " 72<|endoftext|>junk",  # ends at <|endoftext|>, the generation_config's second stop id
        "the maximum is 72",  # no marker, no stop token: truncated
    ]
    ids = [s.tokenize(t) for t in texts]
    assert ids[0][-1] == s.tokenizer.convert_tokens_to_ids("<|im_end|>")  # special-token text is that token
    assert s.tokenizer.bos_token_id is None or s.tokenizer.bos_token_id not in ids[0]  # nothing added
    out = score_responses(s.cfg, ids, ["72"] * len(texts))
    assert list(out) == ["total", "answer_after_marker", "exact_match", "length_penalty"]
    assert out["answer_after_marker"] == [1.0, 0.0, 0.0, 0.0, 0.0]
    assert out["exact_match"] == [0.0, 0.0, 1.0, 1.0, 0.0]
    # length_penalty: -(tokens up to and including the first stop, or all of a truncated row, beyond 4) / (16 - 4)
    stops = set(s.stop_ids)
    lengths = [next((j + 1 for j, t in enumerate(r) if t in stops), len(r)) for r in ids]
    assert out["length_penalty"] == pytest.approx([-max(0, n - 4) / 12 for n in lengths])
    assert lengths[3] == 4 and lengths[0] > 4  # '<|endoftext|>' ends row 3; row 0 is penalised
    for i in range(len(texts)):
        expected = out["answer_after_marker"][i] + 0.5 * out["exact_match"][i] + 0.25 * out["length_penalty"][i]
        assert out["total"][i] == pytest.approx(expected)
    # the answer is matched in its number spellings, as in training
    assert score_responses(s.cfg, [s.tokenize("#### 1,000<|im_end|>")], ["1000"])["answer_after_marker"] == [1.0]


def test_same_numbers_as_the_training_path(chat_policy_dir, chat_scorer):
    """Prompts built by the task's prompt builder, packed by collate_prompts and scored by the reward that
    build.py builds for a rollout worker give exactly what score_responses gives from the answer texts."""
    cfg = chat_scorer.cfg
    tok = build.build_tokenizer(cfg, chat_policy_dir)
    reward = build.build_reward(cfg, tok, build.build_stop_ids(cfg, tok, chat_policy_dir))
    _, heldout = build_chat_task("max3_chat", tok, eval_size=6)
    texts = [f"so #### {p.answer_text}<|im_end|>" for p in heldout[:3]]
    texts += [f"{p.answer_text}<|im_end|>" for p in heldout[3:5]] + [f"#### {heldout[5].answer_text}9<|im_end|>"]
    rows = [tok(t, add_special_tokens=False)["input_ids"] for t in texts]
    width = max(map(len, rows))
    responses = torch.full((len(rows), width), tok.pad_token_id, dtype=torch.long)
    for i, r in enumerate(rows):
        responses[i, : len(r)] = torch.tensor(r)
    total, parts = reward(responses, collate_prompts(heldout, tok.pad_token_id).patterns)

    out = score_responses(cfg, rows, [p.answer_text for p in heldout])
    assert out["total"] == total.tolist()
    for name, values in parts.items():
        assert out[name] == values.tolist()
    assert out["answer_after_marker"] == [1.0, 1.0, 1.0, 0.0, 0.0, 0.0]
    assert out["exact_match"] == [0.0, 0.0, 0.0, 1.0, 1.0, 0.0]


def test_word_level_tiny_policy_and_truncated_rows(tiny_policy_dir, tiny_tokenizer):
    tok = tiny_tokenizer
    cfg = load_config(None, [f"model.path={tiny_policy_dir}", "rollout.max_new_tokens=4"])
    eos = tok.eos_token_id
    seven = tok.convert_tokens_to_ids("7")
    rows = [[seven, eos], [seven, seven, eos], [seven], [seven, eos, 0, 0]]
    out = score_responses(cfg, rows, ["7", "7", "7", "7"])
    assert list(out) == ["total", "exact_match"]
    # a row without EOS is a truncated response: it matches when it is exactly the answer
    assert out["exact_match"] == [1.0, 0.0, 1.0, 1.0]
    # each row scores the same alone as in a batch
    for i, r in enumerate(rows):
        assert score_responses(cfg, [r], ["7"])["total"] == [out["total"][i]]
    # the word-level task matches the answer's one tokenization, as its prompt builder does
    assert Scorer(cfg).tokenize("7") == [seven]


def test_config_from_a_yaml_path_with_overrides(tiny_policy_dir, tiny_tokenizer, tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(f"model:\n  path: {tiny_policy_dir}\nreward:\n  components: {{contains: 2.0}}\n")
    tok = tiny_tokenizer
    ids = [tok.convert_tokens_to_ids(["3", "7", "<eos>"])]
    assert score_responses(str(path), ids, ["7"]) == {"total": [2.0], "contains": [1.0]}
    out = score_responses(path, ids, ["7"], overrides=["reward.components={exact_match: 1.0}"])
    assert out == {"total": [0.0], "exact_match": [0.0]}


def test_bad_input_is_refused_naming_the_row(chat_policy_dir, chat_scorer):
    s = chat_scorer
    ids = [s.tokenize("#### 72<|im_end|>")]
    with pytest.raises(ValueError, match="1 responses but 2 answers"):
        s.score(ids, ["72", "7"])
    with pytest.raises(ValueError, match=r"row 0: token id 99999 .*vocabulary"):
        s.score([[1, 99999]], ["72"])
    with pytest.raises(DatasetError, match=r"row 0: .*contains the reward marker '####'.*answer_after_marker=true"):
        s.score(ids, ["She sold 48 + 24 = 72 clips. #### 72"])
    # a text answer is matched as text after the marker (docs/rewards.md), not refused
    assert s.score([s.tokenize("#### seventy-two<|im_end|>")], ["seventy-two"])["answer_after_marker"] == [1.0]
    # with data.answer_after_marker the whole solution is reduced to its final answer, as the loader does
    cfg = chat_cfg(chat_policy_dir, "data.answer_after_marker=true")
    assert score_responses(cfg, ids, ["She sold 48 + 24 = 72 clips. #### 72"])["answer_after_marker"] == [1.0]


EXAMPLES = Path(__file__).resolve().parents[1] / "examples" / "rewards"


def test_functions_are_columns_of_their_own_and_in_the_total(chat_policy_dir, chat_scorer):
    """With reward.functions configured, the total is training's: components + weight x each function's score;
    each function's columns come back beside the components'."""
    functions = (
        f"reward.functions=[{{path: {EXAMPLES / 'trl_style.py'}, name: last_number_matches, weight: 0.5}}, "
        f"{{path: {EXAMPLES / 'verl_style.py'}, name: compute_score, label: verl, weight: 2.0, metrics: [length]}}]"
    )
    cfg = chat_cfg(chat_policy_dir, functions, "reward.function_workers=1")
    texts = ["72<|im_end|>", "so #### 72<|im_end|>", "the maximum is 7<|im_end|>"]
    ids = [chat_scorer.tokenize(t) for t in texts]
    out = score_responses(cfg, ids, ["72"] * 3)
    assert list(out) == ["total", *CHAT_COLUMNS, *FUNCTION_COLUMNS]
    assert out["last_number_matches"] == [1.0, 1.0, 0.0]
    assert out["verl"] == pytest.approx([1.0, 0.1, 0.0])  # the first word is the answer / appears later / not at all
    assert out["verl/length"] == [1.0, 3.0, 4.0] and out["verl/failed"] == [0.0] * 3
    components = chat_scorer.score(ids, ["72"] * 3)  # the same config without the functions
    for i in range(3):
        for name in CHAT_COLUMNS:
            assert out[name][i] == components[name][i]
        expected = components["total"][i] + 0.5 * out["last_number_matches"][i] + 2.0 * out["verl"][i]
        assert out["total"][i] == pytest.approx(expected, abs=1e-6)


def test_the_reward_model_is_a_column_and_in_the_total(tiny_policy_dir, tiny_tokenizer, tiny_reward_model_dir):
    """With reward.model.path set, the RM scores prompt + response (the prompt rendered as training renders it)
    and its weighted score is in the total."""
    from rlhf_core.reward.model import RewardModelScorer

    tok = tiny_tokenizer
    cfg = load_config(
        None, [f"model.path={tiny_policy_dir}", f"reward.model.path={tiny_reward_model_dir}", "reward.model.weight=0.5"]
    )
    seven, eos = tok.convert_tokens_to_ids("7"), tok.eos_token_id
    prompts = ["max 1 7 3 =", "max 7 0 0 ="]
    rows = [[seven, eos], [seven, eos]]
    with Scorer(cfg) as scorer:
        out = scorer.score(rows, ["7", "7"], prompts=prompts)
    assert list(out) == ["total", "exact_match", "reward_model"]
    rm = RewardModelScorer(cfg.reward.model, tok, [eos], trust_remote_code=cfg.model.trust_remote_code)
    for i, prompt in enumerate(prompts):
        with torch.no_grad():
            own = float(rm.model(input_ids=torch.tensor([tok(prompt)["input_ids"] + rows[i]])).logits[0, 0])
        assert out["reward_model"][i] == pytest.approx(own, abs=1e-5)
        assert out["total"][i] == pytest.approx(out["exact_match"][i] + 0.5 * own, abs=1e-5)
    assert out["reward_model"][0] != out["reward_model"][1]  # the prompt is part of what the RM reads
