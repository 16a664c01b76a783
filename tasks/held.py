"""What a task acquired for its flow run (the Ray runtime, the MLflow run), held here from the moment it exists.

A task hands its result to the flow only after Prefect has recorded the task run's state, so a signal can land
between "the MLflow run was created" and "the flow holds the tracker" (a terminal's Ctrl-C during
`start-mlflow-run`, say). The flow's cleanup (`flows.train.RunResources`) then also releases what is held
here under its flow run's id, and the run still ends KILLED instead of staying RUNNING. Keyed by flow run id:
a sweep runs several flow runs in threads of one process.
"""

from __future__ import annotations

import threading
from typing import Any

_lock = threading.Lock()
_held: dict[tuple[str, str], list[Any]] = {}


def hold(flow_run_id: str, kind: str, obj: Any) -> None:
    """Record that `obj` (a "tracker" or a "runtime") belongs to this flow run until `release`d."""
    with _lock:
        _held.setdefault((str(flow_run_id), kind), []).append(obj)


def release(flow_run_id: str, kind: str, obj: Any) -> None:
    """Forget `obj` (it was ended, or the flow's cleanup took it over)."""
    key = (str(flow_run_id), kind)
    with _lock:
        objs = [o for o in _held.get(key, []) if o is not obj]
        if objs:
            _held[key] = objs
        else:
            _held.pop(key, None)


def held(flow_run_id: str, kind: str) -> list[Any]:
    """What this flow run still holds of `kind`, oldest first."""
    with _lock:
        return list(_held.get((str(flow_run_id), kind), []))
