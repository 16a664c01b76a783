"""What a run exposes on the network: a local run's Ray instance listens on 127.0.0.1 only, and starts no
dashboard unless `cluster.dashboard` asks for one. Joining a cluster (cluster.address) is left as it was."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from rlhf_core.config import load_config

REPO = Path(__file__).resolve().parents[1]
WILDCARD = {"0.0.0.0", "::", "::ffff:0.0.0.0", ""}

# Start a local run's Ray through the project's connect(), then list the listening TCP sockets of this
# process and all its descendants (GCS, raylet, workers, agents, dashboard). Run in a fresh interpreter so
# that no Ray instance of the test session is reused.
PROBE = r"""
import json, sys, time
import psutil, ray
from rlhf_core.config import load_config
from rlhf_core.distributed.cluster import connect, teardown

cfg = load_config(None, ["cluster.num_cpus=1", *sys.argv[1:]])
handle = connect(cfg.cluster)
assert handle.started_ray, handle

@ray.remote
def ping():
    return 1

ray.get(ping.remote())  # a worker process is up, with its own servers
time.sleep(2)  # agents start in the background
me = psutil.Process()
listening = []
for proc in [me, *me.children(recursive=True)]:
    try:
        conns = proc.net_connections(kind="inet")
        name = proc.name()
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        continue
    for c in conns:
        if c.status == psutil.CONN_LISTEN:
            listening.append({"pid": proc.pid, "name": name, "ip": c.laddr.ip, "port": c.laddr.port})
node_ip = ray.util.get_node_ip_address()
teardown(handle)
print("PROBE " + json.dumps({"listening": listening, "node_ip": node_ip}))
"""


def _probe(*overrides: str) -> dict:
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0"}
    env.pop("RAY_ADDRESS", None)  # a local run, whatever the environment says
    out = subprocess.run(
        [sys.executable, "-c", PROBE, *overrides], capture_output=True, text=True, timeout=240, cwd=REPO, env=env
    )
    lines = [line for line in out.stdout.splitlines() if line.startswith("PROBE ")]
    assert out.returncode == 0 and lines, out.stdout[-3000:] + out.stderr[-3000:]
    return json.loads(lines[-1][len("PROBE ") :])


def _exposed(listening: list[dict]) -> list[dict]:
    """Sockets that accept connections from other machines: bound to a wildcard or a non-loopback address."""
    loopback = ("127.", "::1", "::ffff:127.")
    return [s for s in listening if s["ip"] in WILDCARD or not s["ip"].startswith(loopback)]


@pytest.mark.slow
def test_a_local_run_listens_on_loopback_only_and_starts_no_dashboard():
    result = _probe()
    listening = result["listening"]
    assert len(listening) >= 3, listening  # GCS, raylet, worker at least: the probe did see Ray's sockets
    assert not _exposed(listening), f"sockets reachable from the network: {_exposed(listening)}"
    assert result["node_ip"] == "127.0.0.1"
    assert 8265 not in {s["port"] for s in listening}, "a dashboard was started without cluster.dashboard"


def _dashboard_missing() -> str | None:
    try:
        from ray._private.utils import get_dashboard_dependency_error
    except ImportError:
        return "ray is not installed"
    return get_dashboard_dependency_error()


@pytest.mark.slow
def test_the_dashboard_when_asked_for_also_listens_on_loopback_only():
    if _dashboard_missing():
        pytest.skip(f"Ray's dashboard packages are not installed: {_dashboard_missing()}")
    result = _probe("cluster.dashboard=true")
    listening = result["listening"]
    assert not _exposed(listening), f"sockets reachable from the network: {_exposed(listening)}"
    assert {"ip": "127.0.0.1", "port": 8265} in [{"ip": s["ip"], "port": s["port"]} for s in listening], listening


# ------------------------------------------------------------------------------- without a Ray instance
class _Recorder:
    def __init__(self):
        self.calls = []

    def __call__(self, **kwargs):
        from ray._private import ray_constants

        self.calls.append({**kwargs, "cluster_mode_during_init": ray_constants.ENABLE_RAY_CLUSTER})


def test_connect_asks_ray_for_a_loopback_instance_without_dashboard(monkeypatch):
    ray = pytest.importorskip("ray")
    from ray._private import ray_constants

    from rlhf_core.distributed import cluster

    before = ray_constants.ENABLE_RAY_CLUSTER
    init = _Recorder()
    monkeypatch.setattr(ray, "init", init)
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray.util, "get_node_ip_address", lambda: "127.0.0.1")

    handle = cluster.connect(load_config(None, ["cluster.address="]).cluster)
    assert handle.started_ray
    (call,) = init.calls
    assert call["include_dashboard"] is False and call["dashboard_host"] == "127.0.0.1"
    assert call["_node_ip_address"] == "127.0.0.1"
    assert call["cluster_mode_during_init"] is False  # so Ray keeps 127.0.0.1 instead of resolving it away
    assert ray_constants.ENABLE_RAY_CLUSTER == before  # restored for a later cluster join

    import ray._private.utils as ray_utils

    monkeypatch.setattr(ray_utils, "get_dashboard_dependency_error", lambda: None)
    cluster.connect(load_config(None, ["cluster.address=", "cluster.dashboard=true"]).cluster)
    assert init.calls[-1]["include_dashboard"] is True and init.calls[-1]["dashboard_host"] == "127.0.0.1"


def test_a_dashboard_without_its_packages_is_refused_naming_the_field(monkeypatch):
    ray = pytest.importorskip("ray")
    import ray._private.utils as ray_utils

    from rlhf_core.distributed import cluster

    init = _Recorder()
    monkeypatch.setattr(ray, "init", init)
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray_utils, "get_dashboard_dependency_error", lambda: "No module named 'aiohttp'")
    with pytest.raises(cluster.ClusterError, match=r"cluster.dashboard.*ray\[default\]"):
        cluster.connect(load_config(None, ["cluster.address=", "cluster.dashboard=true"]).cluster)
    assert not init.calls


def test_joining_a_cluster_is_unchanged(monkeypatch):
    ray = pytest.importorskip("ray")
    from rlhf_core.distributed import cluster

    init = _Recorder()
    monkeypatch.setattr(ray, "init", init)
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    cluster.connect(load_config(None, ["cluster.address=auto", "cluster.dashboard=true"]).cluster)
    (call,) = init.calls
    assert call["address"] == "auto"
    assert not {"_node_ip_address", "include_dashboard", "dashboard_host"} & set(call)
    assert call["cluster_mode_during_init"] is True
