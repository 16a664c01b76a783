"""Where a run's roles run, side by side: `InProcessRun` (in_process.py: in this thread, in lockstep; run_sync),
`ThreadedRun` (threads.py: cluster.host threads, each role's loop on a thread of this process) and
`DistributedRun` (ray_cluster.py: cluster.host ray, the roles as Ray actors of rlhf_core.distributed, on a local
instance or a cluster); `SharedPointHost` (shared_fleet.py) is a threads host for one point of a LoRA sweep's
shared fleet. Every host implements `base.RunHost` over `base.HostBase` (what every host does alike), so the one
supervision loop (rlhf_core.run.supervise), the Prefect flow and `run_distributed` (driver.py) drive any of them.
The flow and run_distributed construct theirs with `make_runtime`, below."""

from __future__ import annotations

from rlhf_core.config import TrainConfig
from rlhf_core.hosts.base import RunHost


def make_runtime(cfg: TrainConfig) -> RunHost:
    """The runtime cluster.host names, not launched yet (imported here: the threads host never imports Ray). A
    point of an open shared fleet (`rlhf_core.hosts.shared_fleet`, a threads host) gets its fleet's host."""
    if cfg.cluster.host == "threads":
        from rlhf_core.hosts.shared_fleet import fleet_host
        from rlhf_core.hosts.threads import ThreadedRun

        shared = fleet_host(cfg)
        if shared is not None:
            return shared

        return ThreadedRun(cfg)
    from rlhf_core.hosts.ray_cluster import DistributedRun

    return DistributedRun(cfg)
