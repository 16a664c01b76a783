"""`atrlhf scale <run dir | MLflow run id> --rollout-workers N`: change the rollout fleet of a live run.

The request goes through the run's directory (`rlhf_core.run.requests`): the run's supervision (the Prefect flow,
a deployment's worker or `run_distributed`, on this machine or wherever the directory is shared) reads it at its
next poll, applies it through the fleet policy (`rlhf_core.autoscale`: refused while cluster.autoscale owns the
fleet) and answers; this command waits for the answer (--wait-s) and prints it. The change shows in the Prefect
UI as a health event and in MLflow as `cluster/rollout_workers`.
"""

from __future__ import annotations

import os
import re
import sys
import time
from pathlib import Path
from typing import Optional

from rlhf_core.run.requests import read_answer, request_scale

RUN_ID = re.compile(r"^[0-9a-f]{32}$")


class ScaleError(ValueError):
    """The target is neither a run directory nor an MLflow run id that names one."""


def resolve_run_dir(target: str, tracking_uri: Optional[str] = None, running: bool = True) -> Path:
    """A run directory (output_dir/latest works), or the directory an MLflow run's `atrlhf.run_dir` tag names
    (`running`: a run that is still running)."""
    path = Path(target)
    if path.is_dir():
        return path.resolve()
    if not RUN_ID.match(target):
        raise ScaleError(f"{target!r} is neither a run directory nor an MLflow run id")
    from mlflow.exceptions import MlflowException
    from mlflow.tracking import MlflowClient

    uri = tracking_uri or os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{Path.cwd().resolve() / 'mlflow.db'}"
    try:
        run = MlflowClient(tracking_uri=uri).get_run(target)
    except MlflowException as exc:
        raise ScaleError(f"MLflow run {target} is not in {uri}: {exc.message}") from None
    run_dir = run.data.tags.get("atrlhf.run_dir")
    if not run_dir or not Path(run_dir).is_dir():
        raise ScaleError(f"MLflow run {target} names no run directory on this machine (tag atrlhf.run_dir={run_dir!r})")
    if running and run.info.status != "RUNNING":
        raise ScaleError(f"MLflow run {target} is {run.info.status}, not running: there is no fleet to scale")
    return Path(run_dir)


def cmd_scale(target: str, rollout_workers: int, tracking_uri: Optional[str] = None, wait_s: float = 30.0) -> int:
    """Exit 0 when the run applied the request, 1 when it refused it or did not answer within wait_s, 2 for a bad
    target."""
    try:
        run_dir = resolve_run_dir(target, tracking_uri)
        rid = request_scale(run_dir, rollout_workers)
    except (ScaleError, ValueError) as exc:
        print(f"atrlhf: {exc}", file=sys.stderr)
        return 2
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        answer = read_answer(run_dir, rid)
        if answer is not None:
            if answer["rollout_workers"] is None:
                print(f"atrlhf: the run in {run_dir} refused: {answer['detail']}", file=sys.stderr)
                return 1
            print(f"{run_dir}: {answer['rollout_workers']} rollout worker(s) (asked {answer['asked']})")
            return 0
        time.sleep(0.2)
    print(
        f"atrlhf: no answer from a run in {run_dir} within {wait_s:g} s (is it running? the request stays there and "
        "applies when its supervision next polls)",
        file=sys.stderr,
    )
    return 1
