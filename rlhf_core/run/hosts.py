"""Which host runs a run's roles (cluster.host): `DistributedRun` (Ray actors) or `ThreadedRun` (threads of this
process). Both implement `rlhf_core.run.host_base.RunHost` over `HostBase`; the Prefect flow and `run_distributed`
construct theirs here."""

from __future__ import annotations

from rlhf_core.config import TrainConfig
from rlhf_core.run.host_base import RunHost


def make_runtime(cfg: TrainConfig) -> RunHost:
    """The runtime cluster.host names, not launched yet (imported here: the threads host never imports Ray). A
    point of an open shared fleet (`rlhf_core.run.shared_fleet`, a threads host) gets its fleet's host."""
    if cfg.cluster.host == "threads":
        from rlhf_core.run.shared_fleet import fleet_host
        from rlhf_core.run.threaded import ThreadedRun

        shared = fleet_host(cfg)
        if shared is not None:
            return shared

        return ThreadedRun(cfg)
    from rlhf_core.distributed.runtime import DistributedRun

    return DistributedRun(cfg)
