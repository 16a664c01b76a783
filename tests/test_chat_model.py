"""The locally built chat model loads through the same path a downloaded model takes."""

from __future__ import annotations

import dataclasses
import json

from rlhf_core.model.chat import ENDOFTEXT, IM_END, max3_question
from rlhf_core.model.policy import load_policy


def test_chat_model_is_a_real_qwen2_with_byte_level_bpe_and_chatml(chat_policy_dir, base_chat_policy_dir):
    model, tok = load_policy(chat_policy_dir, dtype="float32", device="cpu")
    assert type(model).__name__ == "Qwen2ForCausalLM"
    assert tok.eos_token == IM_END and tok.pad_token == ENDOFTEXT and tok.padding_side == "left"
    generation = json.loads((chat_policy_dir / "generation_config.json").read_text())
    assert sorted(generation["eos_token_id"]) == sorted(tok.convert_tokens_to_ids([IM_END, ENDOFTEXT]))
    text = tok.apply_chat_template(
        [{"role": "user", "content": max3_question(3, 72, 5)}], tokenize=False, add_generation_prompt=True
    )
    assert text.startswith("<|im_start|>user\n") and text.endswith("<|im_start|>assistant\n")
    ids = tok("The answer is #### 72", add_special_tokens=False)["input_ids"]
    assert "Ġanswer" in tok.convert_ids_to_tokens(ids)  # byte-level BPE: Ġ marks a leading space
    assert tok.decode(ids) == "The answer is #### 72"  # and decodes back to the text

    _, base = load_policy(base_chat_policy_dir, dtype="float32", device="cpu")
    assert base.eos_token == ENDOFTEXT  # base style: the turn end is not EOS


def test_max3_chat_prompts_keep_digits_apart_and_warm_start_teaches_only_the_format(chat_policy_dir):
    """What the chat smoke task looks like to the model (docs/benchmarks.md, chat-format diagnosis): every
    prompt has the same length (no padding), each of the three digits is its own token, the same token id
    the answer uses, and the warm start's targets are '#### d' + EOS for every digit, not the prompt's answer."""
    from rlhf_core.config import load_config
    from rlhf_core.data import build_chat_task
    from rlhf_core.run.warm_start import warm_start_targets

    _, tok = load_policy(chat_policy_dir, dtype="float32", device="cpu")
    train, heldout = build_chat_task("max3_chat", tok, eval_size=50)
    assert len({len(p.prompt_ids) for p in train + heldout}) == 1
    for p in heldout[:20]:
        a, b, c = (p.meta["problem"] // 10**k % 10 for k in (2, 1, 0))  # triples are enumerated in order
        tokens = tok.convert_ids_to_tokens(p.prompt_ids)
        assert [t for t in tokens if t.isdigit()] == [str(a), str(b), str(c)]
        assert [tok.convert_ids_to_tokens(x) for x in p.answers[0]] == [str(max(a, b, c))]
    cfg = load_config("configs/chat-smoke.yaml", ["trainer.warm_start.targets=any_answer"])
    targets = warm_start_targets(cfg, tok, train)
    texts = [tok.decode(t[:-1]) for t in targets]
    assert texts == [f"#### {d}" for d in range(10)]
    assert all(t[-1] == tok.eos_token_id for t in targets)


def test_prompt_number_warm_start_quotes_the_questions_own_numbers(chat_policy_dir):
    """trainer.warm_start.targets=prompt_number: per prompt, '#### n' + EOS for each distinct number its
    question quotes (the chat template's text around it quotes none); a task whose questions quote no number
    is refused, naming the option."""
    import pytest

    from rlhf_core.config import load_config
    from rlhf_core.data import build_chat_task
    from rlhf_core.run.warm_start import prompt_number_targets, warm_start

    model, tok = load_policy(chat_policy_dir, dtype="float32", device="cpu")
    train, _ = build_chat_task("max3_chat", tok, eval_size=10)
    cfg = load_config("configs/chat-smoke.yaml", ["trainer.warm_start.targets=prompt_number"])
    per_prompt = prompt_number_targets(cfg, tok, train)
    assert sorted(per_prompt) == list(range(len(train)))
    for i, p in enumerate(train[:30]):
        a, b, c = (p.meta["problem"] // 10**k % 10 for k in (2, 1, 0))
        want = [f"#### {d}" for d in dict.fromkeys((a, b, c))]
        assert [tok.decode(t[:-1]) for t in per_prompt[i]] == want
        assert all(t[-1] == tok.eos_token_id for t in per_prompt[i])
    out = warm_start(model, tok, train, cfg, 2)
    assert out["warm_start/steps"] == 2 and out["warm_start/loss"] > 0

    wordy = [dataclasses.replace(p, text="the largest of a, b and c?", messages=None) for p in train[:5]]
    with pytest.raises(ValueError, match="warm_start.targets=prompt_number"):
        warm_start(model, tok, wordy, cfg, 1)
