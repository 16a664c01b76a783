"""The Ray runtime on a real local Ray instance (num_cpus=2): staleness bound, restarts, lockstep and async learn,
clear errors for bad clusters. One Ray instance serves the module; each run creates and kills its actors."""

from __future__ import annotations

import os
import time

import pytest
import torch

os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
from tests.ledger_checks import assert_ledger_balances

ray = pytest.importorskip("ray")

from rlhf_core.config import load_config  # noqa: E402
from rlhf_core.distributed import ClusterError, DistributedRun, run_distributed  # noqa: E402

pytestmark = pytest.mark.slow  # every test here starts a local Ray instance (`make test-fast` skips them)


def tiny_cfg(tmp_path, *overrides):
    return load_config(
        "configs/tiny.yaml",
        [
            f"run.output_dir={tmp_path}",
            "cluster.num_cpus=2",
            "data.eval_size=100",
            "supervision.supervise_interval_s=0.2",
            "runtime.wait_timeout_s=60",
            "trainer.lr_schedule=constant",  # the short runs below were sized with a constant lr
            *overrides,
        ],
    )


def assert_all_dead(actors, within_s: float = 30.0) -> None:
    """Every actor handle answers with RayActorError (killed, not merely idle) within `within_s`:
    ray.kill is asynchronous, so a call made right after it may still be served."""
    assert actors
    deadline = time.monotonic() + within_s
    for actor in actors:
        while True:
            try:
                ray.get(actor.__ray_ready__.remote(), timeout=10)
            except ray.exceptions.RayActorError:
                break
            assert time.monotonic() < deadline, f"{actor} is still alive {within_s:g} s after teardown"
            time.sleep(0.2)


def test_the_warm_start_reports_its_progress_and_a_failed_trainer_ends_the_run_keeping_its_checkpoint(
    ray_local, tmp_path
):
    """The warm start runs in the trainer actor: meanwhile the driver hears how far it got (the flow logs it at
    least every 10 s), from the first steps to the last, and the weights it taught are then published. The same
    run then trains; its trainer crashes after a checkpoint: the run ends with RunFailed "trainer failed", and the
    checkpoint taken before stays readable. (One run for both: each launch of the actors costs seconds.)"""
    from rlhf_core.distributed import RunFailed
    from rlhf_core.run.checkpoint import read_checkpoint

    seen: list[tuple[int, float]] = []
    cfg = tiny_cfg(tmp_path, "trainer.total_steps=500")
    with DistributedRun(cfg) as run:
        run.launch()
        out = run.warm_start(40, progress=lambda done, loss: seen.append((done, loss)), every_s=0.02)
        run.start()
        while run.poll()["step"] < 3:
            time.sleep(0.1)
        ckpt = run.checkpoint(tmp_path / "ckpt")
        run.trainer.crash.remote()
        with pytest.raises(RunFailed, match="trainer failed"):
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                run.poll()
                time.sleep(0.2)
    assert out["warm_start/steps"] == 40 and 0.0 <= out["eval/accuracy_warm_start"] <= 1.0
    done = [d for d, _ in seen]
    assert len(seen) >= 3 and done == sorted(done) and 0 < done[-1] <= 40, seen
    assert all(loss is not None and loss > 0 for d, loss in seen if d > 0), seen
    state, _ = read_checkpoint(ckpt)
    assert state.step >= 3


