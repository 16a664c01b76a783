"""`data.task: dataset`: parquet (verl's schema), JSON, JSONL and save_to_disk directories read through `datasets`,
key mapping (dotted keys), the errors (file, row, missing key, keys found), and Prompts with meta through
pickling (Ray's prompt queue) and the config rules."""

from __future__ import annotations

import json
import pickle

import pytest

datasets = pytest.importorskip("datasets")

from rlhf_core.config import ConfigError, RewardConfig, load_config  # noqa: E402
from rlhf_core.data import (  # noqa: E402
    DatasetError,
    RowKeys,
    build_prompt_splits,
    get_field,
    load_dataset_prompts,
    load_jsonl_prompts,
)
from rlhf_core.model.policy import load_tokenizer  # noqa: E402


@pytest.fixture(scope="module")
def chat_tok(chat_policy_dir):
    return load_tokenizer(chat_policy_dir)


def verl_rows(n: int, start: int = 0) -> list[dict]:
    """Rows in verl's parquet schema (as its examples/data_preprocess/gsm8k.py writes them)."""
    return [
        {
            "data_source": "openai/gsm8k",
            "prompt": [{"role": "user", "content": f"What is {i} + {i}? Answer after ####."}],
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": str(2 * i)},
            "extra_info": {"split": "train", "index": i, "answer": f"{i} + {i} = {2 * i}\n#### {2 * i}"},
        }
        for i in range(start, start + n)
    ]


def write_parquet(path, rows):
    datasets.Dataset.from_list(rows).to_parquet(str(path))
    return path


def test_verl_parquet_loads_with_no_key_settings(chat_tok, tmp_path):
    path = write_parquet(tmp_path / "train.parquet", verl_rows(4))
    prompts = load_dataset_prompts(path, chat_tok, RowKeys())
    assert [p.uid for p in prompts] == [0, 1, 2, 3]
    p = prompts[3]
    assert p.answer_text == "6" and chat_tok.encode("6", add_special_tokens=False) in p.answers
    assert p.messages == [{"role": "user", "content": "What is 3 + 3? Answer after ####."}]
    assert p.text == chat_tok.apply_chat_template(p.messages, tokenize=False, add_generation_prompt=True)
    assert p.prompt_ids == chat_tok(p.text, add_special_tokens=False)["input_ids"]
    # every column but the prompt reaches the reward functions, nested values as they are
    assert set(p.meta) == {"data_source", "ability", "reward_model", "extra_info"}
    assert p.meta["reward_model"] == {"style": "rule", "ground_truth": "6"}
    assert p.meta["extra_info"]["index"] == 3 and p.meta["data_source"] == "openai/gsm8k"


def test_system_prompt_is_rendered_and_kept_in_messages(chat_tok, tmp_path):
    path = write_parquet(tmp_path / "train.parquet", verl_rows(1))
    (p,) = load_dataset_prompts(path, chat_tok, RowKeys(), system_prompt="Be brief.")
    assert p.messages[0] == {"role": "system", "content": "Be brief."} and "Be brief." in p.text


def test_json_and_jsonl_files_with_key_mapping(chat_tok, tmp_path):
    rows = [{"question": f"q{i}?", "solution": {"final": f"\\frac{{{i}}}{{2}}"}, "id": i} for i in range(3)]
    as_json = tmp_path / "rows.json"
    as_json.write_text(json.dumps(rows))
    as_jsonl = tmp_path / "rows.jsonl"
    as_jsonl.write_text("".join(json.dumps(r) + "\n" for r in rows))
    keys = RowKeys(prompt_key="question", answer_key="solution.final")
    for path in (as_json, as_jsonl):
        prompts = load_dataset_prompts(path, chat_tok, keys)
        assert [p.answer_text for p in prompts] == ["\\frac{0}{2}", "\\frac{1}{2}", "\\frac{2}{2}"]
        assert prompts[1].messages is None  # a plain-text prompt is not a conversation
        assert "q1?" in prompts[1].text and prompts[1].text.startswith("<|im_start|>user")
        assert prompts[1].meta == {"solution": {"final": "\\frac{1}{2}"}, "id": 1}
    # the same row through the JSONL task gives the same Prompt (one code path), plus its line number
    (via_jsonl, *_) = load_jsonl_prompts(as_jsonl, chat_tok, prompt_key="question", answer_key="solution.final")
    (via_dataset, *_) = load_dataset_prompts(as_jsonl, chat_tok, keys)
    assert via_jsonl.meta.pop("line") == 1
    assert via_jsonl == via_dataset


