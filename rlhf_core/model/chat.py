"""A small chat model built locally, the way a downloaded one is laid out.

`build_chat_policy` trains a byte-level BPE tokenizer with `tokenizers` (Qwen2/GPT-2 style: every byte is
a token, `Ġ` marks a leading space, merges learned from a corpus), gives it the special tokens and the
ChatML chat template of Qwen2.5, builds a `Qwen2ForCausalLM` with random weights, and writes both with
`save_pretrained` plus a `generation_config.json` whose `eos_token_id` lists `<|im_end|>` and
`<|endoftext|>`. It loads back through `rlhf_core.model.policy.load_policy`, exactly as a real model directory
does. Tests use it wherever a word-level tokenizer would hide a real tokenizer's behaviour; the CPU smoke
recipe trains it.

    style="instruct"   tokenizer EOS <|im_end|>     (Qwen2.5-Instruct)
    style="base"       tokenizer EOS <|endoftext|>  (Qwen2.5 base: the turn end is not the tokenizer's EOS)
"""

from __future__ import annotations

import random
from collections.abc import Iterable
from pathlib import Path
from typing import Optional

ENDOFTEXT, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
CHAT_SPECIAL_TOKENS = [ENDOFTEXT, IM_START, IM_END]
CHATML_TEMPLATE = (
    # Without tools and tool messages this renders exactly ChatML: <|im_start|>role\ncontent<|im_end|>\n.
    # With `tools` (JSON schemas) the first turn is a system message listing them and asking for calls in
    # the Qwen2.5 / Hermes format; assistant tool calls render as <tool_call> blocks, and consecutive `tool`
    # messages as <tool_response> blocks of one user turn (rlhf_core.env.tools parses the calls).
    "{% set skip_first = false %}"
    "{% if tools %}"
    "{{ '<|im_start|>system\n' }}"
    "{% if messages and messages[0]['role'] == 'system' %}"
    "{{ messages[0]['content'] + '\n\n' }}{% set skip_first = true %}"
    "{% endif %}"
    "{{ '# Tools\n<tools>' }}"
    "{% for tool in tools %}{{ '\n' + (tool | tojson) }}{% endfor %}"
    "{{ '\n</tools>\nCall a tool with <tool_call>\n' }}"
    '{{ \'{"name": <name>, "arguments": <args>}\n</tool_call><|im_end|>\n\' }}'
    "{% endif %}"
    "{% for message in messages %}"
    "{% if loop.first and skip_first %}"
    "{% elif message['role'] == 'tool' %}"
    "{% if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}{{ '<|im_start|>user' }}{% endif %}"
    "{{ '\n<tool_response>\n' + message['content'] + '\n</tool_response>' }}"
    "{% if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}{{ '<|im_end|>\n' }}{% endif %}"
    "{% elif message['role'] == 'assistant' and message.get('tool_calls') %}"
    "{{ '<|im_start|>assistant' }}{% if message['content'] %}{{ '\n' + message['content'] }}{% endif %}"
    "{% for call in message['tool_calls'] %}{% set call = call.get('function', call) %}"
    "{{ '\n<tool_call>\n{\"name\": \"' + call['name'] + '\", \"arguments\": ' }}"
    "{{ (call['arguments'] | tojson) + '}\n</tool_call>' }}"
    "{% endfor %}{{ '<|im_end|>\n' }}"
    "{% else %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
CHAT_STYLES = ("instruct", "base")


def max3_question(a: int, b: int, c: int) -> str:
    """The chat task's question: the maximum of three numbers, answered after the '####' marker."""
    return f"max of {a}, {b}, {c}? Answer with #### n."


def default_corpus(seed: int = 0, n: int = 4000) -> list[str]:
    """Text for the BPE merges: chat turns of the max-of-three task with '#### <number>' answers, numbers
    in the forms graders accept (72, 72.0, $72, 1,000), and some plain prose."""
    rng = random.Random(seed)
    words = [
        "the",
        "answer",
        "is",
        "so",
        "maximum",
        "of",
        "and",
        "number",
        "largest",
        "first",
        "then",
        "we",
        "compare",
        "which",
        "one",
        "bigger",
        "than",
        "total",
        "sum",
        "Step",
        "Final",
    ]
    lines = []
    for _ in range(n):
        a, b, c = (rng.randrange(100) for _ in range(3))
        m = max(a, b, c)
        prose = " ".join(rng.choice(words) for _ in range(rng.randrange(3, 9)))
        answer = rng.choice([f"#### {m}", f"####{m}", f"#### {m}.", f"#### ${m}", f"#### {m}.0", f"#### {m:,}"])
        lines.append(
            f"{IM_START}user\n{max3_question(a, b, c)}{IM_END}\n{IM_START}assistant\n{prose} {answer}{IM_END}\n"
        )
        lines.append(f"{prose}. The total is {rng.randrange(10_000):,} and {rng.randrange(1000)}.")
    return lines


def train_byte_level_bpe(corpus: Iterable[str], vocab_size: int = 512):
    """A byte-level BPE `tokenizers.Tokenizer` trained on `corpus`, with the chat special tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=CHAT_SPECIAL_TOKENS,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(corpus, trainer)
    return tok


def seeded_tiny_model(
    config_cls, model_cls, seed: int, vocab_size: int, hidden: int, layers: int, heads: int, **config
):
    """A small decoder in the built-in presets' proportions (MLP width 2 x hidden, tied embeddings, RMS norm eps
    1e-6) and `config`'s other settings, its weights drawn with `seed` without touching the global RNG. Shared by
    the chat policy and the word-level tiny one (rlhf_core.model.policy)."""
    import torch

    cfg = config_cls(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        tie_word_embeddings=True,
        rms_norm_eps=1e-6,
        **config,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return model_cls(cfg)


def build_chat_policy(
    out_dir: str | Path,
    style: str = "instruct",
    layers: int = 2,
    hidden: int = 64,
    heads: int = 4,
    kv_heads: Optional[int] = None,
    vocab_size: int = 512,
    seed: int = 0,
    corpus: Optional[Iterable[str]] = None,
    max_positions: int = 512,
) -> Path:
    """Build and save a Qwen2 chat policy with a locally trained byte-level BPE tokenizer. Returns `out_dir`."""
    from transformers import GenerationConfig, PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM
    from transformers.utils import logging as hf_logging

    if style not in CHAT_STYLES:
        raise ValueError(f"unknown chat model style {style!r}; expected one of {CHAT_STYLES}")
    if hidden % heads:
        raise ValueError(f"hidden ({hidden}) must be divisible by heads ({heads})")
    hf_logging.disable_progress_bar()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    core = train_byte_level_bpe(corpus if corpus is not None else default_corpus(seed), vocab_size)
    eos = IM_END if style == "instruct" else ENDOFTEXT
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core,
        eos_token=eos,
        pad_token=ENDOFTEXT,
        additional_special_tokens=[IM_START, IM_END],
        padding_side="left",
        model_max_length=max_positions,
    )
    tokenizer.chat_template = CHATML_TEMPLATE
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in CHAT_SPECIAL_TOKENS}
    model = seeded_tiny_model(
        Qwen2Config,
        Qwen2ForCausalLM,
        seed,
        len(tokenizer),
        hidden,
        layers,
        heads,
        num_key_value_heads=kv_heads or heads,
        max_position_embeddings=max_positions,
        bos_token_id=None,
        eos_token_id=ids[eos],
        pad_token_id=ids[ENDOFTEXT],
    )
    model.generation_config = GenerationConfig(
        eos_token_id=[ids[IM_END], ids[ENDOFTEXT]], pad_token_id=ids[ENDOFTEXT], bos_token_id=None
    )
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out