def test_the_bound_the_user_set_is_the_bound_trained_at_and_stopping_gives_the_prefetched_batch_back(
    ray_local, tmp_path
):
    """tau = 4 where the trainer is the slower role: staleness reaches 4 (the supervisor once narrowed admission
    on its own to tau <= 3), and async/max_staleness reports the bound in force at every step. The random engine
    makes the rollout the faster role however loaded the machine is (with the HF engine a busy machine could
    leave the rollout behind, and staleness below the bound).

    The run is then stopped mid-run (cancelled after 40 of 500 steps): the trainer prefetches batch V + 1 while V
    trains, and stopping must not count that batch as consumed. The rollout, far faster than the trainer, keeps
    the buffer stocked, so a batch is prefetched at the stop."""
    cfg = tiny_cfg(
        tmp_path,
        "trainer.total_steps=500",
        "runtime.max_staleness=4",
        "trainer.prompts_per_step=4",
        "rollout.prompts_per_batch=4",
        "rollout.engine=random",
        "rollout.engine_kwargs.tokens_per_s=1000000",
        "supervision.staleness_warn=0.5",
    )
    last_step = [0]
    result = run_distributed(
        cfg,
        poll_interval_s=0.2,
        on_poll=lambda poll: last_step.__setitem__(0, poll["step"]),
        cancelled=lambda: last_step[0] >= 40,
    )
    assert result["cancelled"]
    hist = result["final_poll"]["trainer"]["staleness_hist"]
    assert max(int(t) for t in hist) == 4, hist
    assert {m["async/max_staleness"] for m in result["metrics"]} == {4}
    assert not [e for e in result["events"] if "narrow" in str(e.get("kind"))]

    final, rec = result["final_poll"], result["reconcile"]
    steps = final["step"]
    assert 40 <= steps < 500
    assert final["buffer"]["given_back"] == cfg.trainer.prompts_per_step  # the prefetched batch went back
    assert rec["trained"] == rec["consumed"] == steps * cfg.trainer.prompts_per_step  # trained on, not merely taken
    assert_ledger_balances(rec)
    # the rollout loop asks admission for its next batch before generating this one; stopping returns it
    assert final["buffer"]["admitted"] == rec["generated"]


def test_a_rollout_worker_declared_lost_or_killed_generates_again_and_the_run_completes_counting_every_group(
    ray_local, tmp_path
):
    """Two faults of the one rollout worker in one run.

    Declared lost: the driver declares worker 0's loop lost (its leases revoked, its prompts requeued) while its
    process lives on, as after a partition that healed: Ray does not restart it, the ping answers, the driver
    starts its loop again in the same process. That loop takes a new lease name and generates (the revoked one
    would have every admission refused: the only worker idle, the run stuck); nothing died.

    Killed: then the worker's process is killed: Ray restarts it (one restart counted, its death and its restart
    reported as events), a checkpoint taken while it is down succeeds (its RNG state recorded as missing), and
    the run completes, every group counted once."""
    from rlhf_core.run.checkpoint import read_checkpoint

    cfg = tiny_cfg(tmp_path, "trainer.total_steps=40", "cluster.max_restarts=2")
    events = []
    with DistributedRun(cfg) as run:
        run.launch()
        run.start()
        deadline = time.monotonic() + 240
        while (poll := run.poll())["step"] < 5:
            events.extend(poll["events"])
            assert time.monotonic() < deadline, "the run made no progress"
            time.sleep(0.1)

        holder = ray.get(run.workers[0].ping.remote())["holder"]
        ray.get(run.workers[0].stop.remote())
        ray.get(run.worker_loops.pop(0))  # the loop ended; the driver takes it as lost (the process lives on)
        pushed = ray.get(run.workers[0].stats.remote())["groups_pushed"]
        run.recover_prompts(0)
        run.pending_starts[0] = (time.monotonic(), "restarting")
        while ray.get(run.workers[0].stats.remote())["groups_pushed"] <= pushed:
            poll = run.poll()
            events.extend(poll["events"])
            assert time.monotonic() < deadline, f"the worker never generated again (step {poll['step']})"
            time.sleep(0.2)
        assert run.restarts == [0]  # nothing died
        assert ray.get(run.workers[0].ping.remote())["holder"] != holder

        assert not run.done, "the run ended before its worker could be killed: raise trainer.total_steps"
        run.workers[0].crash.remote()
        time.sleep(0.2)
        ckpt = run.checkpoint(tmp_path / "during_restart")  # never fails the run
        state, _ = read_checkpoint(ckpt)
        assert len(state.rng["rollout"]) == 1
        assert (state.rng["rollout"][0] is None) == (state.run.get("rollout_rng_missing") == [0])
        while not run.done:
            assert time.monotonic() < deadline, "the run did not recover after the restart"
            events.extend(run.poll()["events"])
            time.sleep(0.2)
        assert run.restarts == [1]
        run.stop()  # the loops stop and their last pushes land: then every group is where it is counted
        final = run.poll()
        events.extend(final["events"])
        rec = run.reconcile(final)
    assert final["step"] == 40
    assert_ledger_balances(rec)
    kinds = [e["kind"] for e in events]
    assert "rollout_worker_died" in kinds and "rollout_worker_restarted" in kinds, kinds


