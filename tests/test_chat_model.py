"""The locally built chat model loads through the same path a downloaded model takes."""

from __future__ import annotations

import json

from rlhf_core.chat_model import ENDOFTEXT, IM_END, max3_question
from rlhf_core.models import load_policy


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
