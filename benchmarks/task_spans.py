"""Do the loops' Prefect task runs span the training phase? One `atrlhf train` run, then its task runs read back.

Runs `atrlhf train --config <config> --set trainer.total_steps=<steps> --set cluster.host=<host>` (as `python -m
flows.cli train`: this checkout's code) in a subprocess, PREFECT_HOME in a temporary directory so that the CLI's
temporary Prefect API keeps this run's records there; then starts that API again on the same database and reads
the flow run back. Its training phase is from its log line "training ... to step N" to its last progress line
("step N/N ..."), written after the last poll's metrics reached MLflow; each loop's task run (`trainer-loop`,
`rollout-worker-<i>`) covers the part of that phase between its start and end time. A phase longer than the loops
(the flow noticing the end late) shows as a coverage under 1.

    python benchmarks/task_spans.py                          # tiny, 100 steps, the Ray host
    python benchmarks/task_spans.py --host threads --json    # one JSON object on stdout
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


async def read_spans() -> dict:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId, LogFilter, LogFilterFlowRunId
    from prefect.client.schemas.sorting import FlowRunSort, LogSort

    async with get_client() as client:
        run = (await client.read_flow_runs(sort=FlowRunSort.START_TIME_DESC, limit=1))[0]
        tasks = await client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[run.id])))
        logs = await client.read_logs(
            log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=[run.id])), sort=LogSort.TIMESTAMP_ASC
        )
    start = next(
        line.timestamp for line in logs if line.message.startswith("training ") and " to step " in line.message
    )
    end = [line.timestamp for line in logs if line.message.startswith("step ")][-1]
    phase = (end - start).total_seconds()
    loops = {}
    for t in tasks:
        if t.name == "trainer-loop" or t.name.startswith("rollout-worker-"):
            inside = (min(t.end_time, end) - max(t.start_time, start)).total_seconds()
            loops[t.name] = {"start": t.start_time.isoformat(), "end": t.end_time.isoformat(),
                             "covers": round(max(0.0, inside) / phase, 3),
                             "starts_after_s": round((t.start_time - start).total_seconds(), 3),
                             "ends_before_s": round((end - t.end_time).total_seconds(), 3)}  # fmt: skip
    return {"flow_run": run.name, "state": run.state_name, "phase_s": round(phase, 2), "loops": loops}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="configs/tiny.yaml")
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--host", default="ray", choices=["ray", "threads"])
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        env = {**os.environ, "PREFECT_HOME": str(Path(tmp) / "prefect"), "PREFECT_API_URL": ""}
        overrides = [f"trainer.total_steps={args.steps}", f"cluster.host={args.host}", f"run.output_dir={tmp}/run",
                     f"tracking.tracking_uri=sqlite:///{tmp}/mlflow.db"]  # fmt: skip
        cmd = [sys.executable, "-m", "flows.cli", "train", "--config", args.config]  # this checkout's code
        for o in overrides:
            cmd += ["--set", o]
        subprocess.run(cmd, cwd=REPO, env=env, check=True, capture_output=True)
        os.environ["PREFECT_HOME"] = env["PREFECT_HOME"]  # this process reads the same database back
        os.environ.pop("PREFECT_API_URL", None)
        from flows.local_api import local_prefect_api

        with local_prefect_api():
            out = {"config": args.config, "steps": args.steps, "host": args.host, **asyncio.run(read_spans())}
    if args.json:
        print(json.dumps(out))
        return
    print(f"{out['flow_run']} ({out['state']}), training phase {out['phase_s']} s, host {args.host}")
    for name, span in out["loops"].items():
        print(
            f"  {name:<20} covers {span['covers']:.3f} (starts {span['starts_after_s']:+.2f} s after the phase, "
            f"ends {span['ends_before_s']:+.2f} s before it)"
        )


if __name__ == "__main__":
    main()