def test_lockstep_learns(ray_local, tmp_path):
    cfg = tiny_cfg(tmp_path, "trainer.total_steps=70", "runtime.max_staleness=0", "trainer.lr=0.0005")
    result = run_distributed(cfg, poll_interval_s=0.2)
    assert result["eval/accuracy_start"] <= 0.3
    assert result["eval/accuracy"] >= result["eval/accuracy_start"] + 0.3, result["eval/accuracy"]
    assert set(result["final_poll"]["trainer"]["staleness_hist"]) == {0}


def test_an_async_run_learns_within_the_bound_accounts_for_every_prompt_and_checkpoints_on_time(ray_local, tmp_path):
    """One async run (tau 2), everything it must hold: it learns; every consumed sample is within the bound and
    counted; the prompts are counted at both ends (nothing lost or doubled); the trainer, moving on while the
    driver polls, checkpoints itself at each exact multiple of checkpoint.every, named by the step it holds; the
    teardown kills exactly this run's actors and leaves the Ray it did not start running."""
    from rlhf_core.run.checkpoint import read_checkpoint

    steps = 70
    cfg = tiny_cfg(tmp_path, f"trainer.total_steps={steps}", "runtime.max_staleness=2", "trainer.lr=0.0005")
    cfg.checkpoint.every = 25
    launched = []
    result = run_distributed(cfg, poll_interval_s=0.2, on_launch=lambda run: launched.extend(run.handle.actors))
    assert result["steps"] == steps
    assert result["eval/accuracy_start"] <= 0.3
    assert result["eval/accuracy"] >= result["eval/accuracy_start"] + 0.3, result["eval/accuracy"]

    hist = result["final_poll"]["trainer"]["staleness_hist"]
    assert hist and max(hist) <= 2, hist  # every consumed sample: tau <= tau_max
    assert sum(hist.values()) == steps * cfg.batch_size  # ... and every consumed sample is counted
    per_step = [m["async/staleness_max"] for m in result["metrics"]]
    assert len(per_step) == steps and max(per_step) <= 2
    rec = result["reconcile"]
    assert rec["trained"] == rec["consumed"] == steps * cfg.trainer.prompts_per_step
    assert_ledger_balances(rec)  # counted at both ends: nothing lost or doubled

    names = sorted(p.name for p in (tmp_path / "checkpoints").glob("step_*"))
    assert names == ["step_000025", "step_000050"]
    for name in names:
        state, _ = read_checkpoint(tmp_path / "checkpoints" / name)
        assert state.step == int(name.removeprefix("step_")) == state.version
        assert state.run["eval_start"] == result["eval/accuracy_start"] and len(state.rng["rollout"]) == 1

    assert_all_dead(launched)  # teardown killed exactly our actors
    assert ray.is_initialized()  # ... and left the Ray it did not start running


def test_bad_cluster_address_fails_fast(tmp_path):
    cfg = tiny_cfg(tmp_path, "cluster.address=ray://127.0.0.1:1")
    start = time.monotonic()
    with pytest.raises(ClusterError, match="127.0.0.1:1"):
        DistributedRun(cfg).launch()
    assert time.monotonic() - start < 30


def test_too_few_resources_is_a_clear_error(ray_local, tmp_path):
    cfg = tiny_cfg(tmp_path, "rollout.num_workers=3")
    run = DistributedRun(cfg)
    with pytest.raises(ClusterError, match="not enough resources.*CPU: need 4"):
        run.launch()
    assert run.handle is None and run.workers == []  # nothing was created


