"""A real multi-node Ray cluster on this machine (Ray's own multi-node setup: a head and more nodes, each its own
raylet process, all on 127.0.0.1): a run joins it by address, its rollout workers are pinned to nodes by a custom
resource, a rollout node is killed mid-run and the run completes without losing or inventing data, and the fleet is
scaled by `atrlhf scale` during a run."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
from tests.ledger_checks import assert_ledger_balances

ray = pytest.importorskip("ray")

from ray.cluster_utils import Cluster  # noqa: E402

from rlhf_core.config import load_config  # noqa: E402
from rlhf_core.distributed import run_distributed  # noqa: E402
from rlhf_core.distributed.cluster import LOOPBACK, _single_machine_ray  # noqa: E402

pytestmark = pytest.mark.slow  # a Ray cluster of three raylets (`make test-fast` skips it)

REPO = Path(__file__).resolve().parents[1]
JUDGE = f"reward.functions=[{{path: {REPO / 'benchmarks/slow_judge.py'}, name: slow_judge, weight: 0.0}}]"
FAST_HEALTH = {  # a dead node is noticed in about 2 s instead of about 30
    "health_check_initial_delay_ms": 0,
    "health_check_period_ms": 500,
    "health_check_failure_threshold": 4,
}


@pytest.fixture(scope="module")
def cluster():
    """A head (the driver, the control actors, the trainer: one `trainer_node`) and two rollout nodes, each with
    one `rollout_node`."""
    if ray.is_initialized():  # another module's local instance: this module's driver joins the cluster instead
        ray.shutdown()
    with _single_machine_ray():
        c = Cluster(
            initialize_head=True,
            connect=False,
            head_node_args={
                "num_cpus": 1,
                "resources": {"trainer_node": 1},
                "node_ip_address": LOOPBACK,
                "_system_config": FAST_HEALTH,
            },
        )
        c.rollout_nodes = [
            c.add_node(num_cpus=1, resources={"rollout_node": 1}, node_ip_address=LOOPBACK) for _ in range(2)
        ]
    c.wait_for_nodes()
    yield c
    if ray.is_initialized():
        ray.shutdown()
    c.shutdown()


def add_rollout_node(c):
    with _single_machine_ray():
        node = c.add_node(num_cpus=1, resources={"rollout_node": 1}, node_ip_address=LOOPBACK)
    c.rollout_nodes.append(node)
    c.wait_for_nodes()
    return node


def cluster_cfg(tmp_path, c, *overrides):
    return load_config(
        "configs/tiny.yaml",
        [
            f"run.output_dir={tmp_path}",
            f"cluster.address={c.address}",
            "cluster.resources.rollout.rollout_node=1",
            "cluster.resources.trainer.trainer_node=1",
            "cluster.resources.trainer.CPU=1",
            "data.eval_size=100",
            "supervision.supervise_interval_s=0.2",
            "runtime.wait_timeout_s=60",
            "checkpoint.every=0",
            *overrides,
        ],
    )


def in_flight(run) -> bool:
    """Whether the (one) rollout worker holds prompts of a batch the buffer has not accepted yet."""
    (holder,) = ray.get(run.queue.holders.remote("0-"))
    return max(ray.get(run.queue.leased.remote(holder)), default=-1) > ray.get(run.buffer.delivered.remote(holder))


def test_a_rollout_node_lost_mid_run_loses_and_invents_nothing(cluster, tmp_path):
    # every batch waits on a judge (0.3 s, no CPU): the worker is killed with a batch in hand, as a preempted
    # node's worker is, mid-episode
    cfg = cluster_cfg(
        tmp_path, cluster, "trainer.total_steps=40", "cluster.max_restarts=2", "rollout.num_workers=1", JUDGE
    )
    state: dict = {}

    def on_launch(run):
        state["run"] = run
        state["node"] = ray.get(run.workers[0].ping.remote())["node"]

    def on_poll(poll):
        if "killed" not in state and poll["step"] >= 20 and in_flight(state["run"]):
            (victim,) = [n for n in cluster.rollout_nodes if n.node_id == state["node"]]
            cluster.remove_node(victim, allow_graceful=False)  # its raylet and every process on it die
            cluster.rollout_nodes.remove(victim)
            state["killed"] = poll["step"]

    result = run_distributed(cfg, on_launch=on_launch, on_poll=on_poll)
    assert result["steps"] == 40 and state["killed"] >= 20
    assert result["restarts"] == [1]
    kinds = [e["kind"] for e in result["events"]]
    assert {"rollout_worker_died", "prompts_requeued", "rollout_worker_restarted"} <= set(kinds), kinds
    final = result["final_poll"]
    requeued = final["cluster"]["requeued_prompts"]
    assert requeued > 0 and final["queue"]["requeued"] == requeued
    assert result["metrics"][-1]["rollout/requeued_prompts"] == requeued
    # the conservation of groups: every group generated, by the lost worker (the buffer's count of what it
    # accepted from it) or the restarted one, is trained, evicted, dropped, filtered or buffered; none in flight
    rec = result["reconcile"]
    assert_ledger_balances(rec)
    assert rec["trained"] == 40 * cfg.trainer.prompts_per_step
    assert final["buffer"]["revoked_groups"] > 0  # the lost worker delivered groups before it died ...
    # ... and nothing it had in hand was scored or trained: its last batches went back to the queue instead
    (restarted,) = [s for s in final["rollout"] if s["alive"]]
    assert restarted["restarted"] is True


def test_atrlhf_scale_grows_and_shrinks_the_fleet_of_a_live_run(cluster, tmp_path):
    add_rollout_node(cluster)  # a node added to the cluster (the previous test removed one)
    # paced by a judge that waits (0.3 s a batch, no CPU), so that the run lasts long enough for a new worker's
    # process to start (10-30 s here) however fast the machine trains
    cfg = cluster_cfg(tmp_path, cluster, "trainer.total_steps=400", "rollout.num_workers=1", JUDGE)
    state: dict = {"asks": []}

    def scale(n: int) -> subprocess.Popen:
        cmd = [sys.executable, "-m", "flows.cli", "scale", str(tmp_path), "--rollout-workers", str(n), "--wait-s", "60"]
        return subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    def on_poll(poll):
        working = [s for s in poll["rollout"] if s["alive"] and s.get("groups_pushed", 0) > 0]
        if not state["asks"] and poll["step"] >= 10:
            state["asks"].append(scale(2))
        elif len(state["asks"]) == 1 and len(working) == 2:  # the new worker generates: back to one
            state["grown_at"] = poll["step"]
            state["asks"].append(scale(1))
        elif "grown_at" in state and "shrunk_at" not in state and poll["metrics"]:
            if poll["metrics"][-1].get("cluster/rollout_workers") == 1:
                state["shrunk_at"] = poll["step"]

    def done() -> bool:  # 10 steps on one worker again: enough
        return state.get("shrunk_at") is not None and state["last_step"] >= state["shrunk_at"] + 10

    def watch(poll):
        state["last_step"] = poll["step"]
        on_poll(poll)

    result = run_distributed(cfg, on_poll=watch, cancelled=done)
    assert result["cancelled"] and state["grown_at"] < state["shrunk_at"] < result["steps"] < 400
    outs = [p.communicate(timeout=60) for p in state["asks"]]
    assert [p.returncode for p in state["asks"]] == [0, 0], outs
    assert "2 rollout worker(s)" in outs[0][0] and "1 rollout worker(s)" in outs[1][0]
    sizes = [m["cluster/rollout_workers"] for m in result["metrics"]]
    changes = [b for a, b in zip(sizes, sizes[1:]) if a != b]
    assert sizes[0] == 1 and changes == [2, 1], sizes
    kinds = [e["kind"] for e in result["events"]]
    assert kinds.count("rollout_workers_changed") == 2 and "rollout_worker_started" in kinds, kinds
    rec = result["reconcile"]
    assert_ledger_balances(rec)
    staleness = [m["async/staleness_max"] for m in result["metrics"]]
    assert max(staleness) <= cfg.runtime.max_staleness  # the bound held through both changes


def test_the_trainers_node_lost_ends_the_run_with_its_checkpoints_and_a_restarted_cluster_resumes_it(cluster, tmp_path):
    from rlhf_core.distributed import RunFailed
    from rlhf_core.run.checkpoint import read_checkpoint
    from rlhf_core.run.checkpoint_paths import newest_checkpoint
    from rlhf_core.supervision import SupervisionError

    with _single_machine_ray():
        trainer_node = cluster.add_node(num_cpus=1, resources={"spare_trainer": 1}, node_ip_address=LOOPBACK)
    cluster.wait_for_nodes()
    overrides = ["trainer.total_steps=300", "checkpoint.every=5", "cluster.resources.trainer={spare_trainer: 1}"]
    cfg = cluster_cfg(tmp_path, cluster, *overrides)
    state: dict = {}

    def on_poll(poll):
        if "killed" not in state and poll["step"] >= 12:
            cluster.remove_node(trainer_node, allow_graceful=False)
            state["killed"] = poll["step"]

    with pytest.raises((RunFailed, SupervisionError), match="trainer"):
        run_distributed(cfg, on_poll=on_poll)
    last = newest_checkpoint(tmp_path)
    assert last is not None and read_checkpoint(last)[0].step >= 10  # written before the node went
    # the cluster is restarted with a trainer node again; the run continues from its newest checkpoint
    with _single_machine_ray():
        cluster.add_node(num_cpus=1, resources={"spare_trainer": 1}, node_ip_address=LOOPBACK)
    cluster.wait_for_nodes()
    at = read_checkpoint(last)[0].step
    resumed_cfg = cluster_cfg(tmp_path / "resumed", cluster, *overrides[1:], f"trainer.total_steps={at + 8}")
    result = run_distributed(resumed_cfg, resume_from=str(last))
    assert result["steps"] == at + 8 and [m["step"] for m in result["metrics"]] == list(range(at + 1, at + 9))
    assert_ledger_balances(result["reconcile"])  # across the resume: the checkpoint's accounts go on
    assert result["reconcile"]["trained_samples"] == (at + 8) * cfg.batch_size, result["reconcile"]
