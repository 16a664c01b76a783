"""Which host runs a run's roles (cluster.host): `DistributedRun` (Ray actors) or `ThreadedRun` (threads of this
process). Both implement `rlhf_core.run.host_base.RunHost` over `HostBase`; the Prefect flow and `run_distributed`
construct theirs here."""

from __future__ import annotations

from rlhf_core.config import TrainConfig
from rlhf_core.run.host_base import RunHost


def make_runtime(cfg: TrainConfig) -> RunHost:
    """The runtime cluster.host names, not launched yet (imported here: the threads host never imports Ray)."""
    if cfg.cluster.host == "threads":
        from rlhf_core.run.threaded import ThreadedRun

        return ThreadedRun(cfg)
    from rlhf_core.distributed.runtime import DistributedRun

    return DistributedRun(cfg)
