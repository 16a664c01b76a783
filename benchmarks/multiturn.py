"""Multi-turn learning on CPU: the small chat model learns examples/envs/reveal.py.

    python benchmarks/multiturn.py                                   # configs/tiny-multiturn.yaml
    python benchmarks/multiturn.py --set trainer.total_steps=50      # any config override
    python benchmarks/multiturn.py --json                            # one JSON object on stdout

Runs the single-process loop (rlhf_core.loop.run_sync) and prints held-out eval/accuracy (greedy episodes,
info["success"]) before RL, after the format warm start, every eval.every steps and at the end,
with the seconds since the start, and the best accuracy a policy that ignores the observations can reach
(examples/envs/reveal.py's blind_best: always answering the largest digit).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from rlhf_core.config import load_config  # noqa: E402
from rlhf_core.loop import build_run, run_sync  # noqa: E402
from rlhf_core.usercode import load_attr  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="configs/tiny-multiturn.yaml")
    parser.add_argument("--set", action="append", default=[], help="config override key=value")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    cfg = load_config(args.config, args.set)
    start = time.perf_counter()
    parts = build_run(cfg)
    curve: list[dict] = []

    def on_step(m: dict) -> None:
        row = {"step": m["step"], "s": round(time.perf_counter() - start, 1), "reward/env": m.get("reward/env")}
        if "eval/accuracy" in m:
            row["eval/accuracy"] = m["eval/accuracy"]
        curve.append(row)
        if not args.json and ("eval/accuracy" in m or m["step"] % 10 == 0):
            print(json.dumps(row), flush=True)

    try:
        result = run_sync(cfg, parts=parts, on_step=on_step)
    finally:
        parts.worker.close()
    kwargs = {k: cfg.env.kwargs[k] for k in ("digits", "same") if k in cfg.env.kwargs}
    blind = load_attr(cfg.env.path, "blind_best", "env.path")(**kwargs)
    out = {
        "config": args.config,
        "overrides": args.set,
        "eval/accuracy_start": result.get("eval/accuracy_start"),
        "eval/accuracy_warm_start": result.get("eval/accuracy_warm_start"),
        "eval/accuracy": result["eval/accuracy"],
        "observation_blind_best": round(blind, 3),
        "steps": result["steps"],
        "wall_s": round(time.perf_counter() - start, 1),
        "curve": [r for r in curve if "eval/accuracy" in r],
    }
    print(json.dumps(out) if args.json else json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
