"""An agent learning on CPU: the small chat model, taught the tool format, learns examples/agents/reveal_agent.py.

    python benchmarks/agent.py                                   # configs/tiny-agent.yaml
    python benchmarks/agent.py --set trainer.total_steps=50      # any config override
    python benchmarks/agent.py --json                            # one JSON object on stdout

Builds model.path with examples/agents/tool_model.py when it is not there yet (the tool format, not the task),
then runs the single-process loop (rlhf_core.loop.run_sync) and prints held-out eval/accuracy (greedy
episodes: the final '#### n' is the hidden digits' maximum) before RL (the untrained policy), every
eval.every steps and at the end, with the seconds since the start, and the agent's metrics.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from rlhf_core.config import load_config  # noqa: E402
from rlhf_core.loop import build_run, run_sync  # noqa: E402
from rlhf_core.usercode import load_attr  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="configs/tiny-agent.yaml")
    parser.add_argument("--set", action="append", default=[], help="config override key=value")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    cfg = load_config(args.config, args.set)
    start = time.perf_counter()
    if not (Path(cfg.model.path) / "config.json").is_file():
        build = load_attr(os.path.join(ROOT, "examples/agents/tool_model.py"), "build_tool_model", "benchmark")
        build(cfg.model.path)
    built_s = time.perf_counter() - start
    parts = build_run(cfg)
    curve: list[dict] = []

    def on_step(m: dict) -> None:
        row = {"step": m["step"], "s": round(time.perf_counter() - start, 1), "reward/agent": m.get("reward/agent")}
        row.update({k: m[k] for k in ("agent/requests_mean", "agent/prefix_breaks", "agent/errors") if k in m})
        if "eval/accuracy" in m:
            row["eval/accuracy"] = m["eval/accuracy"]
        curve.append(row)
        if not args.json and ("eval/accuracy" in m or m["step"] % 10 == 0):
            print(json.dumps(row), file=sys.stderr, flush=True)

    try:
        result = run_sync(cfg, parts=parts, on_step=on_step)
    finally:
        parts.worker.close()
    out = {
        "config": args.config,
        "overrides": args.set,
        "eval/accuracy_start": result.get("eval/accuracy_start"),
        "eval/accuracy": result["eval/accuracy"],
        "ratio": round(result["eval/accuracy"] / max(1e-9, result.get("eval/accuracy_start") or 0.0), 2),
        "steps": result["steps"],
        "tool_model_s": round(built_s, 1),
        "wall_s": round(time.perf_counter() - start, 1),
        "curve": [r for r in curve if "eval/accuracy" in r],
    }
    print(json.dumps(out) if args.json else json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
