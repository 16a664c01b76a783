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
    python benchmarks/startup.py --cli            # `atrlhf train` end to end instead (below)

--cli runs `atrlhf train --config <config> --set trainer.total_steps=2 ...` in a subprocess without a configured
Prefect API (so the CLI starts its temporary one), PREFECT_HOME in a temporary directory whose database a
first, untimed run creates (as a user's ~/.prefect has one), and reports the seconds until the flow's first
log line ("Beginning flow run") and until the command exits.
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


def measure_cli(config: str, overrides: list[str], prefect_home: str, output_dir: str) -> dict:
    import subprocess

    env = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"}
    env.update(PREFECT_HOME=prefect_home, PREFECT_SERVER_ANALYTICS_ENABLED="false", RAY_USAGE_STATS_ENABLED="0")
    cmd = [str(Path(sys.executable).with_name("atrlhf")), "train", "--config", config, "--set"]
    cmd += [f"run.output_dir={output_dir}", f"tracking.tracking_uri=sqlite:///{output_dir}/mlflow.db"]
    cmd += ["trainer.total_steps=2", "tracking.log_system_metrics=false", *overrides]
    start, first = time.perf_counter(), None
    with subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) as proc:
        for line in proc.stdout:
            if first is None and "Beginning flow run" in line:
                first = time.perf_counter() - start
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} exited with {proc.returncode}")
    return {"first_flow_line_s": first, "total_s": time.perf_counter() - start}


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
    parser.add_argument("--cli", action="store_true", help="time `atrlhf train` end to end instead")
    args = parser.parse_args(argv)
    from machine import cpu_model

    with tempfile.TemporaryDirectory() as d:
        if args.cli:
            measure_cli(args.config, args.overrides, f"{d}/prefect", f"{d}/warm-up")  # creates the database
            result = measure_cli(args.config, args.overrides, f"{d}/prefect", f"{d}/run")
        else:
            result = measure(args.config, args.overrides, d)
    report = {"benchmark": "startup_cli" if args.cli else "startup", "date": date.today().isoformat()}
    report.update(cpu=cpu_model(), **result, load_average=list(os.getloadavg()))
    if args.json:
        print(json.dumps(report))
        return
    if args.cli:
        print(f"atrlhf train {args.config} (2 steps), {report['cpu']}, load {report['load_average']}")
        print(f"  first flow log line {result['first_flow_line_s']:.2f} s, exit {result['total_s']:.2f} s")
        return
    print(f"start-up of {args.config} {' '.join(args.overrides)}, {report['cpu']}, load {report['load_average']}")
    for s in result["steps"]:
        print(f"  {s['step']:48s} {s['s']:6.2f} s")
    print(f"  {'launch, in all':48s} {result['launch_s']:6.2f} s")
    print("  RSS after launch: " + ", ".join(f"{k} {v} MB" for k, v in result["rss_mb"].items()))


if __name__ == "__main__":
    main()
