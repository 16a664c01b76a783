"""Ray bring-up and teardown: a local instance by default, an existing cluster when asked.

`cluster.address` empty starts a local Ray instance sized from the config, reachable from this machine
only: every Ray process (GCS, raylet, workers, agents) listens on 127.0.0.1, the dashboard is off unless
`cluster.dashboard` asks for it (then on 127.0.0.1 too), usage stats are off. "auto" or "ray://host:port"
joins an existing cluster, as that cluster is set up. Only what this run created is torn down, and Ray is
shut down only if this run started it.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import socket
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Optional

import ray

log = logging.getLogger("rlhf_core.distributed")

LOOPBACK = "127.0.0.1"


class ClusterError(RuntimeError):
    """Ray could not be reached, or it cannot host the roles the config asks for."""


@dataclass
class ClusterHandle:
    address: str
    started_ray: bool
    placement_group: Optional[object] = None
    actors: list = field(default_factory=list)


def _check_reachable(address: str, timeout_s: float = 5.0) -> None:
    """Fail fast with a clear message instead of letting a client connect hang on a bad host:port."""
    target = address[len("ray://") :] if address.startswith("ray://") else address
    if ":" not in target:
        raise ClusterError(f"cluster.address {address!r} is not '', 'auto', 'host:port' or 'ray://host:port'")
    host, _, port = target.rpartition(":")
    try:
        port_num = int(port)
    except ValueError:
        raise ClusterError(f"cluster.address {address!r}: port {port!r} is not a number") from None
    try:
        with socket.create_connection((host, port_num), timeout=timeout_s):
            pass
    except OSError as exc:
        raise ClusterError(f"cannot reach a Ray cluster at cluster.address={address!r}: {exc}") from None


def connect(cluster_cfg) -> ClusterHandle:
    """Join or start Ray as the config says. Returns a handle that records whether we started it."""
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    address = cluster_cfg.address.strip()
    if address and address != "auto":
        _check_reachable(address)
    if ray.is_initialized():  # a driver that already joined Ray (a notebook, a test session): reuse it
        return ClusterHandle(address="(already connected)", started_ray=False)
    if not address:
        start = time.perf_counter()
        dashboard = bool(getattr(cluster_cfg, "dashboard", False))
        if dashboard:
            _check_dashboard_installed()
        with _single_machine_ray():
            ray.init(
                address="local",  # a new instance: never another run's (or another user's) Ray on this machine
                num_cpus=cluster_cfg.num_cpus,
                num_gpus=cluster_cfg.num_gpus,
                include_dashboard=dashboard,
                dashboard_host=LOOPBACK,
                log_to_driver=True,
                configure_logging=False,
                _node_ip_address=LOOPBACK,
            )
        node_ip = ray.util.get_node_ip_address()
        if node_ip != LOOPBACK:  # a Ray release that resolves the loopback address away again
            log.warning(
                "the local Ray instance runs on %s, not %s: its ports are reachable from the network", node_ip, LOOPBACK
            )
        log.info(
            "started a local Ray instance on %s in %.1f s (dashboard %s)",
            node_ip,
            time.perf_counter() - start,
            f"on http://{LOOPBACK}:8265" if dashboard else "off",
        )
        return ClusterHandle(address="local", started_ray=True)
    try:
        if _loopback(address):  # a cluster of raylets on this machine (Ray's own multi-node test setup)
            with _single_machine_ray():
                ray.init(address=address, log_to_driver=True, configure_logging=False, _node_ip_address=LOOPBACK)
        else:
            ray.init(address=address, log_to_driver=True, configure_logging=False)
    except Exception as exc:  # ConnectionError, RuntimeError... name the address
        raise ClusterError(f"could not join the Ray cluster at cluster.address={address!r}: {exc}") from exc
    return ClusterHandle(address=address, started_ray=False)


def _loopback(address: str) -> bool:
    """A 'host:port' cluster address on this machine's loopback: the driver joins it as a loopback node too
    (a Ray Client address, ray://, has no node of its own)."""
    if address.startswith("ray://"):
        return False
    host = address.rpartition(":")[0]
    return host in ("localhost", "::1") or host.startswith("127.")


def _check_dashboard_installed() -> None:
    """Ray's own error for a missing dashboard is 'Cannot include dashboard with missing packages'."""
    try:
        from ray._private.utils import get_dashboard_dependency_error
    except ImportError:  # pragma: no cover - let ray.init decide
        return
    missing = get_dashboard_dependency_error()
    if missing:
        raise ClusterError(
            f"cluster.dashboard is true but Ray's dashboard packages are not installed ({missing}); "
            "install them with pip install 'ray[default]', or set cluster.dashboard=false"
        )


@contextlib.contextmanager
def _single_machine_ray() -> Iterator[None]:
    """Ray's single-machine mode, for the duration of a local `ray.init`: the node IP stays 127.0.0.1.

    `ray.init(_node_ip_address="127.0.0.1")` alone is not enough: Ray resolves a loopback address to the
    machine's routable IP (`services.resolve_ip_for_localhost`) unless `ray_constants.ENABLE_RAY_CLUSTER`
    is false, as it is on macOS and Windows (`RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`; read once, at import).
    The GCS, raylet, workers and agents bind the node IP, so with it every port of the instance listens on
    loopback only. The flag is restored afterwards, so that a later join of a cluster in this process
    resolves addresses as usual."""
    try:
        from ray._private import ray_constants
    except ImportError:  # pragma: no cover - a Ray without the module: the warning in connect() tells
        yield
        return
    saved = getattr(ray_constants, "ENABLE_RAY_CLUSTER", True)
    ray_constants.ENABLE_RAY_CLUSTER = False
    try:
        yield
    finally:
        ray_constants.ENABLE_RAY_CLUSTER = saved


def role_counts(cfg, rollout_workers: Optional[int] = None) -> dict[str, int]:
    """How many actors of each role the run reserves for: rollout workers, trainer ranks, the reward model (0 or 1),
    the evaluation actor (0 or 1: eval.every > 0 and cluster.resources.eval asks for something; one that asks for
    nothing, the default, is started at the first pinned evaluation without a reservation)."""
    n = cfg.rollout.num_workers if rollout_workers is None else rollout_workers
    evaluates = cfg.eval.every > 0 and any(v > 0 for v in cfg.cluster.per_actor("eval").values())
    return {
        "rollout": n,
        "trainer": cfg.cluster.trainer_workers,
        "reward": 1 if cfg.reward.model.path else 0,
        "eval": 1 if evaluates else 0,
    }


def required_resources(cfg, rollout_workers: Optional[int] = None) -> dict[str, float]:
    """What the run's roles need in all: CPU, GPU and the custom resources they are pinned by."""
    need = {"CPU": 0.0, "GPU": 0.0}
    for role, count in role_counts(cfg, rollout_workers).items():
        if count:
            for name, amount in cfg.cluster.per_actor(role).items():
                need[name] = need.get(name, 0.0) + amount * count
    return need


def rollout_worker_resources(cfg) -> dict[str, float]:
    """One rollout worker's resources, as Ray counts them."""
    return cfg.cluster.per_actor("rollout")


def room_for(per_worker: dict[str, float], available: dict[str, float]) -> bool:
    """Whether `available` (ray.available_resources()) fits one more worker needing `per_worker`."""
    return all(amount <= available.get(name, 0.0) + 1e-9 for name, amount in per_worker.items() if amount > 0)


def check_resources(cfg) -> None:
    """Refuse, with the numbers, a config whose roles can never be scheduled (instead of pending forever)."""
    need = required_resources(cfg)
    have = ray.cluster_resources()
    short = {k: (v, have.get(k, 0.0)) for k, v in need.items() if v > have.get(k, 0.0) + 1e-9}
    if short:
        detail = ", ".join(f"{k}: need {v:g}, cluster has {h:g}" for k, (v, h) in short.items())
        custom = {k for k in short if k not in ("CPU", "GPU")}
        counts = role_counts(cfg)
        roles = " + ".join(
            f"{counts[role]} {label} x {_shown(cfg.cluster.per_actor(role))}"
            for role, label in (
                ("rollout", "rollout worker(s)"),
                ("trainer", "trainer rank(s)"),
                ("reward", "reward model"),
            )
            if counts[role]
        )
        raise ClusterError(
            f"not enough resources for the requested roles ({detail}); roles: {roles}. Lower rollout.num_workers / "
            "cluster.resources.<role>.CPU / GPU or add nodes."
            + (
                f" {sorted(custom)}: cluster.resources.<role> ask for them; start nodes with "
                "them (ray start --resources='{\"name\": amount}')."
                if custom
                else ""
            )
        )


def _shown(per_actor: dict[str, float]) -> str:
    return "{" + ", ".join(f"{k}: {v:g}" for k, v in per_actor.items()) + "}"


def placement_bundles(cfg) -> list[dict[str, float]]:
    """The placement group's bundles: each trainer rank, each rollout worker, the reward model, the evaluation
    actor; in that order."""
    counts = role_counts(cfg)
    roles = ("trainer", "rollout", "reward", "eval")
    bundles = [cfg.cluster.per_actor(role) for role in roles for _ in range(counts[role])]
    return [{k: v for k, v in b.items() if v > 0} or {"CPU": 0.01} for b in bundles]


def gpu_placement_group(cfg, timeout_s: float):
    """A placement group (one bundle per role: each trainer rank, rollout workers, reward model, evaluation
    actor; in that order, PACKed) when any role asks for GPUs or the trainer has several ranks; None otherwise."""
    counts = role_counts(cfg)
    if cfg.cluster.trainer_workers == 1 and not any(
        cfg.cluster.per_actor(role)["GPU"] > 0 for role, count in counts.items() if count
    ):
        return None
    from ray.util.placement_group import placement_group

    bundles = placement_bundles(cfg)
    pg = placement_group(bundles, strategy="PACK")
    try:
        ray.get(pg.ready(), timeout=timeout_s)
    except ray.exceptions.GetTimeoutError:
        ray.util.remove_placement_group(pg)
        raise ClusterError(
            f"the placement group {bundles} was not ready within {timeout_s:g} s "
            "(runtime.wait_timeout_s); the cluster lacks free GPUs for these roles"
        ) from None
    return pg


def connected() -> bool:
    """This process has joined (or started) Ray."""
    return ray.is_initialized()


def on_this_node() -> dict:
    """Actor options that place it on the driver's node (the prompt queue, the experience buffer, the weight
    store: if the driver's node is lost the run is over anyway, and no other node's loss can take them)."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    return {"scheduling_strategy": NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)}


def in_bundle(pg, bundle: int) -> dict:
    """Actor options that place it in bundle `bundle` of placement group `pg` (gpu_placement_group's); none
    without one."""
    if pg is None:
        return {}
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    return {"scheduling_strategy": PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=bundle)}


def teardown(handle: ClusterHandle) -> None:
    """Kill exactly the actors and placement group this run created; shut Ray down only if we started it."""
    if not ray.is_initialized():
        return
    for actor in handle.actors:
        try:
            ray.kill(actor, no_restart=True)
        except Exception:  # already dead
            pass
    handle.actors.clear()
    if handle.placement_group is not None:
        try:
            ray.util.remove_placement_group(handle.placement_group)
        except Exception:
            pass
        handle.placement_group = None
    if handle.started_ray:
        # Release the handles and object refs that only garbage cycles still hold while Ray is up: one
        # collected after the shutdown reaches a core worker that is gone, and Ray then exits the process.
        gc.collect()
        ray.shutdown()
