"""Does the embedded default learn? Held-out accuracy curves of the single-process loop per loss.

Runs `rlhf_core.loop.run_sync` on configs/tiny.yaml (tiny Llama, "max of three digits", CPU) for each
loss and records held-out greedy accuracy every --eval-every steps, with wall-clock time. Target: each
loss from <= 0.3 at the start to >= 0.9, within 3 minutes on a 2-core machine.

    python benchmarks/learning.py                 # grpo and m2po, table
    python benchmarks/learning.py --json          # one JSON object
    python benchmarks/learning.py --losses grpo m2po ppo --steps 400 --set trainer.lr=0.0005
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


def run_one(loss: str, steps: int, eval_every: int, overrides: list[str]) -> dict:
    from rlhf_core.config import load_config
    from rlhf_core.loop import run_sync

    with tempfile.TemporaryDirectory() as out:
        cfg = load_config(
            "configs/tiny.yaml",
            [
                f"algorithm.loss={loss}",
                f"trainer.total_steps={steps}",
                f"eval.every={eval_every}",
                "checkpoint.every=0",
                f"run.output_dir={out}",
                *overrides,
            ],
        )
        start = time.perf_counter()
        curve: list[tuple[int, float, float]] = []

        def on_step(m: dict) -> None:
            if "eval/accuracy" in m:
                curve.append((m["step"], round(m["eval/accuracy"], 3), round(time.perf_counter() - start, 1)))

        result = run_sync(cfg, on_step=on_step)
        wall = time.perf_counter() - start
    curve = (
        [(0, round(result["eval/accuracy_start"], 3), 0.0)]
        + curve
        + [(steps, round(result["eval/accuracy"], 3), round(wall, 1))]
    )
    reached = next((t for s, a, t in curve if a >= 0.9), None)
    return {
        "loss": loss,
        "steps": steps,
        "accuracy_start": result["eval/accuracy_start"],
        "accuracy_final": result["eval/accuracy"],
        "wall_s": round(wall, 1),
        "seconds_to_0.9": reached,
        "curve": curve,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--losses", nargs="+", default=["grpo", "m2po"])
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--eval-every", type=int, default=50)
    ap.add_argument("--set", dest="overrides", nargs="*", default=[], help="extra config overrides")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    import torch

    torch.set_num_threads(1)
    results = [run_one(loss, args.steps, args.eval_every, args.overrides) for loss in args.losses]
    if args.json:
        print(json.dumps({"runs": results, "torch_threads": 1, "load_avg": os.getloadavg()[0]}))
        return
    print(f"{'loss':6} {'acc start':>9} {'acc final':>9} {'wall s':>7} {'s to 0.9':>8}  curve (step, acc, s)")
    for r in results:
        print(
            f"{r['loss']:6} {r['accuracy_start']:9.3f} {r['accuracy_final']:9.3f} {r['wall_s']:7.1f} "
            f"{str(r['seconds_to_0.9']):>8}  {r['curve']}"
        )
    print(f"(load average {os.getloadavg()[0]:.1f})", file=sys.stderr)


if __name__ == "__main__":
    main()
