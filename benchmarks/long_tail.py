"""The long tail: sync, async as before, async with continuous batching, async with partial rollouts.

    python benchmarks/long_tail.py             # table
    python benchmarks/long_tail.py --json      # {"modes": {"sync": {...}, "async": {...}, "async_continuous": {...},
                                               #            "async_partial": {...}}} on stdout, nothing else
    python benchmarks/long_tail.py --steps 12 --hidden 256 --layers 4

Workload: a Llama policy (the tiny task's 19-token vocabulary, --layers x --hidden, untied head) whose output
head is zeroed, so every next token is uniform over the vocabulary: the stop probability is the same at every
token (1/19, EOS), response lengths are geometric (mean ~19; the longest of 128 rows ~5x the mean) and
`rollout.max_new_tokens` is 256. A tiny learning rate keeps the distribution (and so the workload) the same
through the run. Every mode runs `rlhf_core.distributed.run_distributed` on one local Ray instance of 2 CPUs:
one rollout worker (1 CPU) and the trainer (1 CPU), torch_threads 1, the same steps and prompts per step.

- sync:             lockstep (runtime.max_staleness=0), batch-at-a-time generation, padded training
- async:            async (runtime.max_staleness as configured), batch-at-a-time generation, padded training
- async_continuous: continuous batching (the same active rows, rollout.engine_kwargs.max_active_rows = one step's
                    rows; a call takes two steps' prompts, so ended rows are replaced) + padding-free training
- async_partial:    async_continuous + rollout.partial_rollout (weights adopted between decode steps)

Per mode: tokens_per_s (response tokens trained on / wall clock of the run), rollout_busy and trainer_busy (the
runtime's util/* fractions), token_staleness_max (max over steps of async/token_staleness_max), and
rollout_tokens_per_s (tokens generated / the rollout's busy seconds) and trainer_tokens_per_s (tokens trained /
the trainer's busy seconds), the two rates the issue's targets compare.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("RAY_DEDUP_LOGS", "0")

MODES = {
    "sync": ["runtime.max_staleness=0", "rollout.engine_kwargs.continuous_batching=false"],
    "async": ["rollout.engine_kwargs.continuous_batching=false"],
    "async_continuous": ["rollout.engine_kwargs.continuous_batching=true"],
    "async_partial": ["rollout.engine_kwargs.continuous_batching=true", "rollout.partial_rollout=true"],
}
PADDED = {"sync", "async"}  # trained on padded rows: ASYNCTENSORRLHF_NO_PADDING_FREE=1 in their Ray instance


def build_uniform_policy(out_dir: Path, layers: int, hidden: int, heads: int) -> Path:
    """The tiny task's tokenizer and a Llama whose output head is zero: every next token is uniform."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from rlhf_core.model.policy import build_tiny_tokenizer

    tokenizer = build_tiny_tokenizer()
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        max_position_embeddings=512,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
        rms_norm_eps=1e-6,
    )
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        model.lm_head.weight.zero_()
    model.config.task_name = "max3"
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return out_dir


def mode_config(args, mode: str, policy_dir: Path, output_dir: str):
    from rlhf_core.config import load_config

    rows = args.prompts_per_step * args.samples_per_prompt
    # continuous modes take two steps' prompts per call with one step's rows active: rows that end are replaced
    per_batch = args.prompts_per_step * (2 if mode.endswith(("continuous", "partial")) else 1)
    return load_config(
        ROOT / "configs" / "tiny.yaml",
        [
            f"runtime.max_staleness={args.max_staleness}",
            *MODES[mode],  # after the bound: sync's runtime.max_staleness=0 wins
            f"model.path={policy_dir}",
            "rollout.num_workers=1",
            f"rollout.samples_per_prompt={args.samples_per_prompt}",
            f"rollout.prompts_per_batch={per_batch}",
            f"rollout.engine_kwargs.max_active_rows={rows}",
            f"trainer.prompts_per_step={args.prompts_per_step}",
            f"trainer.micro_batch_size={rows}",
            f"rollout.max_new_tokens={args.max_new_tokens}",
            f"trainer.total_steps={args.steps}",
            "trainer.lr=1e-7",
            "cluster.num_cpus=2",
            "cluster.resources.rollout.CPU=1",
            "cluster.resources.trainer.CPU=1",
            "cluster.torch_threads=1",
            "data.eval_size=4",
            "eval.every=0",
            f"run.output_dir={output_dir}",
        ],
    )


def figures(result: dict) -> dict:
    fp = result["final_poll"]
    t = fp["trainer"]
    w = [x for x in fp["rollout"] if x.get("alive")][0]
    wall = result["wall_s"]
    stal = [m.get("async/token_staleness_max", 0) for m in result["metrics"]]
    return {
        "tokens_per_s": t["tokens"] / wall,
        "rollout_busy": w["busy_frac"],
        "trainer_busy": t["busy_frac"],
        "token_staleness_max": max(stal) if stal else 0,
        "rollout_tokens_per_s": w["tokens"] / w["busy_s"] if w["busy_s"] else 0.0,
        "trainer_tokens_per_s": t["tokens"] / t["busy_s"] if t["busy_s"] else 0.0,
        "wall_s": wall,
        "steps": result["steps"],
        "tokens_trained": t["tokens"],
        "response_length_mean": sum(m["response/length_mean"] for m in result["metrics"]) / len(result["metrics"]),
        "syncs_mid_batch": w.get("syncs_mid_batch", 0),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object, nothing else")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--prompts-per-step", type=int, default=8)
    parser.add_argument("--samples-per-prompt", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--max-staleness", type=int, default=2)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--modes", default=",".join(MODES), help="comma-separated subset of " + ",".join(MODES))
    args = parser.parse_args()

    import logging

    import ray

    from rlhf_core.distributed import run_distributed
    from rlhf_core.trainer.logprobs import NO_PADDING_FREE_ENV

    logging.disable(logging.WARNING)
    out: dict = {"modes": {}}
    with tempfile.TemporaryDirectory(prefix="long_tail_") as tmp:
        policy_dir = build_uniform_policy(Path(tmp) / "policy", args.layers, args.hidden, args.heads)
        for mode in args.modes.split(","):
            # a Ray instance per mode: its workers see the mode's padding switch (a benchmark switch, no config key)
            env = {NO_PADDING_FREE_ENV: "1"} if mode in PADDED else {}
            ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, runtime_env={"env_vars": env})
            try:
                cfg = mode_config(args, mode, policy_dir, str(Path(tmp) / mode))
                start = time.perf_counter()
                result = run_distributed(cfg, poll_interval_s=0.5)
                out["modes"][mode] = figures(result)
                if not args.json:
                    print(f"{mode}: {time.perf_counter() - start:.0f} s", file=sys.stderr)
            finally:
                ray.shutdown()
    if args.json:
        print(json.dumps(out))
        return
    keys = ["tokens_per_s", "rollout_tokens_per_s", "trainer_tokens_per_s", "rollout_busy", "trainer_busy"]
    keys += ["token_staleness_max", "response_length_mean", "wall_s"]
    print(f"{'mode':18s}" + "".join(f"{k:>22s}" for k in keys))
    for mode, fig in out["modes"].items():
        print(f"{mode:18s}" + "".join(f"{fig[k]:22.3f}" for k in keys))


if __name__ == "__main__":
    main()
