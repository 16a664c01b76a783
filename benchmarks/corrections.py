"""Rollout corrections against a real engine mismatch: none / tis / mis on the tiny task with a bf16 rollout engine.

Runs `rlhf_core.loop.run_sync` on configs/tiny.yaml with `rollout.engine_kwargs.dtype: bfloat16` (the rollout model
in bf16, the trainer in float32: a mismatch as with vLLM in bf16) for each `algorithm.rollout_correction.mode` and seed,
all in one invocation, and reports time and steps to 0.9 held-out greedy accuracy, the final accuracy, and the
mismatch ledger's mean `mismatch/engine_kl` and `mismatch/drift_kl`. Target: every mode reaches 0.9.

    python benchmarks/corrections.py --seeds 0 1 2 3 4          # table
    python benchmarks/corrections.py --seeds 0 --json           # one JSON object
    python benchmarks/corrections.py --modes none tis --set rollout.engine_kwargs.dtype=float32
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


def run_one(mode: str, seed: int, steps: int, eval_every: int, overrides: list[str]) -> dict:
    from rlhf_core.config import load_config
    from rlhf_core.loop import run_sync

    with tempfile.TemporaryDirectory() as out:
        cfg = load_config(
            "configs/tiny.yaml",
            [
                "rollout.engine_kwargs.dtype=bfloat16",
                f"algorithm.rollout_correction.mode={mode}",
                f"trainer.seed={seed}",
                f"data.seed={seed}",
                f"trainer.total_steps={steps}",
                f"eval.every={eval_every}",
                "checkpoint.every=0",
                f"run.output_dir={out}",
                *overrides,
            ],
        )
        start = time.perf_counter()
        curve: list[tuple[int, float, float]] = []
        ledger: dict[str, list[float]] = {"mismatch/engine_kl": [], "mismatch/drift_kl": []}

        def on_step(m: dict) -> None:
            for key, values in ledger.items():
                if key in m:
                    values.append(m[key])
            if "eval/accuracy" in m:
                curve.append((m["version"], round(m["eval/accuracy"], 3), round(time.perf_counter() - start, 1)))

        result = run_sync(cfg, on_step=on_step)
        wall = time.perf_counter() - start
    curve = [
        (0, round(result["eval/accuracy_start"], 3), 0.0),
        *curve,
        (steps, round(result["eval/accuracy"], 3), round(wall, 1)),
    ]
    reached = next(((s, t) for s, a, t in curve if a >= 0.9), (None, None))
    return {
        "mode": mode,
        "seed": seed,
        "accuracy_final": result["eval/accuracy"],
        "steps_to_0.9": reached[0],
        "seconds_to_0.9": reached[1],
        "wall_s": round(wall, 1),
        "engine_kl_mean": statistics.fmean(ledger["mismatch/engine_kl"]) if ledger["mismatch/engine_kl"] else None,
        "drift_kl_mean": statistics.fmean(ledger["mismatch/drift_kl"]) if ledger["mismatch/drift_kl"] else None,
        "curve": curve,
    }


def summarise(runs: list[dict], modes: list[str]) -> list[dict]:
    rows = []
    for mode in modes:
        mine = [r for r in runs if r["mode"] == mode]
        reached = [r for r in mine if r["steps_to_0.9"] is not None]
        rows.append(
            {
                "mode": mode,
                "seeds": len(mine),
                "reached_0.9": len(reached),
                "steps_to_0.9_mean": statistics.fmean(r["steps_to_0.9"] for r in reached) if reached else None,
                "seconds_to_0.9_mean": statistics.fmean(r["seconds_to_0.9"] for r in reached) if reached else None,
                "accuracy_final_mean": statistics.fmean(r["accuracy_final"] for r in mine),
                "accuracy_final_min": min(r["accuracy_final"] for r in mine),
                "engine_kl_mean": statistics.fmean(
                    r["engine_kl_mean"] for r in mine if r["engine_kl_mean"] is not None
                ),
            }
        )
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--modes", nargs="+", default=["none", "tis", "mis"])
    ap.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2, 3, 4])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--eval-every", type=int, default=25)
    ap.add_argument("--set", dest="overrides", nargs="*", default=[], help="extra config overrides")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    import torch

    torch.set_num_threads(1)
    runs = []
    for seed in args.seeds:
        for mode in args.modes:
            runs.append(run_one(mode, seed, args.steps, args.eval_every, args.overrides))
            print(json.dumps({k: v for k, v in runs[-1].items() if k != "curve"}), file=sys.stderr, flush=True)
    summary = summarise(runs, args.modes)
    if args.json:
        print(json.dumps({"summary": summary, "runs": runs, "torch_threads": 1, "load_avg": os.getloadavg()[0]}))
        return
    print(
        f"{'mode':5} {'seeds':>5} {'>=0.9':>5} {'steps to 0.9':>12} {'s to 0.9':>8} {'acc final':>9} {'engine_kl':>9}"
    )
    for r in summary:
        steps = "-" if r["steps_to_0.9_mean"] is None else f"{r['steps_to_0.9_mean']:.0f}"
        secs = "-" if r["seconds_to_0.9_mean"] is None else f"{r['seconds_to_0.9_mean']:.0f}"
        print(
            f"{r['mode']:5} {r['seeds']:5d} {r['reached_0.9']:5d} {steps:>12} {secs:>8} "
            f"{r['accuracy_final_mean']:9.3f} {r['engine_kl_mean']:9.2e}"
        )
    print(f"(load average {os.getloadavg()[0]:.1f})", file=sys.stderr)


if __name__ == "__main__":
    main()
