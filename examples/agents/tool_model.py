"""The small chat model of configs/tiny-agent.yaml, taught the tool FORMAT before RL (not the task).

A model built from random weights never writes a `<tool_call>` block by chance, so RL alone cannot start.
This script builds the small local chat model (rlhf_core.model.chat: Qwen2, byte-level BPE, ChatML with the
Qwen2.5 / Hermes tool format) and takes supervised steps on the two turns of examples/agents/reveal_agent.py:

  turn 1: the agent's question with the `reveal` tool -> the call  <tool_call>{"name": "reveal", ...}</tool_call>
  turn 2: ... the tool's answer "a, b, c"             -> '#### d' for ONE OF THE THREE DIGITS, drawn at random

so it calls the tool and answers with a digit it was shown, but not yet the largest (right about 40 % of the
time). RL then has to learn the maximum. How well it copies decides whether RL can: 1,000 steps with a cosine lr
decay copy a shown digit in every greedy answer and in 95 % of sampled ones; the earlier 400 (or 1,200) steps at a
constant lr copied in 45 % of sampled answers, and RL then stalled between 0.3 and 0.8 depending on the seed
(docs/benchmarks.md, Agent recipe). Turn 2's prompt ids are built as the endpoint builds them (turn 1's ids, the
call's ids, the tool message's ids through the chat template), so training sees what serving sees.

    python examples/agents/tool_model.py runs/tiny-agent/tool_model
"""

from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from reveal_agent import QUESTION, TOOLS  # noqa: E402

CALL = '<tool_call>\n{"name": "reveal", "arguments": {}}\n</tool_call>'


def corpus(seed: int = 0) -> list[str]:
    """The chat model's default corpus plus the tool turns, so that the BPE merges cover them."""
    from rlhf_core.model.chat import default_corpus

    rng = random.Random(seed)
    lines = default_corpus(seed)
    for _ in range(1000):
        a, b, c = (rng.randrange(10) for _ in range(3))
        lines.append(f"# Tools\n<tools>\n{TOOLS[0]}\n</tools>\n{QUESTION}\n{CALL}\n<tool_response>\n{a}, {b}, {c}\n")
        lines.append(f"</tool_response>#### {max(a, b, c)}")
    return lines


def examples(tokenizer, stop_ids, n: int, seed: int = 0, first_every: int = 8) -> list[tuple[list[int], list[int]]]:
    """n (prompt ids, target ids) pairs: every `first_every`-th turn 1 (one fixed call, learned at once), the
    others turn 2 (reading the tool's digits is what takes the steps)."""
    from rlhf_core.env.chat import ChatFormat

    rng = random.Random(seed)
    fmt = ChatFormat(tokenizer, stop_ids, tools=TOOLS)
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    first = fmt.prompt_ids([{"role": "user", "content": QUESTION}])
    call = fmt.encode(CALL) + [end]
    out = []
    for i in range(n):
        if i % first_every == 0:
            out.append((first, call))
            continue
        digits = [rng.randrange(10) for _ in range(3)]
        tool = [{"role": "tool", "content": ", ".join(map(str, digits))}]
        out.append((first + call + fmt.observation_ids(tool, end), fmt.encode(f"#### {rng.choice(digits)}") + [end]))
    return out


def supervised(model, pairs, steps: int, lr: float, batch: int, seed: int = 0, cosine: bool = False) -> float:
    """Cross-entropy on the targets only; returns the last step's loss. cosine: a 50-step warm-up, then a cosine
    decay to a tenth of lr (a constant lr leaves the copying loose: see build_tool_model)."""
    import math

    import torch

    rng = random.Random(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)

    def factor(step: int) -> float:
        if not cosine:
            return 1.0
        return min(1.0, (step + 1) / 50) * (0.1 + 0.45 * (1 + math.cos(math.pi * min(1.0, step / steps))))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, factor)
    model.train()
    loss = torch.zeros(())
    for _ in range(steps):
        chosen = [pairs[rng.randrange(len(pairs))] for _ in range(batch)]
        width = max(len(p) + len(t) for p, t in chosen)
        ids = torch.zeros((batch, width), dtype=torch.long)
        labels = torch.full((batch, width), -100, dtype=torch.long)
        mask = torch.zeros((batch, width), dtype=torch.long)
        for i, (p, t) in enumerate(chosen):
            ids[i, : len(p) + len(t)] = torch.tensor(p + t)
            labels[i, len(p) : len(p) + len(t)] = torch.tensor(t)
            mask[i, : len(p) + len(t)] = 1
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
    model.eval()
    return float(loss.detach())


def build_tool_model(
    out_dir: str | Path,
    layers: int = 2,
    hidden: int = 128,
    heads: int = 4,
    steps: int = 1000,
    lr: float = 2e-3,
    batch: int = 64,
    seed: int = 0,
    max_positions: int = 8192,
) -> Path:
    """Build the chat model, teach it the tool format (module doc), save it to out_dir; returns out_dir.
    max_positions: its context (rotary positions: no parameters), long enough for an agent framework's own
    system prompt (smolagents' ToolCallingAgent, DSPy's adapters: thousands of tokens)."""
    import torch

    from rlhf_core.model.chat import build_chat_policy
    from rlhf_core.model.policy import load_policy, stop_token_ids

    out = Path(out_dir)
    build_chat_policy(
        out, style="instruct", layers=layers, hidden=hidden, heads=heads, seed=seed, corpus=corpus(seed),
        max_positions=max_positions,
    )  # fmt: skip
    model, tokenizer = load_policy(out, dtype="float32", device="cpu")
    torch.manual_seed(seed)
    pairs = examples(tokenizer, stop_token_ids(out, tokenizer), 4000, seed)
    loss = supervised(model, pairs, steps, lr, batch, seed, cosine=True)
    model.save_pretrained(out)
    (out / "tool_format_loss.txt").write_text(f"{loss:.4f}\n")
    return out


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", nargs="?", default="runs/tiny-agent/tool_model")
    parser.add_argument("--steps", type=int, default=1000)
    args = parser.parse_args()
    print(build_tool_model(args.out_dir, steps=args.steps))