def test_the_loop_and_the_ray_runtime_resume_from_each_others_checkpoints(ray_local, tmp_path):
    """One checkpoint layout, one writer and reader (the trainer role): the in-process host continues a Ray run's
    checkpoint (weights, optimizer, versions, prompts trained on, run facts), and the Ray host continues the
    in-process host's; every prompt of the epoch is trained exactly once across the three legs."""
    from rlhf_core.loop import run_sync
    from rlhf_core.run.checkpoint import read_checkpoint

    common = [
        "runtime.max_staleness=0",
        "eval.every=0",
        "data.eval_size=20",
        "trainer.prompts_per_step=4",
        "rollout.prompts_per_batch=4",
        "rollout.samples_per_prompt=4",
    ]
    cfg = tiny_cfg(tmp_path, "trainer.total_steps=2", *common)
    per_step = cfg.trainer.prompts_per_step
    with DistributedRun(cfg) as run:
        run.launch()
        run.eval_start = 0.125
        run.start()
        deadline = time.monotonic() + 120
        while not run.poll()["done"]:
            assert time.monotonic() < deadline
            time.sleep(0.1)
        run.stop()
        ray_ckpt = run.checkpoint(tmp_path / "ray_ckpt", run={"mlflow_run_id": "0" * 32})
    ray_state, _ = read_checkpoint(ray_ckpt)
    assert ray_state.step == 2 and sorted(ray_state.data["trained"].values()) == [1] * 2 * per_step
    assert len(ray_state.rng["rollout"]) == cfg.rollout.num_workers and ray_state.config == cfg.model_dump(mode="json")

    loop_cfg = tiny_cfg(tmp_path, "trainer.total_steps=4", "checkpoint.every=2", *common)
    result = run_sync(loop_cfg, resume_from=str(ray_ckpt), checkpoint_dir=tmp_path / "loop_ckpts")
    assert result["steps"] == 4 and result["eval/accuracy_start"] == 0.125  # the Ray run's fact, carried over
    loop_ckpt = tmp_path / "loop_ckpts" / "step_000004"
    loop_state, _ = read_checkpoint(loop_ckpt)
    assert loop_state.version == 4 and sorted(loop_state.data["trained"].values()) == [1] * 4 * per_step  # none twice
    assert set(ray_state.data["trained"]) < set(loop_state.data["trained"])
    assert loop_state.run["mlflow_run_id"] == "0" * 32

    more = tiny_cfg(tmp_path, "trainer.total_steps=5", *common)
    with DistributedRun(more) as run:
        info = run.launch(resume_from=str(loop_ckpt))
        assert (info["step"], info["version"]) == (4, 4) and run.eval_start == 0.125
        queue = ray.get(run.queue.state_dict.remote())  # the loop's record of trained prompts, not its queue
        assert queue["queued"] == [] and queue["source"]["seed"] == loop_state.data["source"]["seed"]
        run.start()
        deadline = time.monotonic() + 120
        while not run.poll()["done"]:
            assert time.monotonic() < deadline
            time.sleep(0.1)
        run.stop()
        # eval.every's pinned evaluation runs on an actor of its own, on the version the store holds: the last one
        assert run.submit_evaluation() == 5
        deadline, pinned = time.monotonic() + 120, []
        while not pinned:
            assert time.monotonic() < deadline
            time.sleep(0.1)
            pinned = run.evaluations()
        assert pinned[0]["eval/version"] == 5 and run.evaluation.actor is not None
        assert pinned[0]["eval/accuracy"] == run.evaluate()["eval/accuracy"]  # the trainer's own weights, the same
        final = run.checkpoint(tmp_path / "ray_ckpt2")
    final_state, _ = read_checkpoint(final)
    assert final_state.step == 5 and sorted(final_state.data["trained"].values()) == [1] * 5 * per_step
    ledger = final_state.run["ledger"]  # carried through both resumes: every step's samples trained, none lost
    assert ledger["trained_samples"] == 5 * more.batch_size and ledger["unaccounted_tokens"] == 0, ledger


