"""A training run's start-up on the Ray runtime: where the seconds before the first step go, and each actor's memory.

Times `DistributedRun.launch()` (the same launch `atrlhf train` does, without Prefect and MLflow) on a config
(default: configs/tiny.yaml), step by step: importing the runtime, everything before Ray (policy directory,
tokenizer, prompts, length checks; the tiny default builds its policy here the first time), starting or
joining Ray, the actors up (each is a process: its imports, model, reward), the first weights published
and loaded. Then the resident memory (RSS) of every `ray::` process, and the teardown. Every run builds the
tiny policy afresh in a temporary output directory unless --keep-policy names one to reuse.

    python benchmarks/startup.py                  # table
    python benchmarks/startup.py --json           # one JSON object on stdout, nothing else
    python benchmarks/startup.py --set rollout.num_workers=2
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from datetime import date
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))


def measure(config: str, overrides: list[str], output_dir: str) -> dict:
    t0 = time.perf_counter()
    marks: list[tuple[str, float]] = []

    def mark(name: str) -> None:
        marks.append((name, time.perf_counter()))

    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    from rlhf_core.config import load_config
    from rlhf_core.distributed import runtime as rt

    mark("import the runtime")
    cfg = load_config(config, [f"run.output_dir={output_dir}", *overrides])
    connect, get_or_fail = rt.connect, rt.get_or_fail

    def timed_connect(cluster_cfg):
        mark("before Ray: policy, tokenizer, prompts, checks")
        handle = connect(cluster_cfg)
        mark("start or join Ray")
        return handle

    def timed_get(ref, timeout, what):
        out = get_or_fail(ref, timeout, what)
        if what.startswith("the rollout workers and the trainer to start"):
            mark("actors up (their imports, models, rewards)")
        return out

    rt.connect, rt.get_or_fail = timed_connect, timed_get
    run = rt.DistributedRun(cfg)
    try:
        run.launch()
        mark("first weights published and loaded")
        rss = _ray_rss()
    finally:
        rt.connect, rt.get_or_fail = connect, get_or_fail
        run.teardown()
    mark("teardown")
    steps, prev = [], t0
    for name, t in marks:
        steps.append({"step": name, "s": t - prev})
        prev = t
    return {"steps": steps, "launch_s": sum(s["s"] for s in steps[:-1]), "rss_mb": rss}


def _ray_rss() -> dict[str, int]:
    """RSS in MB of every `ray::` process (actors by class, Ray's agents), the largest of a name kept."""
    import psutil

    out: dict[str, int] = {}
    for proc in psutil.process_iter(["cmdline", "memory_info"]):
        cmd = " ".join(proc.info["cmdline"] or [])
        if cmd.startswith("ray::") and proc.info["memory_info"] is not None:
            name = cmd.split()[0][len("ray::") :].split(".")[0]
            out[name] = max(out.get(name, 0), proc.info["memory_info"].rss // 2**20)
    return dict(sorted(out.items()))


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="configs/tiny.yaml")
    parser.add_argument("--set", dest="overrides", nargs="*", default=[], help="config overrides, key=value")
    parser.add_argument("--json", action="store_true", help="print one JSON object of all figures, nothing else")
    args = parser.parse_args(argv)
    from machine import cpu_model

    with tempfile.TemporaryDirectory() as d:
        result = measure(args.config, args.overrides, d)
    report = {"benchmark": "startup", "date": date.today().isoformat(), "cpu": cpu_model(), **result}
    report["load_average"] = list(os.getloadavg())
    if args.json:
        print(json.dumps(report))
        return
    print(f"start-up of {args.config} {' '.join(args.overrides)}, {report['cpu']}, load {report['load_average']}")
    for s in result["steps"]:
        print(f"  {s['step']:48s} {s['s']:6.2f} s")
    print(f"  {'launch, in all':48s} {result['launch_s']:6.2f} s")
    print("  RSS after launch: " + ", ".join(f"{k} {v} MB" for k, v in result["rss_mb"].items()))


if __name__ == "__main__":
    main()
