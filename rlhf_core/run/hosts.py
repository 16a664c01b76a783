"""Which host runs a run's roles (cluster.host): `DistributedRun` (Ray actors) or `ThreadedRun` (threads of this
process). Both have the same control interface; the Prefect flow and `run_distributed` construct theirs here."""

from __future__ import annotations

from rlhf_core.config import TrainConfig


def make_runtime(cfg: TrainConfig):
    """The runtime cluster.host names, not launched yet (imported here: the threads host never imports Ray)."""
    if cfg.cluster.host == "threads":
        from rlhf_core.run.threaded import ThreadedRun

        return ThreadedRun(cfg)
    from rlhf_core.distributed.runtime import DistributedRun

    return DistributedRun(cfg)
