"""Policy loading / the tiny policy, synthetic tasks, the resumable prompt source, collation, JSONL datasets."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from rlhf_core.data import (
    DatasetError,
    Prompt,
    PromptSource,
    build_prompt_splits,
    build_synthetic_task,
    collate_prompts,
    load_jsonl_prompts,
)
from rlhf_core.model.policy import TINY_SPECIAL_TOKENS, TINY_WORDS, ModelLoadError, check_model_dir, load_policy

# ---------------------------------------------------------------------------------------------------
# Models
# ---------------------------------------------------------------------------------------------------


def _copy_without(src, dst, *names):
    shutil.copytree(src, dst)
    for name in names:
        (dst / name).unlink()
    return dst


def test_load_policy_missing_dir(tmp_path):
    missing = tmp_path / "no_such_model"
    with pytest.raises(ModelLoadError, match="does not exist") as exc:
        load_policy(missing)
    assert str(missing) in str(exc.value)


def test_load_policy_file_not_dir(tmp_path):
    f = tmp_path / "model.bin"
    f.write_text("x")
    with pytest.raises(ModelLoadError, match="not a directory"):
        load_policy(f)


def test_load_policy_without_config(tiny_policy_dir, tmp_path):
    d = _copy_without(tiny_policy_dir, tmp_path / "m", "config.json")
    with pytest.raises(ModelLoadError, match="config.json") as exc:
        load_policy(d)
    assert str(d) in str(exc.value)


def test_load_policy_corrupt_config(tiny_policy_dir, tmp_path):
    d = _copy_without(tiny_policy_dir, tmp_path / "m")
    (d / "config.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match="not valid JSON") as exc:
        load_policy(d)
    assert str(d / "config.json") in str(exc.value)


def test_load_policy_without_weights(tiny_policy_dir, tmp_path):
    d = _copy_without(tiny_policy_dir, tmp_path / "m", "model.safetensors")
    with pytest.raises(ModelLoadError, match="no weights") as exc:
        load_policy(d)
    assert str(d) in str(exc.value)


def test_load_policy_without_tokenizer(tiny_policy_dir, tmp_path):
    d = _copy_without(tiny_policy_dir, tmp_path / "m", "tokenizer.json", "tokenizer_config.json")
    with pytest.raises(ModelLoadError, match="no tokenizer files") as exc:
        load_policy(d)
    assert str(d) in str(exc.value)


def test_load_policy_corrupt_weights_names_path(tiny_policy_dir, tmp_path):
    d = _copy_without(tiny_policy_dir, tmp_path / "m")
    (d / "model.safetensors").write_bytes(b"\x00" * 64)
    with pytest.raises(ModelLoadError, match="could not load the model") as exc:
        load_policy(d)
    assert str(d) in str(exc.value)


def test_tiny_policy_round_trip(tiny_policy_dir):
    assert check_model_dir(tiny_policy_dir) == tiny_policy_dir
    model, tok = load_policy(tiny_policy_dir, dtype="float32", device="cpu")
    vocab = TINY_SPECIAL_TOKENS + TINY_WORDS
    assert len(tok) == len(vocab) == model.config.vocab_size
    assert tok.convert_ids_to_tokens(list(range(len(vocab)))) == vocab
    assert (tok.pad_token, tok.bos_token, tok.eos_token) == ("<pad>", "<bos>", "<eos>")
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id) == (0, 1, 2)
    assert model.config.eos_token_id == tok.eos_token_id and model.config.pad_token_id == tok.pad_token_id
    assert model.config.task_name == "max3"
    assert model.config.num_hidden_layers == 1 and model.config.hidden_size == 32
    assert tok.padding_side == "left"
    assert not model.training
    assert next(model.parameters()).dtype == torch.float32
    # prompts start with BOS, digits are single tokens, answers tokenize without specials
    assert tok("max 7 0 3 =")["input_ids"] == [1] + tok.convert_tokens_to_ids(["max", "7", "0", "3", "="])
    assert tok("12", add_special_tokens=False)["input_ids"] == tok.convert_tokens_to_ids(["1", "2"])
    enc = tok(["max 1 2 3 =", "5"], padding=True)
    assert enc["input_ids"][1][:4] == [0, 0, 0, 0] and enc["attention_mask"][1][:4] == [0, 0, 0, 0]
    # the same seed builds the same weights
    model2, _ = load_policy(tiny_policy_dir, dtype="float32", device="cpu")
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), model2.state_dict().values()))


def test_tiny_policy_rejects_bad_heads(tmp_path):
    from rlhf_core.model.policy import build_tiny_policy

    with pytest.raises(ValueError, match="divisible"):
        build_tiny_policy("max3", tmp_path / "x", layers=1, hidden=30, heads=4)


# ---------------------------------------------------------------------------------------------------
# Synthetic tasks
# ---------------------------------------------------------------------------------------------------


def _problem(tok, p: Prompt) -> tuple[int, ...]:
    return tuple(int(t) for t in tok.convert_ids_to_tokens(p.prompt_ids) if t.isdigit())


@pytest.mark.parametrize("task, total", [("max3", 1000), ("sum2", 100)])
def test_synthetic_splits_disjoint_deterministic_correct(tiny_tokenizer, task, total):
    tok = tiny_tokenizer
    train, held = build_synthetic_task(task, tok, heldout_frac=0.2, seed=3)
    assert len(train) + len(held) == total and len(held) == round(0.2 * total)
    train_problems = {_problem(tok, p) for p in train}
    held_problems = {_problem(tok, p) for p in held}
    assert len(train_problems) == len(train) and len(held_problems) == len(held)
    assert not train_problems & held_problems
    assert [p.uid for p in train] == list(range(len(train)))

    again_train, again_held = build_synthetic_task(task, tok, heldout_frac=0.2, seed=3)
    assert [p.prompt_ids for p in again_train] == [p.prompt_ids for p in train]
    assert [p.prompt_ids for p in again_held] == [p.prompt_ids for p in held]
    other_train, _ = build_synthetic_task(task, tok, heldout_frac=0.2, seed=4)
    assert [p.prompt_ids for p in other_train] != [p.prompt_ids for p in train]

    for p in train + held:
        digits = _problem(tok, p)
        expected = str(max(digits)) if task == "max3" else str(sum(digits))
        assert p.answer_text.replace(" ", "") == expected
        assert p.answers == [tok.convert_tokens_to_ids(list(expected))]
        assert p.prompt_ids[0] == tok.bos_token_id
        assert tok.convert_ids_to_tokens(p.prompt_ids)[1] == task[:3]


def test_synthetic_eval_size_caps_heldout(tiny_tokenizer):
    train, held = build_synthetic_task("max3", tiny_tokenizer, 0.2, 0, eval_size=25)
    full_train, full_held = build_synthetic_task("max3", tiny_tokenizer, 0.2, 0)
    assert len(held) == 25 and len(train) == 800
    assert [p.prompt_ids for p in held] == [p.prompt_ids for p in full_held[:25]]
    with pytest.raises(ValueError, match="unknown synthetic task"):
        build_synthetic_task("mul", tiny_tokenizer)


# ---------------------------------------------------------------------------------------------------
# PromptSource
# ---------------------------------------------------------------------------------------------------


def _prompts(n: int) -> list[Prompt]:
    return [Prompt(uid=i, prompt_ids=[1, 4 + i % 10], answers=[[4 + i % 10]]) for i in range(n)]


def test_prompt_source_seeded_order_and_epochs():
    prompts = _prompts(10)
    a = [p.uid for p in PromptSource(prompts, seed=1).next(30)]
    b = [p.uid for p in PromptSource(prompts, seed=1).next(30)]
    c = [p.uid for p in PromptSource(prompts, seed=2).next(30)]
    assert a == b and a != c
    for e in range(3):  # every epoch is a permutation of all prompts, each epoch a different one
        assert sorted(a[10 * e : 10 * e + 10]) == list(range(10))
    assert a[:10] != a[10:20]
    assert [p.uid for p in PromptSource(prompts, shuffle=False).next(12)] == list(range(10)) + [0, 1]


def test_prompt_source_finite_epochs():
    src = PromptSource(_prompts(4), seed=0, epochs=2)
    got = src.next(5)
    assert len(got) == 5 and not src.exhausted
    assert len(src.next(10)) == 3 and src.exhausted
    assert src.next(1) == []
    assert len(list(PromptSource(_prompts(4), epochs=1))) == 4
    with pytest.raises(ValueError):
        PromptSource([])


def test_prompt_source_resume_gives_identical_prompts():
    prompts = _prompts(7)
    ref = PromptSource(prompts, seed=5)
    ref.next(9)  # into the second epoch
    state = ref.state_dict()
    expected = [p.uid for p in ref.next(20)]

    resumed = PromptSource(prompts, seed=0)  # a different seed in the constructor: the state wins
    resumed.load_state_dict(state)
    assert [p.uid for p in resumed.next(20)] == expected
    assert state == {"epoch": 1, "index": 2, "seed": 5, "size": 7}

    with pytest.raises(ValueError, match="7 prompts.*has 8"):
        PromptSource(_prompts(8)).load_state_dict(state)


def test_prompt_source_resumed_from_trained_counts_serves_the_complement_then_whole_epochs():
    """Exactly-once resume: restored from the prompts trained on (some of epoch 1 trained, one of epoch 2
    already too, queued and buffered ones not), the source serves epoch 1's untrained prompts in epoch 1's
    order, then epoch 2 less the one trained, then epoch 3 whole."""
    prompts = _prompts(7)
    ref = PromptSource(prompts, seed=5)
    epoch0, epoch1, epoch2, epoch3 = ([p.uid for p in ref.next(7)] for _ in range(4))
    trained = {u: 1 for u in epoch0}
    for u in epoch1[:3] + epoch1[4:5]:  # epoch1[3] was buffered at the checkpoint: not trained on
        trained[u] += 1
    trained[epoch2[0]] = trained[epoch2[0]] + 1  # trained before some of epoch 1 (async)
    src = PromptSource(prompts, seed=5)
    src.resume_trained(trained, epoch=2)  # the source had served into epoch 2
    rest1 = [u for u in epoch1 if trained[u] == 1]
    rest2 = [u for u in epoch2 if trained[u] <= 2]
    got = [p.uid for p in src.next(len(rest1) + len(rest2) + 7)]
    assert got == rest1 + rest2 + epoch3
    assert epoch1[3] in rest1 and len(rest1) + len(rest2) == 14 - 4 - 1
    counts = {u: trained[u] + got.count(u) for u in trained}
    assert set(counts.values()) == {4}  # every prompt of epochs 0..3 exactly once

    # a prompt whose group was dropped long ago (never trained) is served once for the current epoch, not
    # once for every epoch it missed
    old = {u: 6 for u in epoch0}
    old[epoch0[0]] = 0
    src.resume_trained(old, epoch=6)
    epoch6 = [p.uid for p in PromptSource(prompts, seed=5).next(7 * 7)][-7:]
    assert [p.uid for p in src.next(8)] == [epoch0[0], *epoch6]


def test_prompt_queue_restores_an_old_checkpoint_from_its_position_and_says_so(caplog):
    from rlhf_core.data.queue import PromptQueue

    q = PromptQueue(_prompts(7), seed=2)
    q.top_up(4)
    q.get(3)
    state = q.state_dict()  # no "trained": a checkpoint written before exactly-once resume
    expected = [p.uid for p in q.get(5)]
    again = PromptQueue(_prompts(7), seed=2)
    with caplog.at_level("WARNING"):
        trained = again.load_state_dict(state)
    assert "no record of the prompts trained on" in caplog.text
    assert [p.uid for p in again.get(5)] == expected
    assert sum(trained.values()) == 3 and set(trained.values()) <= {0, 1}  # the 3 taken, not the queued one


# ---------------------------------------------------------------------------------------------------
# Collation
# ---------------------------------------------------------------------------------------------------


def test_collate_prompts_left_pads_and_packs_patterns():
    prompts = [
        Prompt(uid=10, prompt_ids=[1, 5, 6], answers=[[7], [8, 9]]),
        Prompt(uid=11, prompt_ids=[1, 5, 6, 7, 8], answers=[[4, 4, 4]]),
    ]
    pb = collate_prompts(prompts, pad_token_id=0)
    assert len(pb) == 2
    assert pb.prompt_ids.tolist() == [[0, 0, 1, 5, 6], [1, 5, 6, 7, 8]]
    assert pb.prompt_mask.tolist() == [[False, False, True, True, True], [True] * 5]
    assert pb.prompt_ids.dtype == torch.long and pb.prompt_mask.dtype == torch.bool
    assert pb.patterns.tokens.shape == (2, 2, 3)
    assert pb.patterns.lengths.tolist() == [[1, 2], [3, 0]]
    assert pb.patterns.tokens[0, 0, :1].tolist() == [7]
    assert pb.patterns.tokens[0, 1, :2].tolist() == [8, 9]
    assert pb.patterns.tokens[1, 0].tolist() == [4, 4, 4]
    assert pb.uids.tolist() == [10, 11]

    truncated = collate_prompts(prompts, pad_token_id=0, max_prompt_tokens=3)
    assert truncated.prompt_ids.tolist() == [[1, 5, 6], [6, 7, 8]]  # left truncation keeps the end
    with pytest.raises(ValueError):
        collate_prompts([], 0)


# ---------------------------------------------------------------------------------------------------
# JSONL datasets
# ---------------------------------------------------------------------------------------------------


def _write(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def test_jsonl_loads_prompt_and_messages_forms(tiny_tokenizer, tmp_path):
    tok = tiny_tokenizer
    path = _write(
        tmp_path / "train.jsonl",
        [
            {"prompt": "max 1 2 3 =", "answer": "3", "id": "a"},
            "",  # blank lines are skipped
            {"messages": [{"role": "user", "content": "sum 4 5 ="}], "answer": 9},
        ],
    )
    rows = load_jsonl_prompts(path, tok)
    assert len(rows) == 2
    assert rows[0].prompt_ids == tok("max 1 2 3 =")["input_ids"]
    assert rows[0].answer_text == "3" and [tok.convert_tokens_to_ids("3")] in rows[0].answers
    assert rows[0].meta == {"line": 1, "answer": "3", "id": "a"}  # every key but the prompt's
    assert rows[0].messages is None and rows[1].messages == [{"role": "user", "content": "sum 4 5 ="}]
    assert rows[1].text == "sum 4 5 =" and rows[1].answer_text == "9" and rows[1].meta["line"] == 3
    assert [r.uid for r in rows] == [0, 1]

    truncated = load_jsonl_prompts(path, tok, max_prompt_tokens=3)
    assert truncated[0].prompt_ids == tok("max 1 2 3 =")["input_ids"][-3:]


@pytest.mark.parametrize(
    "bad_line, reason",
    [
        ('{"prompt": "max 1 2 3 =", "answer": ', "invalid JSON"),
        ('{"prompt": "max 1 2 3 ="}', "answer"),
        ('{"prompt": "max 1 2 3 =", "answer": ""}', "answer"),
        ('{"answer": "3"}', "'prompt'"),
        ('{"prompt": "", "answer": "3"}', "'prompt'"),
        ('{"messages": "hi", "answer": "3"}', "'messages'"),
        ("[1, 2]", "JSON object"),
    ],
)
def test_jsonl_malformed_line_names_file_and_line(tiny_tokenizer, tmp_path, bad_line, reason):
    path = _write(tmp_path / "data.jsonl", [{"prompt": "max 1 2 3 =", "answer": "3"}, "", bad_line])
    with pytest.raises(DatasetError) as exc:
        load_jsonl_prompts(path, tiny_tokenizer)
    msg = str(exc.value)
    assert f"{path}:3" in msg
    assert reason in msg


def test_jsonl_empty_or_missing_file(tiny_tokenizer, tmp_path):
    empty = _write(tmp_path / "empty.jsonl", ["", "   "])
    with pytest.raises(DatasetError, match="no usable rows") as exc:
        load_jsonl_prompts(empty, tiny_tokenizer)
    assert str(empty) in str(exc.value)
    with pytest.raises(DatasetError, match="does not exist"):
        load_jsonl_prompts(tmp_path / "missing.jsonl", tiny_tokenizer)


def test_build_prompt_splits_jsonl_holds_out_rows(tiny_tokenizer, tmp_path):
    from rlhf_core.config import load_config

    rows = [{"prompt": f"max {i % 10} 1 2 =", "answer": str(max(i % 10, 2))} for i in range(20)]
    path = _write(tmp_path / "train.jsonl", rows)
    cfg = load_config(None, ["data.task=jsonl", f"data.train_path={path}", "model.path=/unused", "data.eval_size=3"])
    train, held = build_prompt_splits(cfg.data, tiny_tokenizer)
    assert len(held) == 3 and len(train) == 17
    assert held[0].meta["line"] == 1 and train[0].meta["line"] == 4


def test_jsonl_raw_gsm8k_lines_load_as_they_are(chat_policy_dir, tmp_path):
    """{question, answer: '... #### 72'} with prompt_key=question and answer_after_marker: the answer scored is
    the number after the reward marker, and the prompt is the chat-templated question."""
    from rlhf_core.config import load_config
    from rlhf_core.model.policy import load_tokenizer

    tok = load_tokenizer(chat_policy_dir)
    rows = [
        {"question": f"Natalia sold clips to {i} friends. How many?", "answer": f"She sold {i} + {i} ...\n#### {2 * i}"}
        for i in range(1, 7)
    ]
    rows[0]["answer"] = "It is 1,000.\n#### 1,000"
    path = _write(tmp_path / "gsm8k.jsonl", rows)
    overrides = ["data.task=jsonl", f"data.train_path={path}", f"model.path={chat_policy_dir}", "data.eval_size=2"]
    overrides += [
        "data.prompt_key=question",
        "data.answer_after_marker=true",
        "reward.components={answer_after_marker: 1}",
    ]
    cfg = load_config(None, overrides)
    train, held = build_prompt_splits(cfg.data, tok, reward_cfg=cfg.reward)
    assert len(held) == 1 and len(train) == 5  # eval_size capped at a fifth of 6 rows
    assert held[0].answer_text == "1,000" and train[0].answer_text == "4"
    assert tok.encode("1000", add_special_tokens=False) in held[0].answers  # number spellings, as ever
    assert "Natalia sold clips to 2 friends" in train[0].text and train[0].text.startswith("<|im_start|>user")
    assert train[0].meta == {"line": 2, "answer": rows[1]["answer"]}  # every key but the prompt is metadata


@pytest.mark.parametrize(
    "answer, options, reason",
    [
        ("She sold 48 + 24 = 72 clips.\n#### 72", {}, r"contains the reward marker '####'.*answer_after_marker=true"),
        ("the sum ####", {"after": True}, r"nothing follows the last '####'"),
    ],
)
def test_jsonl_answers_that_cannot_score_fail_at_load(tiny_tokenizer, tmp_path, answer, options, reason):
    from rlhf_core.config import RewardConfig

    reward = RewardConfig(components={"answer_after_marker": 1.0}) if options.get("numeric") else None
    path = _write(tmp_path / "d.jsonl", [{"prompt": "max 1 2 3 =", "answer": "3"}, {"prompt": "p", "answer": answer}])
    with pytest.raises(DatasetError, match=reason) as exc:
        load_jsonl_prompts(path, tiny_tokenizer, answer_after_marker=options.get("after", False), reward_cfg=reward)
    assert f"{path}:2: " in str(exc.value)


def test_jsonl_numbers_pass_the_numeric_check(tiny_tokenizer, tmp_path):
    from rlhf_core.config import RewardConfig

    reward = RewardConfig(components={"answer_after_marker": 1.0, "format": 0.1})
    path = _write(tmp_path / "d.jsonl", [{"prompt": "p", "answer": a} for a in ("3", 7, "1,000", "-0.5", 2.5)])
    rows = load_jsonl_prompts(path, tiny_tokenizer, reward_cfg=reward)
    assert [r.answer_text for r in rows] == ["3", "7", "1,000", "-0.5", "2.5"]
    # text answers load too: answer_after_marker matches them as text after the marker (docs/rewards.md)
    path = _write(
        tmp_path / "t.jsonl", [{"prompt": "p", "answer": "seventy-two"}, {"prompt": "q", "answer": "#### 72 clips"}]
    )
    rows = load_jsonl_prompts(path, tiny_tokenizer, answer_after_marker=True, reward_cfg=reward)
    assert [r.answer_text for r in rows] == ["seventy-two", "72 clips"]
    # without a numeric component a text answer is fine
    text = _write(tmp_path / "t.jsonl", [{"prompt": "p", "answer": "yes"}])
    assert load_jsonl_prompts(text, tiny_tokenizer, reward_cfg=RewardConfig())[0].answer_text == "yes"


def test_jsonl_custom_keys_and_missing_key_lists_the_keys_found(tiny_tokenizer, tmp_path):
    path = _write(tmp_path / "d.jsonl", [{"q": "max 1 2 3 =", "label": "3", "id": 9}])
    rows = load_jsonl_prompts(path, tiny_tokenizer, prompt_key="q", answer_key="label")
    assert rows[0].text == "max 1 2 3 =" and rows[0].answer_text == "3"
    assert rows[0].meta == {"line": 1, "label": "3", "id": 9}
    conv = _write(tmp_path / "c.jsonl", [{"conv": [{"role": "user", "content": "sum 4 5 ="}], "answer": "9"}])
    assert load_jsonl_prompts(conv, tiny_tokenizer, messages_key="conv")[0].text == "sum 4 5 ="

    with pytest.raises(DatasetError) as exc:
        load_jsonl_prompts(path, tiny_tokenizer)  # default keys: no 'answer'
    msg = str(exc.value)
    assert f"{path}:1: no 'answer' key" in msg and "['id', 'label', 'q']" in msg and "data.answer_key" in msg
    with pytest.raises(DatasetError) as exc:
        load_jsonl_prompts(path, tiny_tokenizer, answer_key="label")  # no 'prompt'
    msg = str(exc.value)
    assert f"{path}:1: " in msg and "'prompt'" in msg and "['id', 'label', 'q']" in msg and "data.prompt_key" in msg


def test_jsonl_not_utf8_names_file_and_line(tiny_tokenizer, tmp_path):
    path = tmp_path / "latin1.jsonl"
    good = json.dumps({"prompt": "max 1 2 3 =", "answer": "3"}).encode()
    path.write_bytes(good + b"\n" + '{"prompt": "caf\u00e9", "answer": "3"}'.encode("latin-1") + b"\n")
    with pytest.raises(DatasetError) as exc:
        load_jsonl_prompts(path, tiny_tokenizer)
    msg = str(exc.value)
    assert f"{path}:2: not UTF-8" in msg and "0xe9" in msg and "iconv" in msg
    # a UTF-8 byte-order mark is not an error
    bom = tmp_path / "bom.jsonl"
    bom.write_bytes(b"\xef\xbb\xbf" + good + b"\n")
    assert load_jsonl_prompts(bom, tiny_tokenizer)[0].answer_text == "3"


def test_config_data_keys_must_differ_and_marker_split_needs_a_marker():
    from rlhf_core.config import ConfigError, load_config

    cfg = load_config(None, ["data.prompt_key=question", "data.answer_after_marker=true"])
    assert (cfg.data.prompt_key, cfg.data.answer_key) == ("question", "answer")
    with pytest.raises(ConfigError, match="data.prompt_key, data.answer_key must name different"):
        load_config(None, ["data.prompt_key=answer"])
    with pytest.raises(ConfigError, match="data.answer_after_marker needs a non-empty reward.marker"):
        load_config(None, ["data.answer_after_marker=true", "reward.marker=''"])
    with pytest.raises(ConfigError, match="data.answer_key"):
        load_config(None, ["data.answer_key=''"])
