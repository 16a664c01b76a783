"""The Ray runtime: actors, prompt queue, weight store, cluster bring-up and teardown. The only Ray code."""

from rlhf_core.distributed.cluster import ClusterError, check_resources, connect
from rlhf_core.distributed.runtime import DistributedRun, RunFailed, run_distributed

__all__ = ["ClusterError", "DistributedRun", "RunFailed", "check_resources", "connect", "run_distributed"]
