"""Cost of a learned reward model per 1,000 samples on the tiny task, next to the tensor-native reward's.

Rows: real rollouts of the tiny default task (max3; the default tiny policy, 2 layers, hidden 128, built
locally), N prompts x 8 completions generated once, not timed. Then, single-threaded on the CPU, it times
scoring those same rows:
  tensor_native  the configured tensor-native reward as training builds it (build.build_reward: exact_match)
  rm_shared      reward.model with the policy's tokenizer (an RM of the tiny policy's size, built locally by
                 build_tiny_reward_model): prompt + response ids packed and scored as they are, no decode
  rm_retokenize  reward.model with its own tokenizer (a Qwen2 RM of the chat test model, byte-level BPE,
                 ChatML): decode with the policy tokenizer, apply the RM's chat template, re-tokenize, score
each at reward.model.batch_size 64 and 256. Reported: median wall-clock and CPU ms per 1,000 samples (rows)
over the repeats, and the ratio of CPU times to the tensor-native reward's. The RM's forward dominates, so
its cost grows with the RM's size (here ~0.4M parameters; a real RM is 10^3-10^4 times larger) and the
sequence length.
The Ray runtime adds one actor round trip per rollout batch (not timed here).

    python benchmarks/reward_model.py            # table
    python benchmarks/reward_model.py --json     # one JSON object on stdout, nothing else
    python benchmarks/reward_model.py --quick    # fewer prompts and repeats
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import tempfile
import time
from datetime import date
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchmarks/machine.py

from machine import cpu_model  # noqa: E402

from rlhf_core.config import RewardModelConfig, load_config  # noqa: E402
from rlhf_core.data.prompts import collate_prompts  # noqa: E402
from rlhf_core.model.chat import build_chat_policy  # noqa: E402
from rlhf_core.reward.model import RewardModelScorer, build_tiny_reward_model, prompt_messages  # noqa: E402
from rlhf_core.rollout import SamplingParams  # noqa: E402
from rlhf_core.run import build  # noqa: E402


def per_1000_ms(fn, rows: int, repeats: int) -> tuple[float, float]:
    """(wall-clock, CPU) milliseconds per 1,000 rows, medians over the repeats. On a shared, loaded machine the
    CPU time of this single-threaded process is the steadier figure."""
    fn()  # warm up
    wall, cpu = [], []
    for _ in range(repeats):
        t0, c0 = time.perf_counter(), time.process_time()
        fn()
        wall.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    return statistics.median(wall) * 1e6 / rows, statistics.median(cpu) * 1e6 / rows


def run(quick: bool) -> dict:
    torch.set_num_threads(1)
    work = Path(tempfile.mkdtemp(prefix="bench-reward-model-"))
    cfg = load_config(None, [f"run.output_dir={work / 'run'}"])
    build.setup_process(cfg, 0)
    policy_dir = build.resolve_policy_dir(cfg)
    model, tok = build.build_policy(cfg, policy_dir)
    train, _ = build.build_prompts(cfg, tok)
    n_prompts, G = (32 if quick else 128), cfg.rollout.samples_per_prompt
    prompts = train[:n_prompts]
    worker = build.build_rollout_worker(cfg, model, tok, policy_dir, seed=0)
    pb = collate_prompts(prompts, tok.pad_token_id, cfg.data.max_prompt_tokens)
    batch = worker.engine.generate(pb, G, SamplingParams.from_config(cfg.rollout))
    patterns = pb.patterns.repeat_interleave(G)
    rows = len(batch)
    stop_ids = build.build_stop_ids(cfg, tok, policy_dir)
    reward_fn = build.build_reward(cfg, tok, stop_ids)
    row_prompts = [p for p in prompts for _ in range(G)]
    messages = [prompt_messages(p, tok) for p in row_prompts]
    inputs = (batch.prompt_ids, batch.prompt_mask, batch.response_ids, batch.response_mask)

    rm_shared = build_tiny_reward_model(policy_dir, work / "rm_shared")
    chat_dir = build_chat_policy(work / "chat", layers=2, hidden=128, heads=4)
    rm_chat = build_tiny_reward_model(chat_dir, work / "rm_chat")
    repeats = 3 if quick else 7

    timed = {"tensor_native": per_1000_ms(lambda: reward_fn(batch.response_ids, patterns), rows, repeats * 5)}
    sizes = {}
    for name, path in (("rm_shared", rm_shared), ("rm_retokenize", rm_chat)):
        for bs in (64, 256):
            scorer = RewardModelScorer(RewardModelConfig(path=str(path), batch_size=bs), tok, stop_ids, device="cpu")
            assert scorer.shares_tokenizer == (name == "rm_shared")
            sizes[name] = sum(p.numel() for p in scorer.model.parameters())
            kwargs = {} if scorer.shares_tokenizer else {"messages": messages}
            timed[f"{name}_bs{bs}"] = per_1000_ms(lambda s=scorer, k=kwargs: s.score(*inputs, **k), rows, repeats)
    wall = {k: w for k, (w, _) in timed.items()}
    cpu = {k: c for k, (_, c) in timed.items()}
    return {
        "benchmark": "reward_model",
        "date": date.today().isoformat(),
        "machine": {
            "cpu": cpu_model(),
            "threads": torch.get_num_threads(),
            "torch": torch.__version__,
            "python": platform.python_version(),
        },
        "quick": quick,
        "rows": rows,
        "response_tokens_mean": float(batch.response_lengths.float().mean()),
        "prompt_tokens_mean": float(batch.prompt_mask.sum(-1).float().mean()),
        "rm_parameters": sizes,
        "wall_ms_per_1000_samples": wall,
        "cpu_ms_per_1000_samples": cpu,
        "x_tensor_native_cpu": {k: v / cpu["tensor_native"] for k, v in cpu.items()},
    }


def print_table(report: dict) -> None:
    m = report["machine"]
    print(
        f"reward model vs tensor-native reward, {m['cpu']}, {m['threads']} thread, torch {m['torch']}; "
        f"{report['rows']} rows, prompt {report['prompt_tokens_mean']:.1f} + response "
        f"{report['response_tokens_mean']:.1f} tokens{' (quick)' if report['quick'] else ''}; RM parameters "
        + ", ".join(f"{k} {v:,}" for k, v in report["rm_parameters"].items())
    )
    head = f"{'scorer':<22} | {'wall ms / 1,000':>15} | {'CPU ms / 1,000':>14} | {'x tensor-native (CPU)':>21}"
    print(head)
    print("-" * len(head))
    for k, v in report["cpu_ms_per_1000_samples"].items():
        wall, ratio = report["wall_ms_per_1000_samples"][k], report["x_tensor_native_cpu"][k]
        print(f"{k:<22} | {wall:>15.2f} | {v:>14.2f} | {ratio:>21.1f}")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object of all figures, nothing else")
    parser.add_argument("--quick", action="store_true", help="fewer prompts and repeats")
    args = parser.parse_args(argv)
    report = run(args.quick)
    if args.json:
        print(json.dumps(report))
    else:
        print_table(report)


if __name__ == "__main__":
    main()
