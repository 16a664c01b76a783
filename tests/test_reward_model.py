"""The learned reward model (rlhf_core/reward/model.py), without Ray: shared-tokenizer and re-tokenize scoring
against the model's own forward, truncation, running normalisation, bad directories refused, and the rollout
worker / trainer / single-process loop adding and logging it as reward/reward_model."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from rlhf_core.config import ConfigError, RewardModelConfig, load_config
from rlhf_core.reward.model import (
    REWARD_MODEL_NAME,
    RewardModelScorer,
    RunningMoments,
    check_reward_model_dir,
    pack_token_rows,
)


def own_forward(scorer: RewardModelScorer, ids: list[int]) -> float:
    """The RM's own forward on one unpadded row (what AutoModelForSequenceClassification returns)."""
    with torch.no_grad():
        return float(scorer.model(input_ids=torch.tensor([ids])).logits[0, 0])


def rollout_rows(prompts: list[list[int]], responses: list[list[int]], pad: int):
    """Left-padded prompts and right-padded responses, as a rollout batch holds them."""
    P, L = max(map(len, prompts)), max(map(len, responses))
    prompt_ids = torch.full((len(prompts), P), pad)
    prompt_mask = torch.zeros((len(prompts), P), dtype=torch.bool)
    response_ids = torch.full((len(responses), L), pad)
    response_mask = torch.zeros((len(responses), L), dtype=torch.bool)
    for i, (p, r) in enumerate(zip(prompts, responses)):
        prompt_ids[i, P - len(p) :], prompt_mask[i, P - len(p) :] = torch.tensor(p), True
        response_ids[i, : len(r)], response_mask[i, : len(r)] = torch.tensor(r), True
    return prompt_ids, prompt_mask, response_ids, response_mask


@pytest.fixture
def word_rows(max3_prompts, tiny_tokenizer):
    """Four prompt/response rows of the tiny task in the tiny tokenizer: responses of different lengths,
    two ending with EOS (= a stop token), one with a pad-id token inside the response."""
    train, _ = max3_prompts
    tok = tiny_tokenizer
    words = train[5].prompt_ids[2:5]  # three digits
    prompts = [train[i].prompt_ids for i in range(4)]
    responses = [words + [tok.eos_token_id], words[:1], words + words + [tok.eos_token_id], [tok.pad_token_id, *words]]
    return train[:4], prompts, responses


def test_shared_tokenizer_scores_equal_the_models_own_forward(tiny_reward_model_dir, tiny_tokenizer, word_rows):
    _, prompts, responses = word_rows
    tok = tiny_tokenizer
    cfg = RewardModelConfig(path=str(tiny_reward_model_dir), batch_size=3)
    scorer = RewardModelScorer(cfg, tok, [tok.eos_token_id])
    assert scorer.shares_tokenizer
    scores = scorer.score(*rollout_rows(prompts, responses, tok.pad_token_id))
    expected = [own_forward(scorer, p + r) for p, r in zip(prompts, responses)]
    assert scores.tolist() == pytest.approx(expected, abs=1e-5)
    assert scores.shape == (4,) and scores.dtype == torch.float32
    assert len(set(scores.tolist())) == 4  # a random RM tells the rows apart
    assert scorer.stats()["rows"] == 4


def test_long_rows_keep_their_last_max_length_tokens(tiny_reward_model_dir, tiny_tokenizer, word_rows):
    _, prompts, responses = word_rows
    tok = tiny_tokenizer
    cfg = RewardModelConfig(path=str(tiny_reward_model_dir), max_length=6)
    scorer = RewardModelScorer(cfg, tok, [tok.eos_token_id])
    scores = scorer.score(*rollout_rows(prompts, responses, tok.pad_token_id))
    expected = [own_forward(scorer, (p + r)[-6:]) for p, r in zip(prompts, responses)]
    assert scores.tolist() == pytest.approx(expected, abs=1e-5)


def test_rows_longer_than_the_rm_context_keep_their_last_tokens(tiny_reward_model_dir, tiny_tokenizer):
    """reward.model.max_length above the RM's max_position_embeddings (128 here) is capped at it."""
    tok = tiny_tokenizer
    scorer = RewardModelScorer(RewardModelConfig(path=str(tiny_reward_model_dir)), tok, [tok.eos_token_id])
    assert scorer.max_length == 128
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(4, len(tok), (n,), generator=g).tolist() for n in (150, 20)]
    responses = [[5, 6, tok.eos_token_id], [7]]
    scores = scorer.score(*rollout_rows(prompts, responses, tok.pad_token_id))
    expected = [own_forward(scorer, (p + r)[-128:]) for p, r in zip(prompts, responses)]
    assert scores.tolist() == pytest.approx(expected, abs=1e-5)


