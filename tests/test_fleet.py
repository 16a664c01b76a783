"""The rollout fleet's rules in plain Python (no Ray): prompt leases and their requeue, revoking a lost worker at
the buffer, the fleet policy (scale requests, autoscale), scale requests through a run directory, and the
`atrlhf scale` command against a live supervision's answer."""

from __future__ import annotations

import threading
import time

import pytest

from rlhf_core.autoscale import FleetPolicy
from rlhf_core.config import ConfigError, load_config
from rlhf_core.data.queue import PromptQueue
from rlhf_core.distributed.transport import pack_groups
from rlhf_core.run.accounting import reconcile
from rlhf_core.run.control import ExperienceBuffer
from rlhf_core.run.requests import ScaleRequests, read_answer, request_scale
from tests.test_buffer import make_experience


def uids(prompts) -> list[int]:
    return [p.uid for p in prompts]


def test_a_lost_workers_undelivered_batches_go_back_to_the_front_of_the_queue(max3_prompts):
    train, _ = max3_prompts
    q = PromptQueue(train, seed=0)
    b1, b2, b3 = (q.get(3, "0-aaaa", batch) for batch in (1, 2, 3))
    other = q.get(2, "1-bbbb", 1)
    # asking for batch 3 means batch 1 was delivered: its lease is gone, 2 and 3 are held
    assert sorted(q.leases["0-aaaa"]) == [2, 3]
    assert q.holders("0-") == ["0-aaaa"] and q.holders() == ["0-aaaa", "1-bbbb"]
    # the buffer accepted batch 2 from it: batch 3 was in flight when it died
    assert q.requeue("0-aaaa", after=2) == 3
    assert uids(q.get(3)) == uids(b3)  # generated again first, in their order
    assert q.stats()["requeued"] == 3 and "0-aaaa" not in q.leases
    assert q.requeue("1-bbbb", after=-1) == 2  # nothing delivered: the whole lease
    assert uids(q.get(2)) == uids(other)
    assert set(uids(b1) + uids(b2)).isdisjoint(uids(q.get(10)))  # delivered prompts are not served again yet


def test_leases_settled_out_of_order_requeue_exactly_the_prompts_in_flight(max3_prompts):
    """A worker streaming environment episodes holds a lease per group and its groups end in any order: lease 3
    pushed, lease 1 pushed, lease 4 failed (released), lease 2 still running when the worker is lost. Exactly
    lease 2's prompt goes back: nothing pushed is served twice, nothing in flight is lost (the buffer's record
    of the last lease accepted alone, 3, would requeue nothing and lose lease 2's prompt)."""
    train, _ = max3_prompts
    q = PromptQueue(train, seed=0)
    buf = ExperienceBuffer(max_size=32, max_staleness=4, prompts_per_step=2)
    assert buf.try_admit(4, holder="0-aaaa") == 4
    got = {lease: q.get(1, "0-aaaa", lease, settled=[]) for lease in (1, 2, 3, 4)}
    assert sorted(q.leases["0-aaaa"]) == [1, 2, 3, 4]  # streamed: no lease is taken as done by its number
    buf.push(pack_groups([make_experience(got[3][0].uid, 0, [1.0, 0.0])]), "0-aaaa", 3)
    buf.push(pack_groups([make_experience(got[1][0].uid, 0, [0.0, 1.0])]), "0-aaaa", 1)
    buf.release(1, "0-aaaa", 4)  # its group failed: nothing pushed, the lease is done
    five = q.get(1, "0-aaaa", 5, settled=[3, 1])  # the worker tells the queue what ended since its last request
    assert sorted(q.leases["0-aaaa"]) == [2, 4, 5]
    assert buf.settled_leases("0-aaaa") == (1, [3, 4])
    assert buf.revoke("0-aaaa") == 3  # the last lease accepted
    low, above = buf.settled_leases("0-aaaa")
    assert q.requeue("0-aaaa", low, above) == 2  # lease 2 (in flight) and lease 5 (just taken)
    assert uids(q.get(2)) == uids(got[2]) + uids(five)  # generated again first, in their order
    assert q.stats()["requeued"] == 2


