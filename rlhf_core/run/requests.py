"""Requests to a live run, through its run directory: `atrlhf scale` writes one, the supervision reads it.

A request is a small JSON file, `<run dir>/control/scale.json` ({"rollout_workers": N, "id": ..., "time": ...}),
written atomically (a temporary file renamed over it). The supervision polls it every
supervision.supervise_interval_s and hands a new one to the fleet policy (`rlhf_core.autoscale`), which applies
or refuses it as a health event. Plain files: the run may be a Prefect flow on another process, a deployment's
worker or `run_distributed`; all that is shared is the directory.
"""

from __future__ import annotations

import json
import os
import time
import uuid
from pathlib import Path
from typing import Optional

SCALE_FILE = Path("control") / "scale.json"
ANSWER_FILE = Path("control") / "scale.answer.json"


def _write(path: Path, record: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{uuid.uuid4().hex[:8]}.tmp")
    tmp.write_text(json.dumps(record))
    os.replace(tmp, path)


def request_scale(run_dir: str | Path, rollout_workers: int) -> str:
    """Ask the run in `run_dir` for `rollout_workers` rollout workers. Returns the request's id."""
    if int(rollout_workers) < 1:
        raise ValueError(f"--rollout-workers must be at least 1, got {rollout_workers}")
    rid = uuid.uuid4().hex
    _write(Path(run_dir) / SCALE_FILE, {"rollout_workers": int(rollout_workers), "id": rid, "time": time.time()})
    return rid


def read_answer(run_dir: str | Path, rid: str) -> Optional[dict]:
    """The supervision's answer to request `rid` ({"id", "asked", "rollout_workers", "detail"}), None until then."""
    try:
        answer = json.loads((Path(run_dir) / ANSWER_FILE).read_text())
    except (OSError, ValueError):
        return None
    return answer if answer.get("id") == rid else None


class ScaleRequests:
    """The scale requests of one run: `poll()` returns the fleet size of a request not seen before, else None.
    A request already there when the run starts (a resumed run's directory holds none: it is a new directory)
    counts as new."""

    def __init__(self, run_dir: str | Path):
        self.path = Path(run_dir) / SCALE_FILE
        self.seen: Optional[str] = None
        self.asked: Optional[int] = None
        self.mtime: Optional[int] = None

    def poll(self) -> Optional[int]:
        try:
            mtime = self.path.stat().st_mtime_ns
        except OSError:
            return None
        if mtime == self.mtime:
            return None
        self.mtime = mtime
        try:
            request = json.loads(self.path.read_text())
            rid, n = str(request["id"]), int(request["rollout_workers"])
        except (OSError, ValueError, KeyError, TypeError):
            return None  # half-written or foreign: the next write replaces it
        if rid == self.seen:
            return None
        self.seen, self.asked = rid, n
        return n

    def answer(self, rollout_workers: Optional[int], detail: str) -> None:
        """What came of the last request: the fleet size now (None: refused) and why."""
        record = {"id": self.seen, "asked": self.asked, "rollout_workers": rollout_workers, "detail": detail}
        try:
            _write(Path(self.path).parent.parent / ANSWER_FILE, record)
        except OSError:  # the run goes on; the CLI says it got no answer
            pass
