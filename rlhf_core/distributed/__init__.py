"""The Ray runtime: the only Ray code.

    control.py    prompt queue, experience buffer with admission control, weight-store bookkeeping
                  (plain Python, no Ray import; the runtime wraps each in a Ray actor)
    transport.py  experience and weights packed for Ray's object store (no Ray import)
    actors.py     the rollout and trainer actors, and ranks 1..N-1 of a sharded trainer group (FSDP2)
    cluster.py    joining or starting Ray, resources, placement groups, teardown
    runtime.py    DistributedRun: launch, loops, poll, sync, checkpoint, teardown; run_distributed

Importing this package does not import Ray; the names below load their modules (and Ray) on first use.
"""

from __future__ import annotations

import importlib

_LAZY = {
    "ClusterError": "cluster",
    "check_resources": "cluster",
    "connect": "cluster",
    "DistributedRun": "runtime",
    "RunFailed": "runtime",
    "run_distributed": "runtime",
}

__all__ = sorted(_LAZY)


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(f"rlhf_core.distributed.{_LAZY[name]}"), name)
    raise AttributeError(f"module 'rlhf_core.distributed' has no attribute {name!r}")