def test_a_revoked_worker_is_refused_its_admission_freed_and_its_groups_counted():
    buf = ExperienceBuffer(max_size=32, max_staleness=1, prompts_per_step=2)
    assert buf.try_admit(2, holder="0-aaaa") == 2 and buf.try_admit(2, holder="1-bbbb") == 2
    assert buf.try_admit(1) == 0  # capacity (1 + 0 + 1) x 2 = 4, all admitted
    buf.push(pack_groups([make_experience(0, 0, [1.0, 0.0])]), "0-aaaa", 1)  # one of its two groups delivered
    assert buf.revoke("0-aaaa") == 1  # the last batch it delivered
    assert buf.stats()["admitted"] == 3  # the group it never pushed is admissible again
    assert buf.try_admit(1, holder="2-cccc") == 1
    assert buf.holder_names("2-") == ["2-cccc"] and buf.holder_names("0-") == []  # revoked: gone from the list
    assert buf.push(pack_groups([make_experience(1, 0, [1.0, 0.0])]), "0-aaaa", 2) == 0  # a late push: refused
    assert buf.try_admit(1, holder="0-aaaa") == 0
    buf.push(pack_groups([make_experience(2, 0, [0.0, 1.0]), make_experience(3, 0, [1.0, 0.0])]), "1-bbbb", 1)
    s = buf.stats()
    assert (s["size"], s["revoked_groups"], s["refused_groups"]) == (3, 1, 1)
    # conservation: the lost worker's own count died with it; the buffer's count of what it accepted stands in
    poll = {
        "buffer": s,
        "rollout": [{"alive": False}, {"alive": True, "groups_pushed": 2}],
        "trainer": {"groups_trained": 0},
    }
    rec = reconcile(poll)
    assert (rec["generated"], rec["buffered"], rec["unaccounted"]) == (3, 3, 0)


def _cfg(*overrides: str):
    return load_config(None, ["rollout.num_workers=1", *overrides])


def _poll(workers: int, wait_s: float, busy: float, room: bool = True, steps: int = 1) -> dict:
    metrics = [{"time/wait_s": wait_s, "time/train_s": 1.0, "util/rollout_busy": busy} for _ in range(steps)]
    return {"metrics": metrics, "cluster": {"rollout_workers": workers, "room_for_worker": room}}


def test_scale_requests_apply_as_asked_unless_the_autoscaler_owns_the_fleet():
    manual = FleetPolicy(_cfg())
    change = manual.decide(_poll(1, 0.0, 1.0), step=3, request=3)
    assert (change.workers, change.kind) == (3, "scale_requested")
    assert manual.decide(_poll(3, 5.0, 1.0), step=30) is None  # no autoscaler: nothing moves on its own
    auto = FleetPolicy(_cfg("cluster.autoscale.enabled=true", "cluster.autoscale.max_workers=3"))
    refused = auto.decide(_poll(1, 0.0, 1.0), step=3, request=2)
    assert refused.workers is None and refused.kind == "scale_refused" and "autoscale" in refused.reason


def test_the_autoscaler_grows_while_the_trainer_waits_on_busy_workers_and_shrinks_when_it_is_the_bottleneck():
    cfg = _cfg("cluster.autoscale.enabled=true", "cluster.autoscale.cooldown_steps=3")
    policy = FleetPolicy(cfg)
    assert policy.decide(_poll(1, 2.0, 0.95), step=2) is None  # within the cooldown
    assert policy.decide(_poll(1, 2.0, 0.95, room=False), step=3) is None  # no room in the cluster
    grow = policy.decide(_poll(1, 2.0, 0.95), step=6)
    assert (grow.workers, grow.kind) == (2, "autoscale_grow") and "waited" in grow.reason
    assert policy.decide(_poll(2, 2.0, 0.95), step=12) is None  # at max_workers
    assert policy.decide(_poll(2, 2.0, 0.3), step=20) is None  # waiting on idle workers: admission, not capacity
    shrink = policy.decide(_poll(2, 0.01, 0.3), step=30)
    assert (shrink.workers, shrink.kind) == (1, "autoscale_shrink")
    assert policy.decide(_poll(1, 0.01, 0.3), step=40) is None  # at min_workers


def test_autoscale_bounds_are_checked_against_the_starting_fleet():
    with pytest.raises(ConfigError, match="min_workers=3 is above max_workers=2"):
        _cfg("cluster.autoscale.min_workers=3", "cluster.autoscale.max_workers=2")
    with pytest.raises(ConfigError, match="rollout.num_workers=3"):
        load_config(None, ["rollout.num_workers=3", "cluster.autoscale.enabled=true"])
    with pytest.raises(ConfigError, match="cluster.resources.rollout.memory"):
        _cfg("cluster.resources.rollout.memory=1")
    pinned = _cfg("cluster.resources.rollout={rollout_node: 1}").cluster.resources.rollout
    assert pinned == {"CPU": 1.0, "GPU": 0.0, "rollout_node": 1.0}