def test_partial_rollouts_adopt_weights_mid_batch_and_bound_every_tokens_staleness(ray_local, tmp_path):
    """rollout.partial_rollout: the rollout worker adopts published weights between decode steps; rows then hold
    tokens of several versions, the per-token staleness is logged and stays within max_staleness (groups are
    as old as their oldest token), and every group is still accounted for."""
    cfg = tiny_cfg(
        tmp_path,
        "trainer.total_steps=20",
        "runtime.max_staleness=2",
        "rollout.prompts_per_batch=8",
        "rollout.max_new_tokens=32",
        "rollout.partial_rollout=true",
        # responses stay long (a tiny lr: the untrained policy stops at random, ~1 token in 19), so each batch
        # spans many decode steps while the trainer publishes: a run without a single update landing
        # mid-generation (seen once with 16 tokens at the default lr, where responses shrink to the answer)
        # would mean the hook is not called
        "trainer.lr=1e-7",
    )
    result = run_distributed(cfg, poll_interval_s=0.2)
    assert result["steps"] == 20
    metrics = result["metrics"]
    assert all("async/token_staleness_max" in m for m in metrics)
    assert max(m["async/token_staleness_max"] for m in metrics) <= 2
    assert max(m["async/staleness_max"] for m in metrics) <= 2
    rollout = result["final_poll"]["rollout"]
    rollout = rollout if isinstance(rollout, list) else [rollout]
    mid_batch = sum(r["syncs_mid_batch"] for r in rollout)
    assert mid_batch >= 1, rollout  # weights did change mid-generation
    rec = result["reconcile"]
    assert_ledger_balances(rec)


def test_tau_zero_the_in_process_host_and_the_ray_host_train_the_same_model(ray_local, tmp_path):
    """The invariant of the async path: runtime.max_staleness 0, one rollout worker, the same seed and rollout
    settings -> the asynchronous runtime trains the model run_sync trains: the same samples step by step (their
    rewards, lengths, losses) and weights equal within 1e-6 after 20 steps. configs/tiny.yaml draws prompts
    prioritized: both prompt queues (a Ray actor on one host) end with the same table of what the rollout
    reported."""
    from safetensors.torch import load_file

    from rlhf_core.loop import build_run, export_run, run_sync

    overrides = [
        "trainer.total_steps=20",
        "runtime.max_staleness=0",
        "rollout.num_workers=1",
        "trainer.prompts_per_step=4",
        "rollout.prompts_per_batch=4",
        "rollout.samples_per_prompt=4",
        "eval.every=0",
        "checkpoint.every=0",
        "data.eval_size=20",
    ]
    sync_cfg = tiny_cfg(tmp_path / "sync", *overrides)
    parts = build_run(sync_cfg, share_weights=True)
    run_sync(sync_cfg, parts=parts)
    export_run(parts, tmp_path / "sync_export")

    async_cfg = tiny_cfg(tmp_path / "async", *overrides)
    box = []

    def export_when_done(poll):
        if poll["done"]:
            box[0].export(tmp_path / "async_export")
            box.append(box[0]._queue("state_dict"))  # the queue actor's, with what the rollout reported

    result = run_distributed(async_cfg, poll_interval_s=0.2, on_launch=box.append, on_poll=export_when_done)
    assert result["steps"] == 20
    a_steps = sorted(result["metrics"], key=lambda m: m["version"])
    assert [m["version"] for m in a_steps] == list(range(1, 21))
    for s, a in zip(parts.history, a_steps):  # the same samples in the same order
        for key in ("reward/mean", "response/length_mean", "loss/policy", "async/staleness_max", "data/solved_frac"):
            assert a[key] == pytest.approx(s[key], abs=1e-6), (s["version"], key)
    reported = box[-1]["source"]["success"]
    assert len(reported) >= 20 and reported == parts.prompts.state_dict()["source"]["success"]
    sync_w = load_file(str(next((tmp_path / "sync_export").rglob("*.safetensors"))))
    async_w = load_file(str(next((tmp_path / "async_export").rglob("*.safetensors"))))
    assert sync_w.keys() == async_w.keys()
    for name in sync_w:
        torch.testing.assert_close(async_w[name], sync_w[name], atol=1e-6, rtol=0, msg=lambda m, n=name: f"{n}: {m}")