def test_save_to_disk_directories_and_splits(chat_tok, tmp_path):
    single = tmp_path / "single"
    datasets.Dataset.from_list(verl_rows(2)).save_to_disk(str(single))
    assert [p.answer_text for p in load_dataset_prompts(single, chat_tok, RowKeys())] == ["0", "2"]

    both = tmp_path / "both"
    datasets.DatasetDict(
        {"train": datasets.Dataset.from_list(verl_rows(3)), "test": datasets.Dataset.from_list(verl_rows(2, 10))}
    ).save_to_disk(str(both))
    assert len(load_dataset_prompts(both, chat_tok, RowKeys(), split="train")) == 3
    test = load_dataset_prompts(both, chat_tok, RowKeys(), split="test", limit=1)
    assert [p.answer_text for p in test] == ["20"]
    with pytest.raises(DatasetError, match=r"holds the splits \['test', 'train'\], not 'validation'.*data.eval_split"):
        load_dataset_prompts(both, chat_tok, RowKeys(), split="validation")


def test_missing_key_names_file_row_key_and_keys_found(chat_tok, tmp_path):
    rows = verl_rows(3)
    rows[2]["reward_model"] = {"style": "rule"}  # parquet keeps the struct's field: ground_truth is null in row 2
    path = write_parquet(tmp_path / "broken.parquet", rows)
    with pytest.raises(DatasetError) as exc:
        load_dataset_prompts(path, chat_tok, RowKeys())
    msg = str(exc.value)
    assert f"{path}, row 2" in msg and "no 'answer' key (nor verl's 'reward_model.ground_truth')" in msg
    assert "['ability', 'data_source', 'extra_info', 'prompt', 'reward_model']" in msg
    assert "'reward_model' has keys ['style'] (empty: ['ground_truth'])" in msg and "data.answer_key" in msg

    with pytest.raises(DatasetError) as exc:
        load_dataset_prompts(path, chat_tok, RowKeys(prompt_key="question"))
    msg = str(exc.value)
    assert f"{path}, row 0: no prompt" in msg and "'question'" in msg and "'data_source'" in msg
    assert "data.prompt_key" in msg

    bad_messages = write_parquet(tmp_path / "m.parquet", [{"prompt": [{"role": "user"}], "answer": "1"}])
    with pytest.raises(DatasetError, match=r"m.parquet, row 0: 'prompt' message 0 must be an object with string"):
        load_dataset_prompts(bad_messages, chat_tok, RowKeys())


def test_unreadable_inputs_fail_naming_the_path(chat_tok, tmp_path):
    with pytest.raises(DatasetError, match="does not exist"):
        load_dataset_prompts(tmp_path / "missing.parquet", chat_tok, RowKeys())
    odd = tmp_path / "rows.txt"
    odd.write_text("hello")
    with pytest.raises(DatasetError, match=r"rows.txt: unknown data file type '.txt'"):
        load_dataset_prompts(odd, chat_tok, RowKeys())
    broken = tmp_path / "broken.parquet"
    broken.write_bytes(b"not parquet at all")
    with pytest.raises(DatasetError, match=r"broken.parquet: `datasets` could not read it"):
        load_dataset_prompts(broken, chat_tok, RowKeys())
    # a hub id is looked up on the hub (offline here: the error names the id and the offline mode)
    with pytest.raises(DatasetError, match=r"nobody-here/no-such-dataset: `datasets` could not read it.*Hub"):
        load_dataset_prompts("nobody-here/no-such-dataset", chat_tok, RowKeys())
    empty = write_parquet(tmp_path / "empty.parquet", [{"prompt": "x", "answer": "1"}])
    with pytest.raises(DatasetError, match="no usable rows"):
        load_dataset_prompts(empty, chat_tok, RowKeys(), limit=0)