def test_pack_token_rows_is_the_real_tokens_in_order():
    ids = torch.tensor([[0, 0, 5, 6, 7, 0], [0, 8, 9, 10, 11, 12]])
    mask = ids != 0
    packed, lengths = pack_token_rows(ids, mask, max_length=4, pad_id=-1)
    assert lengths.tolist() == [3, 4]
    assert packed.tolist() == [[5, 6, 7, -1], [9, 10, 11, 12]]


def test_own_tokenizer_decodes_and_retokenizes_with_its_chat_template(chat_reward_model_dir, tiny_tokenizer, word_rows):
    """Tiny word-level policy, chat-BPE RM: the score of a row is the RM's own forward on the decoded prompt and
    response (up to the stop token) put through the RM's ChatML template and its tokenizer."""
    from transformers import AutoTokenizer

    from rlhf_core.reward.model import prompt_messages

    prompt_objs, prompts, responses = word_rows
    tok = tiny_tokenizer
    scorer = RewardModelScorer(RewardModelConfig(path=str(chat_reward_model_dir)), tok, [tok.eos_token_id])
    assert not scorer.shares_tokenizer
    messages = [prompt_messages(p, tok) for p in prompt_objs]
    scores = scorer.score(*rollout_rows(prompts, responses, tok.pad_token_id), messages=messages)

    rm_tok = AutoTokenizer.from_pretrained(str(chat_reward_model_dir))
    expected = []
    for p, r in zip(prompt_objs, responses):
        reply = tok.decode([t for t in r if t != tok.eos_token_id], skip_special_tokens=True)
        conversation = [{"role": "user", "content": p.text}, {"role": "assistant", "content": reply}]
        text = rm_tok.apply_chat_template(conversation, tokenize=False)
        assert "<|im_start|>assistant\n" + reply + "<|im_end|>" in text
        expected.append(own_forward(scorer, rm_tok(text, add_special_tokens=False)["input_ids"]))
    assert scores.tolist() == pytest.approx(expected, abs=1e-5)
    with pytest.raises(ValueError, match="messages"):
        scorer.score(*rollout_rows(prompts, responses, tok.pad_token_id))


def test_running_normalisation(tiny_reward_model_dir, tiny_tokenizer, word_rows):
    _, prompts, responses = word_rows
    tok = tiny_tokenizer
    raw_scorer = RewardModelScorer(RewardModelConfig(path=str(tiny_reward_model_dir)), tok, [tok.eos_token_id])
    cfg = RewardModelConfig(path=str(tiny_reward_model_dir), normalize="running")
    scorer = RewardModelScorer(cfg, tok, [tok.eos_token_id])
    first = rollout_rows(prompts[:2], responses[:2], tok.pad_token_id)
    second = rollout_rows(prompts[2:], responses[2:], tok.pad_token_id)
    raw = torch.cat([raw_scorer.score(*first), raw_scorer.score(*second)])
    scorer.score(*first)
    normed = scorer.score(*second)
    mean, std = raw.double().mean(), raw.double().std(unbiased=False)
    assert normed.tolist() == pytest.approx(((raw[2:] - mean) / (std + 1e-6)).tolist(), abs=1e-5)
    assert scorer.stats()["running"]["count"] == 4


def test_running_moments_match_the_whole():
    x = torch.randn(1000, dtype=torch.float64) * 3 + 2
    m = RunningMoments()
    for chunk in x.split(97):
        m.update(chunk)
    assert m.mean == pytest.approx(float(x.mean())) and m.std == pytest.approx(float(x.std(unbiased=False)))


def test_bad_reward_model_dirs_are_refused_naming_the_field(tmp_path, tiny_policy_dir, tiny_reward_model_dir):
    with pytest.raises(ConfigError, match=r"reward\.model\.path=.*does not exist"):
        check_reward_model_dir(tmp_path / "missing")
    with pytest.raises(ConfigError, match=r"reward\.model\.path=.*LlamaForCausalLM.*not a sequence-classification"):
        check_reward_model_dir(tiny_policy_dir)
    two = shutil.copytree(tiny_reward_model_dir, tmp_path / "two_labels")
    config = json.loads((two / "config.json").read_text())
    config["id2label"] = {"0": "bad", "1": "good"}
    (two / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match=r"reward\.model\.path=.*2 labels.*num_labels must be 1"):
        check_reward_model_dir(two)
    (two / "config.json").unlink()
    with pytest.raises(ConfigError, match=r"reward\.model\.path=.*no config\.json"):
        check_reward_model_dir(two)
    assert check_reward_model_dir(tiny_reward_model_dir) == tiny_reward_model_dir