def test_a_scale_request_is_read_once_and_answered(tmp_path):
    requests = ScaleRequests(tmp_path)
    assert requests.poll() is None
    rid = request_scale(tmp_path, 2)
    assert requests.poll() == 2 and requests.poll() is None  # seen once
    assert read_answer(tmp_path, rid) is None
    requests.answer(2, "atrlhf scale asked for 2 rollout worker(s)")
    assert read_answer(tmp_path, rid)["rollout_workers"] == 2
    time.sleep(0.01)  # a new request, even of the same size, is new
    request_scale(tmp_path, 2)
    assert requests.poll() == 2
    with pytest.raises(ValueError, match="at least 1"):
        request_scale(tmp_path, 0)


def test_atrlhf_scale_prints_the_runs_answer_and_refuses_a_bad_target(tmp_path, capsys):
    from flows.cli import main

    requests = ScaleRequests(tmp_path)
    stop = threading.Event()

    def supervision() -> None:  # what the supervise loop does at each poll
        while not stop.is_set():
            n = requests.poll()
            if n is not None:
                requests.answer(n, "atrlhf scale asked")
            time.sleep(0.05)

    thread = threading.Thread(target=supervision, daemon=True)
    thread.start()
    try:
        assert main(["scale", str(tmp_path), "--rollout-workers", "3", "--wait-s", "10"]) == 0
    finally:
        stop.set()
        thread.join()
    assert "3 rollout worker(s)" in capsys.readouterr().out
    assert main(["scale", str(tmp_path / "nowhere"), "--rollout-workers", "2"]) == 2
    assert "neither a run directory nor an MLflow run id" in capsys.readouterr().err
    assert main(["scale", str(tmp_path), "--rollout-workers", "2", "--wait-s", "0.5"]) == 1  # nobody answers
    assert "no answer" in capsys.readouterr().err


def test_atrlhf_scale_finds_a_live_run_by_its_mlflow_run_id(tmp_path, mlflow_db):
    from mlflow.tracking import MlflowClient

    from flows.scale import ScaleError, resolve_run_dir

    uri = f"sqlite:///{mlflow_db}"
    client = MlflowClient(tracking_uri=uri)
    experiment = client.create_experiment("scale")
    run_dir = tmp_path / "runs" / "a-run"
    run_dir.mkdir(parents=True)
    live = client.create_run(experiment, tags={"atrlhf.run_dir": str(run_dir)}).info.run_id
    assert resolve_run_dir(live, uri) == run_dir
    client.set_terminated(live)
    with pytest.raises(ScaleError, match="FINISHED, not running"):
        resolve_run_dir(live, uri)
    untagged = client.create_run(experiment).info.run_id
    with pytest.raises(ScaleError, match="names no run directory"):
        resolve_run_dir(untagged, uri)
    with pytest.raises(ScaleError, match="is not in"):
        resolve_run_dir("0" * 32, uri)


def test_a_late_release_from_a_revoked_worker_frees_nothing_twice():
    buf = ExperienceBuffer(max_size=32, max_staleness=0, prompts_per_step=4)
    assert buf.try_admit(2, holder="0-aaaa") == 2 and buf.try_admit(2, holder="1-bbbb") == 2
    buf.revoke("0-aaaa")  # frees its 2
    buf.release(2, "0-aaaa")  # the loop's own release, arriving after: already freed, not the other worker's
    assert buf.stats()["admitted"] == 2 and buf.try_admit(4) == 2


def test_a_scale_request_to_the_threads_host_is_answered_unsupported(tmp_path):
    from rlhf_core.run.requests import ScaleRequests
    from rlhf_core.supervision import Supervisor

    class OneProcess:  # the control surface of a host whose fleet is fixed (no set_rollout_workers)
        def poll(self):
            return {"step": 1, "metrics": [], "rollout": [], "buffer": {}, "trainer": {}}

        def top_up_prompts(self, n=None):
            return 0

    requests = ScaleRequests(tmp_path)
    rid = request_scale(tmp_path, 2)
    reported = []
    Supervisor(_cfg(), OneProcess(), report=reported.append, requests=requests).tick()
    answer = read_answer(tmp_path, rid)
    assert answer["rollout_workers"] is None and "cannot change" in answer["detail"]
    assert [e.kind for e in reported] == ["scale_requested", "scale_unsupported"]
    with pytest.raises(ConfigError, match="needs the Ray host"):
        _cfg("cluster.host=threads", "cluster.autoscale.enabled=true")
