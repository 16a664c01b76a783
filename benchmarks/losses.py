"""Policy-loss throughput: forward + backward of each loss on a [B, L] batch, float32, CPU.

Measures one call of `loss, stats = fn(...); loss.backward()` on B=64 sequences of L=256 tokens (about
80% of positions valid, as with right-padded responses), with the logprobs as the only leaf: the cost
the loss itself adds to a trainer step, not the model's. Reported for a single torch thread and for the
default thread count: median milliseconds per call and tokens per second (B·L positions / median time).

    python benchmarks/losses.py            # readable table
    python benchmarks/losses.py --json     # one JSON object on stdout, nothing else
    python benchmarks/losses.py --quick    # fewer repetitions (smoke test)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rlhf_core.algorithms import compute_grpo_loss, compute_m2po_loss, compute_ppo_loss  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchmarks/machine.py, also when imported
from machine import cpu_model  # noqa: E402

LOSSES = {
    "ppo": lambda lp, old, adv, mask, ref: compute_ppo_loss(lp, old, adv, mask),
    "grpo": lambda lp, old, adv, mask, ref: compute_grpo_loss(lp, old, adv, mask, ref_logprobs=ref, kl_coef=0.04),
    "m2po_trust_region": lambda lp, old, adv, mask, ref: compute_m2po_loss(lp, old, adv, mask, masking="trust_region"),
    "m2po_ratio_sq": lambda lp, old, adv, mask, ref: compute_m2po_loss(lp, old, adv, mask, masking="ratio_sq"),
}


def make_inputs(B: int, L: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    logprobs = -torch.rand(B, L, generator=g) * 3
    old = logprobs + 0.2 * torch.randn(B, L, generator=g)  # a few versions stale
    ref = logprobs + 0.3 * torch.randn(B, L, generator=g)
    adv = torch.randn(B, generator=g)
    lengths = torch.randint(L // 2, L + 1, (B,), generator=g)
    mask = torch.arange(L)[None, :] < lengths[:, None]
    return logprobs, old, adv, mask, ref


def time_loss(fn, inputs, reps: int, warmup: int) -> float:
    """Median seconds of one forward + backward."""
    base, old, adv, mask, ref = inputs
    times = []
    for i in range(warmup + reps):
        lp = base.clone().requires_grad_()
        t0 = time.perf_counter()
        loss, _stats = fn(lp, old, adv, mask, ref)
        loss.backward()
        dt = time.perf_counter() - t0
        if i >= warmup:
            times.append(dt)
    return statistics.median(times)


def run(B: int, L: int, reps: int, warmup: int) -> dict:
    inputs = make_inputs(B, L)
    default_threads = torch.get_num_threads()
    results = {}
    for threads in sorted({1, default_threads}):
        torch.set_num_threads(threads)
        for name, fn in LOSSES.items():
            sec = time_loss(fn, inputs, reps, warmup)
            results[f"{name}/threads={threads}"] = {
                "loss": name,
                "threads": threads,
                "ms_per_call": sec * 1e3,
                "tokens_per_s": B * L / sec,
            }
    torch.set_num_threads(default_threads)
    return {
        "benchmark": "losses",
        "B": B,
        "L": L,
        "dtype": "float32",
        "device": "cpu",
        "reps": reps,
        "torch": torch.__version__,
        "cpu": cpu_model(),
        "default_threads": default_threads,
        "loadavg_1min": os.getloadavg()[0],  # other work on the machine skews the multi-thread rows
        "results": results,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object and nothing else")
    parser.add_argument("--quick", action="store_true", help="few repetitions (smoke test)")
    parser.add_argument("--batch", type=int, default=64, help="sequences B")
    parser.add_argument("--length", type=int, default=256, help="response length L")
    parser.add_argument("--reps", type=int, default=None, help="timed repetitions (default 200, 10 with --quick)")
    args = parser.parse_args()
    reps = args.reps or (10 if args.quick else 200)
    out = run(args.batch, args.length, reps, warmup=3 if args.quick else 20)
    if args.json:
        print(json.dumps(out))
        return
    print(
        f"policy loss forward+backward, B={out['B']} L={out['L']} float32 CPU ({out['cpu']}), "
        f"torch {out['torch']}, median of {reps}, load average {out['loadavg_1min']:.2f}"
    )
    print(f"{'loss':<20} {'threads':>7} {'ms/call':>9} {'tokens/s':>12}")
    for r in out["results"].values():
        print(f"{r['loss']:<20} {r['threads']:>7} {r['ms_per_call']:>9.3f} {r['tokens_per_s']:>12,.0f}")


if __name__ == "__main__":
    main()
