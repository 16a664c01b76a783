"""Optional supervised warm start that teaches the answer FORMAT, not the task.

Each training prompt is paired with an answer drawn uniformly from the set of distinct training answers
(not its own), written the way the configured reward reads it (after `reward.marker` when the
answer_after_marker component is on, e.g. "#### 7"), followed by EOS; the policy takes
`trainer.warm_start.steps` cross-entropy steps on them with its own AdamW (the RL optimizer is untouched).
The policy learns to emit one well-formed answer and stop, so rewards are not all zero at the start of
RL, while its accuracy stays near chance (reported as eval/accuracy_warm_start). Both runtimes call
`warm_start` on the trainer's model before the first weights are published.
"""

from __future__ import annotations

import re

import numpy as np
import torch

from rlhf_core.config import TrainConfig
from rlhf_core.data import Prompt, collate_prompts
from rlhf_core.trainer import sequence_logprobs


def warm_start_targets(cfg: TrainConfig, tokenizer, train_prompts: list[Prompt]) -> list[list[int]]:
    """The distinct training answers as response token ids in the reward's format, each ending in EOS."""
    eos = int(tokenizer.eos_token_id)
    if "answer_after_marker" in cfg.reward.components:
        texts = sorted({p.answer_text for p in train_prompts if p.answer_text})
        return [tokenizer(marked(cfg, t), add_special_tokens=False)["input_ids"] + [eos] for t in texts]
    return [list(a) + [eos] for a in sorted({tuple(p.answers[0]) for p in train_prompts if p.answers})]


def marked(cfg: TrainConfig, answer: str) -> str:
    """An answer written after reward.marker: '#### 7'; a marker that opens a brace is closed ('\\boxed{7}')."""
    marker = cfg.reward.marker
    return f"{marker}{answer}}}" if marker.endswith("{") else f"{marker} {answer}"


_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def question_numbers(prompt: Prompt) -> list[str]:
    """The numbers quoted in a prompt's question: its last user message, or its text without a chat."""
    text = prompt.text
    if prompt.messages:
        users = [m.get("content", "") for m in prompt.messages if m.get("role") == "user"]
        text = users[-1] if users else text
    return _NUMBER.findall(str(text))


def prompt_number_targets(cfg: TrainConfig, tokenizer, train_prompts: list[Prompt]) -> dict[int, list[list[int]]]:
    """Per training prompt (by position), '<marker> <n>' + EOS for every number n its question quotes."""
    eos = int(tokenizer.eos_token_id)
    out = {}
    for i, p in enumerate(train_prompts):
        nums = list(dict.fromkeys(question_numbers(p)))
        if nums:
            out[i] = [tokenizer(marked(cfg, n), add_special_tokens=False)["input_ids"] + [eos] for n in nums]
    return out


def warm_start(model, tokenizer, train_prompts: list[Prompt], cfg: TrainConfig, steps: int, progress=None) -> dict:
    """`steps` supervised steps on format targets, in place; returns warm_start/* metrics. `progress(done, loss)`,
    when given, is called after each step (whoever reports it chooses how often)."""
    rng = np.random.default_rng(cfg.trainer.seed + 1)
    per_prompt = None
    if cfg.trainer.warm_start.targets == "prompt_number":
        per_prompt = prompt_number_targets(cfg, tokenizer, train_prompts)
        if not per_prompt:
            raise ValueError(
                "trainer.warm_start.targets=prompt_number but no training prompt quotes a number in its question: "
                "use any_answer"
            )
        pool = sorted(per_prompt)  # only prompts with numbers to quote
    else:
        targets = warm_start_targets(cfg, tokenizer, train_prompts)
        pool = list(range(len(train_prompts)))
        if not targets:
            raise ValueError("trainer.warm_start.steps > 0 but the training prompts have no answers to imitate")
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.trainer.warm_start.lr or cfg.trainer.lr)
    n = cfg.trainer.prompts_per_step * cfg.rollout.samples_per_prompt
    dev = next(model.parameters()).device
    loss = torch.zeros(())
    model.train()
    for done in range(steps):
        picked = [pool[k] for k in rng.integers(0, len(pool), n)]
        prompts = [train_prompts[i] for i in picked]
        pb = collate_prompts(prompts, tokenizer.pad_token_id, cfg.data.max_prompt_tokens)
        if per_prompt is not None:
            chosen = [per_prompt[i][rng.integers(0, len(per_prompt[i]))] for i in picked]
        else:
            chosen = [targets[j] for j in rng.integers(0, len(targets), n)]
        L = max(len(t) for t in chosen)
        resp = torch.full((n, L), tokenizer.pad_token_id, dtype=torch.long)
        rmask = torch.zeros((n, L), dtype=torch.bool)
        for i, t in enumerate(chosen):
            resp[i, : len(t)] = torch.tensor(t)
            rmask[i, : len(t)] = True
        resp, rmask = resp.to(dev), rmask.to(dev)
        logprobs, _ = sequence_logprobs(model, pb.prompt_ids.to(dev), pb.prompt_mask.to(dev), resp, rmask)
        loss = -(logprobs * rmask).sum() / rmask.sum()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if progress is not None:
            progress(done + 1, float(loss.detach()))
    model.eval()
    return {"warm_start/steps": steps, "warm_start/loss": float(loss.detach())}