def test_text_ground_truths_load_for_every_reward(chat_tok, tmp_path):
    rows = verl_rows(2)
    rows[1]["reward_model"]["ground_truth"] = "\\frac{3}{4}"
    path = write_parquet(tmp_path / "latex.parquet", rows)
    for components in ({"exact_match": 1.0}, {"contains": 1.0, "format": 0.1}, {"answer_after_marker": 1.0}):
        reward = RewardConfig(components=components)  # answer_after_marker matches a text answer as text
        assert load_dataset_prompts(path, chat_tok, RowKeys(reward_cfg=reward))[1].answer_text == "\\frac{3}{4}"


def test_get_field_dotted_and_literal_keys():
    row = {"a": {"b": {"c": 1}}, "x.y": 2, "n": None}
    assert get_field(row, "a.b.c") == 1 and get_field(row, "x.y") == 2
    assert get_field(row, "a.z", "absent") == "absent" and get_field(row, "n", "absent") == "absent"


def test_build_prompt_splits_dataset_task(chat_policy_dir, chat_tok, tmp_path):
    train = write_parquet(tmp_path / "train.parquet", verl_rows(8))
    test = write_parquet(tmp_path / "test.parquet", verl_rows(5, 100))
    base = ["data.task=dataset", f"data.train_path={train}", f"model.path={chat_policy_dir}", "data.eval_size=3"]
    cfg = load_config(None, [*base, f"data.eval_path={test}"])
    tr, held = build_prompt_splits(cfg.data, chat_tok, reward_cfg=cfg.reward)
    assert len(tr) == 8 and [p.answer_text for p in held] == ["200", "202", "204"]
    # without eval_path, a fifth of the training rows is held out (as for JSONL)
    tr, held = build_prompt_splits(load_config(None, base).data, chat_tok)
    assert len(held) == 1 and len(tr) == 7 and held[0].meta["extra_info"]["index"] == 0


def test_prompts_with_meta_and_messages_survive_pickling(chat_tok, tmp_path):
    """What Ray's object store does to the prompt queue's prompts."""
    from rlhf_core.data.queue import PromptQueue

    prompts = load_dataset_prompts(write_parquet(tmp_path / "t.parquet", verl_rows(3)), chat_tok, RowKeys())
    served = pickle.loads(pickle.dumps(PromptQueue(prompts, seed=0).get(3)))  # what the actor returns
    assert sorted(p.uid for p in served) == [0, 1, 2]
    assert {p.uid: p for p in served} == {p.uid: p for p in prompts}


def test_config_rules_for_dataset_and_eval():
    with pytest.raises(ConfigError, match="data.train_path is required when data.task is 'dataset'"):
        load_config(None, ["data.task=dataset", "model.path=/m"])
    with pytest.raises(ConfigError, match="data.task 'dataset' needs a model that reads text: set model.path"):
        load_config(None, ["data.task=dataset", "data.train_path=/d.parquet"])
    cfg = load_config(None, ["data.task=dataset", "data.train_path=/d.parquet", "model.preset=tiny-chat"])
    assert cfg.model.path == "" and cfg.model.preset == "tiny-chat"  # the small chat model reads any text
    with pytest.raises(ConfigError, match=r"eval.k=4 is more than eval.n_samples=2"):
        load_config(None, ["eval.n_samples=2", "eval.k=4"])
    cfg = load_config(None, ["eval.n_samples=8", "eval.k=4", "eval.temperature=0.6", "eval.top_p=0.95"])
    assert (cfg.eval.n_samples, cfg.eval.k, cfg.eval.temperature, cfg.eval.top_p) == (8, 4, 0.6, 0.95)
    assert load_config(None, ["eval.k=5"]).eval.n_samples == 0  # k is not checked while sampling is off
