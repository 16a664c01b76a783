"""The in-process async host (cluster.host: threads, rlhf_core.hosts.threads.ThreadedRun): the roles' loops on threads
of this process, under the same supervision as the Ray host. It trains the tiny task within the staleness bound
with every group accounted for, resumes from its own and the in-process lockstep loop's checkpoints (one layout),
trains run_sync's model at max_staleness 0, and the Prefect flow runs on it. No Ray is started here."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from rlhf_core.config import load_config
from rlhf_core.distributed import run_distributed
from rlhf_core.hosts import make_runtime
from rlhf_core.hosts.threads import ThreadedRun
from tests.ledger_checks import assert_ledger_balances

REPO = Path(__file__).resolve().parents[1]
LOCKSTEP = [
    "runtime.max_staleness=0",
    "rollout.num_workers=1",
    "trainer.prompts_per_step=4",
    "rollout.prompts_per_batch=4",
    "rollout.samples_per_prompt=4",
    "eval.every=0",
    "data.eval_size=20",
]


def threads_cfg(tmp_path, *overrides):
    return load_config(
        REPO / "configs" / "tiny.yaml",
        [
            f"run.output_dir={tmp_path}",
            "cluster.host=threads",
            "data.eval_size=100",
            "supervision.supervise_interval_s=0.2",
            "runtime.wait_timeout_s=60",
            *overrides,
        ],
    )


def run_and_export(cfg, export_to: Path, resume_from=None) -> dict:
    """run_distributed on the threads host, exporting the policy when the trainer reaches total_steps."""
    box: list = []

    def export_when_done(poll):
        if poll["done"] and not export_to.exists():
            box[0].export(export_to)

    return run_distributed(
        cfg, resume_from=resume_from, poll_interval_s=0.2, on_launch=box.append, on_poll=export_when_done
    )


def weights(path: Path) -> dict:
    return load_file(str(next(path.rglob("*.safetensors"))))


def assert_same_weights(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(a[name], b[name], atol=1e-6, rtol=0, msg=lambda m, n=name: f"{n}: {m}")


def test_the_threads_host_trains_within_the_bound_and_accounts_for_every_group(tmp_path):
    cfg = threads_cfg(
        tmp_path, "trainer.total_steps=25", "runtime.max_staleness=1", "rollout.prompts_per_batch=8",
        "rollout.num_workers=2",
    )  # fmt: skip
    assert isinstance(make_runtime(cfg), ThreadedRun)
    result = run_distributed(cfg, poll_interval_s=0.2)
    assert result["steps"] == 25 and result["ray_address"].startswith("in-process")
    hist = result["final_poll"]["trainer"]["staleness_hist"]
    assert hist and max(hist) <= 1, hist
    assert sum(hist.values()) == 25 * cfg.batch_size
    per_step = result["metrics"]
    assert [m["version"] for m in sorted(per_step, key=lambda m: m["version"])] == list(range(1, 26))
    assert max(m["async/staleness_max"] for m in per_step) <= 1 and {m["async/max_staleness"] for m in per_step} == {1}
    for name in ("util/trainer_busy", "util/rollout_busy", "throughput/samples_per_s", "buffer/size", "reward/mean"):
        assert all(name in m for m in per_step), name
    rollout = result["final_poll"]["rollout"]
    assert len(rollout) == 2 and all(r["groups_pushed"] > 0 for r in rollout)  # both workers generated
    rec = result["reconcile"]
    assert rec["trained"] == rec["consumed"] == 25 * cfg.trainer.prompts_per_step
    assert_ledger_balances(rec)
    assert "ray" not in sys.modules or not sys.modules["ray"].is_initialized()


def test_tau_zero_the_threads_host_trains_the_same_model_as_run_sync(tmp_path):
    """At max_staleness 0 with one rollout worker, the threads host trains run_sync's samples step by step and
    its weights, as the Ray host does (tests/test_distributed.py)."""
    from rlhf_core.loop import build_run, export_run, run_sync

    overrides = ["trainer.total_steps=20", "checkpoint.every=0", *LOCKSTEP]
    sync_cfg = threads_cfg(tmp_path / "sync", *overrides)
    parts = build_run(sync_cfg, share_weights=True)
    run_sync(sync_cfg, parts=parts)
    export_run(parts, tmp_path / "sync_export")

    result = run_and_export(threads_cfg(tmp_path / "async", *overrides), tmp_path / "async_export")
    assert result["steps"] == 20
    a_steps = sorted(result["metrics"], key=lambda m: m["version"])
    assert [m["version"] for m in a_steps] == list(range(1, 21))
    for s, a in zip(parts.history, a_steps):
        for key in ("reward/mean", "response/length_mean", "loss/policy", "async/staleness_max"):
            assert a[key] == pytest.approx(s[key], abs=1e-6), (s["version"], key)
    assert_same_weights(weights(tmp_path / "sync_export"), weights(tmp_path / "async_export"))


def test_a_threads_checkpoint_resumes_on_both_in_process_hosts_to_the_straight_runs_weights(tmp_path):
    """The threads host writes the one checkpoint layout at exact multiples; resumed from step 2 by itself and
    by run_sync (max_staleness 0), both reach the weights of the straight run, and no prompt is trained twice."""
    from rlhf_core.loop import build_run, export_run, run_sync
    from rlhf_core.run.checkpoint import read_checkpoint

    overrides = ["trainer.total_steps=4", "checkpoint.every=2", *LOCKSTEP]
    straight_cfg = threads_cfg(tmp_path / "straight", *overrides)
    batch = straight_cfg.batch_size
    straight = run_and_export(straight_cfg, tmp_path / "straight_export")
    assert straight["steps"] == 4
    ckpt = tmp_path / "straight" / "checkpoints" / "step_000002"
    state, _ = read_checkpoint(ckpt)
    assert state.step == state.version == 2 and len(state.rng["rollout"]) == 1
    assert sorted(state.data["trained"].values()) == [1] * 8 and state.run["eval_start"] is not None
    at_ckpt = state.run["ledger"]  # the token ledger the checkpoint recorded
    assert at_ckpt["trained_samples"] == 2 * batch and at_ckpt["unaccounted_tokens"] == 0, at_ckpt
    reference = weights(tmp_path / "straight_export")

    resumed = run_and_export(threads_cfg(tmp_path / "resumed", *overrides), tmp_path / "resumed_export", str(ckpt))
    assert resumed["steps"] == 4 and resumed["step"] == 2  # launched at the checkpoint's step
    assert resumed["eval/accuracy_start"] == state.run["eval_start"]
    assert_same_weights(reference, weights(tmp_path / "resumed_export"))
    rec = resumed["reconcile"]  # across the resume: the checkpoint's accounts go on, what it held is carried
    assert_ledger_balances(rec)
    assert rec["trained_samples"] == 4 * batch, rec
    assert rec["carried_samples"] == at_ckpt["buffered_samples"] + at_ckpt["in_flight_samples"], rec

    loop_cfg = threads_cfg(tmp_path / "loop", *overrides)
    parts = build_run(loop_cfg, share_weights=True)
    run_sync(loop_cfg, resume_from=str(ckpt), parts=parts)
    export_run(parts, tmp_path / "loop_export")
    assert_same_weights(reference, weights(tmp_path / "loop_export"))
    final, _ = read_checkpoint(tmp_path / "loop" / "checkpoints" / "step_000004")
    assert sorted(final.data["trained"].values()) == [1] * 16  # every prompt once across the two legs


@pytest.mark.slow  # the session's Prefect server (15-30 s to start)
def test_the_training_flow_runs_on_the_threads_host(prefect_api, tmp_path):
    """The Prefect flow (launch, evaluate, the loops as task runs, supervise, checkpoint, export) on threads."""
    from flows.train import train

    cfg = threads_cfg(
        tmp_path / "flow",
        "trainer.total_steps=6", "eval.every=3", "checkpoint.every=3", "data.eval_size=20",
        "rollout.prompts_per_batch=4", "trainer.prompts_per_step=4", "rollout.samples_per_prompt=4",
        "runtime.max_staleness=1", f"tracking.tracking_uri=sqlite:///{tmp_path / 'mlflow.db'}",
        "tracking.log_system_metrics=false",
    )  # fmt: skip
    state = train(config=cfg, return_state=True)
    assert state.is_completed(), state.message
    result = state.result()
    assert result["steps"] == 6 and 0.0 <= result["eval/accuracy"] <= 1.0
    assert Path(result["checkpoint"], "policy.safetensors").is_file()
    assert Path(result["export"], "config.json").is_file()
    from mlflow.tracking import MlflowClient

    client = MlflowClient(cfg.tracking.tracking_uri)
    for name in ("reward/mean", "async/staleness_max", "util/trainer_busy", "util/rollout_busy", "version"):
        steps = [m.step for m in client.get_metric_history(result["mlflow_run_id"], name)]
        assert steps == [1, 2, 3, 4, 5, 6], (name, steps)
    assert max(m.value for m in client.get_metric_history(result["mlflow_run_id"], "async/staleness_max")) <= 1
    assert "ray" not in sys.modules or not sys.modules["ray"].is_initialized()


def test_a_sharded_trainer_group_needs_the_ray_host(tmp_path):
    with pytest.raises(ValueError, match="cluster.trainer_workers=2 needs cluster.host='ray'"):
        threads_cfg(tmp_path, "cluster.trainer_workers=2", "trainer.micro_batch_size=8")


def test_a_role_that_raises_fails_the_next_poll_and_its_loop_watch_naming_it(tmp_path):
    from rlhf_core.run.control import RunFailed

    cfg = threads_cfg(tmp_path, "trainer.total_steps=20", "data.eval_size=20", "eval.every=0")
    with ThreadedRun(cfg) as run:
        run.launch()
        real = run.trainer_role.trainer.train_step

        def train_step(batch):
            if run.trainer_role.trainer.step >= 2:
                raise ValueError("injected at step 3")
            return real(batch)

        run.trainer_role.trainer.train_step = train_step
        run.start()
        with pytest.raises(RunFailed, match="trainer failed: ValueError: injected at step 3"):
            run.wait_loop("trainer")
        with pytest.raises(RunFailed, match="trainer failed: ValueError: injected at step 3"):
            run.poll()
        assert run.failed and run.last_step == 0  # the poll raised before reading the step
    assert run.trainer_role is None and run.rollout_roles == []  # torn down: every loop stopped


def test_a_pinned_evaluation_scores_exactly_the_version_it_names_while_the_trainer_goes_on(tmp_path):
    """rlhf_core.run.pinned_eval: eval.every's evaluation runs on its own thread over a policy copy of its own, on
    the snapshot the trainer published as version V; the trainer keeps stepping meanwhile, and the result names V.
    Asked again at the end it equals the synchronous evaluation of the same weights; requests while it is busy
    queue one version, and the replaced ones are counted."""
    cfg = threads_cfg(tmp_path, "trainer.total_steps=30", "data.eval_size=60", "eval.every=0")
    with ThreadedRun(cfg) as run:
        run.launch()
        run.start()
        while run.poll()["step"] < 3:
            time.sleep(0.05)
        version = run.submit_evaluation()
        assert version >= 2  # the newest published (its publish may trail the step by one)
        results: list = []
        while not results:
            run.poll()
            results += run.evaluations()
            time.sleep(0.05)
        assert results[0]["eval/version"] == version and 0.0 <= results[0]["eval/accuracy"] <= 1.0
        deadline = time.monotonic() + 60  # the evaluation never held the trainer: it goes on past the version
        while run.poll()["step"] <= version and time.monotonic() < deadline:
            time.sleep(0.05)
        assert run.last_step > version
        for _ in range(4):  # one runs, one waits; each request while busy replaces the waiting one
            run.submit_evaluation()
        assert run.pinned.wait_idle(120)
        done = run.evaluations()
        assert 1 <= len(done) <= 2 and len(done) + run.pinned.stats()["eval_skipped_versions"] == 4, done
        assert sum(len(r["skipped"]) for r in done) == 4 - len(done)  # each result names the versions it replaced
        while not run.done:
            run.poll()
            time.sleep(0.1)
        run.stop()
        assert run.pinned.wait_idle(120)
        run.evaluations()
        final = run.submit_evaluation()
        assert final == 30 and run.pinned.wait_idle(120)
        (pinned,) = run.evaluations()
        synchronous = run.evaluate()  # the trainer's own weights, under its lock
        assert pinned["eval/version"] == 30
        assert pinned["eval/accuracy"] == synchronous["eval/accuracy"]
        assert pinned["eval/reward_mean"] == pytest.approx(synchronous["eval/reward_mean"])