def small_cfg(tmp_path, rm_dir, *extra):
    return load_config(
        None,
        [
            f"run.output_dir={tmp_path}",
            "model.preset=micro",
            "trainer.total_steps=1",
            "trainer.prompts_per_step=2",
            "rollout.samples_per_prompt=2",
            "rollout.prompts_per_batch=2",
            "data.eval_size=4",
            "eval.every=0",
            "checkpoint.every=0",
            f"reward.model.path={rm_dir}",
            "reward.model.weight=0.5",
            *extra,
        ],
    )


def test_rollout_worker_adds_the_reward_model_and_the_trainer_logs_it(tmp_path, tiny_reward_model_dir):
    """The single-process loop's parts: the worker adds 0.5 x the RM's score of each row to the tensor-native
    reward, carries it as the last reward component, and the trainer logs reward/reward_model."""
    from rlhf_core.loop import build_run, generate_step_batch

    cfg = small_cfg(tmp_path, tiny_reward_model_dir)
    parts = build_run(cfg)
    (external,) = parts.worker.external
    assert external.weights == {REWARD_MODEL_NAME: 0.5} and external.scorer.shares_tokenizer
    batch, stats = generate_step_batch(parts)
    assert cfg.reward.column_names() == ["exact_match", REWARD_MODEL_NAME]
    assert batch.reward_components.shape == (4, 2)
    native, rm = batch.reward_components.unbind(-1)
    expected = external.scorer.score(batch.prompt_ids, batch.prompt_mask, batch.response_ids, batch.response_mask)
    assert rm.tolist() == pytest.approx(expected.tolist(), abs=1e-5)
    assert batch.rewards.tolist() == pytest.approx((native + 0.5 * rm).tolist(), abs=1e-6)
    assert stats["reward/reward_model"] == pytest.approx(float(rm.mean()), abs=1e-6)
    metrics = parts.trainer.train_step(batch)
    assert metrics["reward/reward_model"] == pytest.approx(float(rm.mean()), abs=1e-6)
    assert metrics["reward/exact_match"] == pytest.approx(float(native.mean()), abs=1e-6)


def test_sync_loop_with_a_bad_reward_model_path_fails_naming_it(tmp_path, tiny_policy_dir):
    from rlhf_core.loop import build_run

    with pytest.raises(ConfigError, match=r"reward\.model\.path="):
        build_run(small_cfg(tmp_path, tiny_policy_dir))


def test_atrlhf_train_refuses_a_bad_reward_model_path_before_starting_anything(tmp_path, tiny_policy_dir):
    import subprocess
    import sys
    from pathlib import Path

    atrlhf = str(Path(sys.executable).with_name("atrlhf"))
    for path, reason in ((tmp_path / "nope", "does not exist"), (tiny_policy_dir, "not a sequence-classification")):
        out = subprocess.run(
            [atrlhf, "train", "--set", f"reward.model.path={path}", f"run.output_dir={tmp_path / 'run'}"],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert out.returncode == 2, out.stderr
        assert f"reward.model.path='{path}'" in out.stderr and reason in out.stderr
        assert not (tmp_path / "run").exists()  # nothing started, nothing written


def test_default_roles_with_a_reward_model_fit_two_cpus(tiny_reward_model_dir):
    """The README's reward-model example runs on a 2-core machine with the default resources: the RM actor
    reserves no CPU by default (it scores while the rollout workers wait on it); a reservation is still honoured."""
    from rlhf_core.distributed.cluster import required_resources

    cfg = load_config("configs/tiny.yaml", [f"reward.model.path={tiny_reward_model_dir}"])
    assert cfg.cluster.resources.reward["CPU"] == 0.0
    assert required_resources(cfg)["CPU"] <= 2
    cfg = load_config(
        "configs/tiny.yaml", [f"reward.model.path={tiny_reward_model_dir}", "cluster.resources.reward.CPU=2"]
    )
    assert required_resources(cfg)["CPU"] == required_resources(load_config("configs/tiny.yaml", []))["CPU"] + 2
