"""The training flow end to end, in-process: real Prefect (test harness), real Ray, real MLflow on SQLite.

One Prefect test server and one local Ray instance serve the whole module (the runtime joins a Ray that is
already up and kills only its own actors); every run is the tiny demo for a few steps.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest

for _key, _value in {
    "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
    "RAY_USAGE_STATS_ENABLED": "0",
    "DO_NOT_TRACK": "1",
    "MLFLOW_DISABLE_TELEMETRY": "true",
    "MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR": "false",
    "PREFECT_LOGGING_TO_API_BATCH_INTERVAL": "0.5",
}.items():
    os.environ.setdefault(_key, _value)

from mlflow.tracking import MlflowClient  # noqa: E402
from prefect.client.orchestration import get_client  # noqa: E402
from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId  # noqa: E402
from prefect.states import Cancelling, StateType  # noqa: E402
from safetensors.torch import load_file  # noqa: E402

from flows.cli import main as cli_main  # noqa: E402
from flows.train import train  # noqa: E402
from rlhf_core.config import flatten_config, load_config  # noqa: E402
from tracking import load_logged_policy  # noqa: E402

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[1]

# Small enough to run in seconds on 2 cores; m2po + a KL term so that every contract metric is produced.
TINY = [
    "trainer.total_steps=6",
    "data.eval_size=20",
    "eval.every=3",
    "checkpoint.every=3",
    "model.preset=micro",
    "rollout.prompts_per_batch=4",
    "trainer.prompts_per_step=4",
    "rollout.samples_per_prompt=4",
    "cluster.num_cpus=2",
    "supervision.supervise_interval_s=0.2",
    "tracking.log_system_metrics=false",
    "algorithm.loss=m2po",
    "algorithm.kl_coef=0.01",
    "runtime.max_staleness=0",
    "trainer.lr_schedule=constant",  # policy/lr_micro below: a constant lr
]

CONTRACT_PER_STEP = [
    "reward/mean",
    "reward/std",
    "loss/policy",
    "loss/kl",
    "policy/entropy",
    "policy/clip_frac",
    "m2po/m2",
    "m2po/masked_frac",
    "async/staleness_mean",
    "async/staleness_max",
    "buffer/size",
    "buffer/evicted_stale",
    "buffer/dropped_overflow",
    "throughput/samples_per_s",
    "throughput/tokens_per_s",
    "util/rollout_busy",
    "util/trainer_busy",
    "sync/latency_s",
    "version",
]


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    return tmp_path_factory.mktemp("flow")


def overrides(work: Path, name: str, *extra: str) -> list[str]:
    return [
        *TINY,
        f"run.output_dir={work / name}",
        f"tracking.tracking_uri=sqlite:///{work / 'mlflow.db'}",
        f"tracking.run_name={name}",
        *extra,
    ]


def config(work: Path, name: str, *extra: str):
    return load_config(REPO / "configs" / "tiny.yaml", overrides(work, name, *extra))


def alive_actors() -> list[str]:
    from ray._private import state

    return [a for a, info in state.actors().items() if info["State"] != "DEAD"]


def mlflow_client(work: Path) -> MlflowClient:
    return MlflowClient(f"sqlite:///{work / 'mlflow.db'}")


def runs_named(work: Path, name: str) -> list:
    client = mlflow_client(work)
    exp = client.get_experiment_by_name("asynctensorrlhf")
    if exp is None:
        return []
    return client.search_runs([exp.experiment_id], filter_string=f"tags.`mlflow.runName` = '{name}'")


def read_flow_run_artifacts(flow_run_id) -> dict:
    with get_client(sync_client=True) as client:
        arts = client.read_artifacts(
            artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[flow_run_id]))
        )
    return {a.key: a for a in arts if a.key}


@pytest.fixture(scope="module")
def straight_run(prefect_api, ray_local, work):
    """Six lockstep steps straight through (also the reference for the resume-equality test), keeping one
    checkpoint (checkpoint.keep=1)."""
    cfg = config(work, "straight", "checkpoint.keep=1")
    start = time.perf_counter()
    state = train(config=cfg, return_state=True)
    return cfg, state, time.perf_counter() - start


def test_flow_completes_and_records_everything(straight_run, work):
    cfg, state, _ = straight_run
    assert state.is_completed(), state.message
    result = state.result()
    assert result["steps"] == 6
    assert 0.0 <= result["eval/accuracy_start"] <= 1.0 and 0.0 <= result["eval/accuracy"] <= 1.0
    assert Path(result["checkpoint"], "policy.safetensors").is_file()
    assert Path(result["export"], "config.json").is_file()
    assert not alive_actors(), "the flow left Ray actors behind"

    client = mlflow_client(work)
    run = client.get_run(result["mlflow_run_id"])
    assert run.info.status == "FINISHED"
    flow_run_id = str(state.state_details.flow_run_id)
    assert run.data.tags["prefect.flow_run_id"] == flow_run_id
    # params: the flattened config, all of it
    flat = flatten_config(cfg)
    assert set(flat) <= set(run.data.params)
    assert run.data.params["trainer.total_steps"] == "6" and run.data.params["algorithm.loss"] == "m2po"
    # metrics: one point per trainer step under the contract names
    for name in CONTRACT_PER_STEP:
        steps = [m.step for m in client.get_metric_history(run.info.run_id, name)]
        assert steps == [1, 2, 3, 4, 5, 6], (name, steps)
    evals = client.get_metric_history(run.info.run_id, "eval/accuracy")
    # eval.every=3: at the start, at the first poll at or after step 3 a pinned evaluation of the newest published
    # version, logged at that version's step (a fast trainer may be past 3, even at 6; one that reached the last step
    # by the poll is evaluated once, at the end: supervise evaluates "before the last"), at the end
    steps = sorted(m.step for m in evals)
    assert steps[0] == 0 and steps[-1] == 6 and len(steps) in (2, 3), steps
    assert all(2 <= s <= 6 for s in steps[1:-1]), steps
    pinned = client.get_metric_history(run.info.run_id, "eval/version")  # each pinned evaluation names its version
    assert len(pinned) == len(steps) - 2 and all(m.value == m.step for m in pinned), pinned
    assert client.get_metric_history(run.info.run_id, "eval/accuracy_start")
    # a constant learning rate also in millionths, which MLflow's chart reads (3e-4 as a flat 0)
    lr = [m.value for m in client.get_metric_history(run.info.run_id, "policy/lr_micro")]
    assert lr == pytest.approx([cfg.trainer.lr * 1e6] * 6)
    # artifacts: a checkpoint every 3 steps, of which the newest one stays (keep_checkpoints=1) on disk and in
    # MLflow; the model, plots, health events
    ckpts = sorted(a.path for a in client.list_artifacts(run.info.run_id, "checkpoints"))
    assert ckpts == ["checkpoints/step_000006"]
    assert sorted(p.name for p in Path(result["checkpoint"]).parent.iterdir()) == ["step_000006"]
    model_files = {Path(a.path).name for a in client.list_logged_model_artifacts(run.data.tags["model.id"])}
    assert {"config.json", "model.safetensors"} <= model_files
    assert not client.list_artifacts(run.info.run_id, "model")  # the policy is stored once, as the LoggedModel
    plots = {Path(a.path).name for a in client.list_artifacts(run.info.run_id, "plots")}
    assert plots == {"reward_curve.png", "reward_curve.json", "staleness_histogram.png"}
    # the run audit: final, in MLflow and in the run directory, and printed by `atrlhf audit <run id>`
    audit = client.download_artifacts(run.info.run_id, "audit.json")
    report = json.loads(Path(audit).read_text())
    assert report["final"] and {c["name"] for c in report["checks"]} >= {"weights", "staleness", "ledger"}
    assert {c["verdict"] for c in report["checks"] if c["name"] in ("weights", "ledger", "lr_schedule")} == {"ok"}
    assert json.loads((Path(result["run_dir"]) / "audit.json").read_text())["checks"] == report["checks"]

    # the logged model loads back, with the exported weights, and leaves no temporary directory behind
    temps_before = set(Path(tempfile.gettempdir()).glob("atrlhf-model-*"))
    model, tokenizer = load_logged_policy(run.info.run_id, tracking_uri=cfg.tracking.tracking_uri)
    exported = load_file(str(Path(result["export"]) / "model.safetensors"))
    for key, value in model.state_dict().items():
        if key in exported:
            assert (value == exported[key]).all(), key
    assert tokenizer.eos_token_id is not None
    # ... and `atrlhf evaluate` scores it from the run id
    assert (
        cli_main(
            [
                "evaluate",
                "--checkpoint",
                run.info.run_id,
                "--json",
                "--set",
                *TINY,
                f"tracking.tracking_uri={cfg.tracking.tracking_uri}",
            ]
        )
        == 0
    )
    assert set(Path(tempfile.gettempdir()).glob("atrlhf-model-*")) == temps_before

    # the Prefect side: the MLflow run id on the flow run, summary / health / progress artifacts
    with get_client(sync_client=True) as pc:
        fr = pc.read_flow_run(state.state_details.flow_run_id)
    assert f"mlflow-run:{run.info.run_id}" in fr.tags
    arts = read_flow_run_artifacts(state.state_details.flow_run_id)
    assert {"atrlhf-summary", "atrlhf-health-events", "atrlhf-progress", "atrlhf-mlflow-run"} <= set(arts)
    assert run.info.run_id in arts["atrlhf-summary"].data
    assert "](data:image/png;base64," in arts["atrlhf-summary"].data  # the reward curve, inline
    assert arts["atrlhf-health-events"].type == "table"
    assert float(arts["atrlhf-progress"].data) == 100.0


def test_resume_equals_straight_run(straight_run, work, capsys):
    """Sync mode, fixed seeds: 3 steps + resume (from the MLflow run id, through the CLI) + 3 steps gives
    the parameters of 6 steps straight; the resumed run is its own MLflow run, naming its parent and the
    step, and its reward curve shows the whole lineage."""
    _, straight, _ = straight_run
    assert straight.is_completed()
    base = ["train", "--config", str(REPO / "configs" / "tiny.yaml"), "--set", *overrides(work, "halves")]
    assert cli_main([*base, "trainer.total_steps=3"]) == 0
    out = capsys.readouterr().out
    assert "MLflow UI" in out and "mlflow ui --backend-store-uri" in out and "Prefect UI" in out
    (first,) = runs_named(work, "halves")
    assert first.info.run_id in out
    assert cli_main([*base, "trainer.total_steps=6", "--resume-from", first.info.run_id]) == 0

    client = mlflow_client(work)
    first, second = sorted(runs_named(work, "halves"), key=lambda r: r.info.start_time)
    assert first.info.status == second.info.status == "FINISHED"
    assert [m.step for m in client.get_metric_history(first.info.run_id, "reward/mean")] == [1, 2, 3]
    assert [m.step for m in client.get_metric_history(second.info.run_id, "reward/mean")] == [4, 5, 6]
    tags = second.data.tags
    assert tags["atrlhf.resumed_from_run"] == first.info.run_id and tags["atrlhf.resumed_from_step"] == "3"
    assert second.data.params["trainer.total_steps"] == "6"
    curve = client.download_artifacts(second.info.run_id, "plots/reward_curve.json")
    assert json.loads(Path(curve).read_text())["reward/mean"]["step"] == [1, 2, 3, 4, 5, 6]

    a = load_file(str(Path(straight.result()["export"]) / "model.safetensors"))
    # each run its own directory under run.output_dir; latest points to the resumed (newer) one
    dirs = sorted(p.parent for p in (work / "halves").glob("*/checkpoints") if not p.parent.is_symlink())
    assert len(dirs) == 2, dirs
    assert (work / "halves" / "latest").resolve() == dirs[1].resolve()
    assert second.data.tags["atrlhf.run_dir"] == str(dirs[1].resolve())
    assert sorted(p.name for p in (dirs[0] / "checkpoints").glob("step_*")) == ["step_000003"]
    b = load_file(str(work / "halves" / "latest" / "policy" / "model.safetensors"))
    assert a.keys() == b.keys()
    for key in a:
        assert (a[key] == b[key]).all(), f"{key} differs between the straight and the resumed run"
    assert not alive_actors()


def test_bad_config_fails_fast_naming_the_field(prefect_api, work):
    before = len(runs_named(work, "bad"))
    start = time.perf_counter()
    state = train(config={"trainer": {"total_steps": 0}, "tracking": {"run_name": "bad"}}, return_state=True)
    assert state.is_failed()
    assert "trainer.total_steps" in state.message
    assert time.perf_counter() - start < 30
    assert len(runs_named(work, "bad")) == before  # nothing was started or recorded


def test_the_cli_api_runs_its_start_hook_once_and_keeps_a_configured_api(prefect_api):
    """With an API configured (this module's server), `local_prefect_api` starts none, yields None and still calls
    `while_starting` (where the CLI imports its flow) exactly once; the temporary-server path is the CLI's own in
    tests/test_signals.py."""
    from prefect.settings import get_current_settings

    from flows.local_api import local_prefect_api

    calls = []
    with local_prefect_api(while_starting=lambda: calls.append(get_current_settings().api.url)) as url:
        assert url is None
    assert calls == [prefect_api["url"]]


def test_a_run_directory_in_use_by_a_live_run_is_refused_at_start(prefect_api, work):
    """Two runs told to share one directory (an explicit run.name): the second refuses before anything starts,
    naming the field and the process that holds it; the first one's files are untouched."""
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time; from rlhf_core.run.preflight import claim_run_dir; "
            "claim_run_dir(sys.argv[1], 'shared'); print('claimed', flush=True); time.sleep(120)",
            str(work / "clash"),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "claimed"
        state = train(config=config(work, "clash", "run.name=shared"), return_state=True)
        assert state.is_failed()
        assert "run.name='shared'" in state.message and f"pid {holder.pid}" in state.message
        assert not runs_named(work, "clash")
        assert sorted(p.name for p in (work / "clash" / "shared").iterdir()) == [".run.lock"]
    finally:
        holder.kill()
        holder.wait()


def test_corrupt_checkpoint_fails_before_anything_starts(prefect_api, ray_local, work):
    bad = work / "corrupt_ckpt"
    bad.mkdir()
    for name in ("policy.safetensors", "state.pt"):
        (bad / name).write_bytes(b"not a checkpoint")
    (bad / "meta.json").write_text("{broken")
    state = train(config=config(work, "corrupt"), resume_from=str(bad), return_state=True)
    assert state.is_failed()
    assert "meta.json" in state.message and "corrupt" in state.message
    assert not runs_named(work, "corrupt")
    assert not (work / "corrupt").exists()  # not even the tiny policy was built
    assert not alive_actors()


def test_mismatched_checkpoint_fails_cleanly(straight_run, work):
    """A checkpoint of another architecture: the runtime refuses it after starting the actors; the flow fails
    naming the mismatch, tears everything down and overwrites nothing."""
    _, straight, _ = straight_run
    ckpt = Path(straight.result()["checkpoint"])
    before = {p.name: p.stat().st_mtime_ns for p in ckpt.iterdir()}
    cfg = config(work, "mismatch", "model.preset=word:1x64x2", "trainer.total_steps=12")  # more steps than it holds
    state = train(config=cfg, resume_from=str(ckpt), return_state=True)
    assert state.is_failed()
    assert "does not match the model" in state.message
    assert {p.name: p.stat().st_mtime_ns for p in ckpt.iterdir()} == before
    assert not runs_named(work, "mismatch")
    assert not alive_actors()


def test_failure_mid_run_tears_down_and_marks_mlflow_failed(prefect_api, ray_local, work):
    """A rollout that cannot deliver (a generation far slower than supervision.stall_timeout_s allows: no trainer
    step comes) fails the flow mid-run naming the limit and the stuck role; the flow tears the actors down and
    ends the MLflow run FAILED. (Non-finite losses are covered by the supervision unit tests: a learning rate
    that would blow the weights up is now refused at config time.)"""
    cfg = config(
        work,
        "blowup",
        "rollout.engine=random",
        "rollout.engine_kwargs.tokens_per_s=0.5",
        "supervision.stall_timeout_s=5",
        "trainer.total_steps=20",
        "eval.every=0",
        "checkpoint.every=0",
    )
    state = train(config=cfg, return_state=True)
    assert state.is_failed()
    assert "supervision.stall_timeout_s" in state.message and "stuck: rollout" in state.message
    (run,) = runs_named(work, "blowup")
    assert run.info.status == "FAILED"
    assert "SupervisionError" in run.data.tags["error"]
    assert not alive_actors()


def flow_task_runs(flow_run_id) -> dict:
    """{task run name: task run} of a flow run."""
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    with get_client(sync_client=True) as client:
        runs = client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id])))
    return {r.name: r for r in runs}


def task_run_logs(task_run_id) -> list[str]:
    from prefect.client.schemas.filters import LogFilter, LogFilterTaskRunId

    time.sleep(1.5)  # the log worker sends in batches (PREFECT_LOGGING_TO_API_BATCH_INTERVAL=0.5 here)

    only = LogFilter(task_run_id=LogFilterTaskRunId(any_=[task_run_id]))
    with get_client(sync_client=True) as client:
        return [log.message for log in client.read_logs(log_filter=only)]


def state_type(task_run):
    """A task run's state type; None while the API holds the run but not its first state yet (Prefect 3.7 can
    list a task run a moment before its state)."""
    return task_run.state.type if task_run.state is not None else None


def test_the_loops_are_task_runs_that_span_the_run_and_a_cancel_from_the_api_ends_it(prefect_api, ray_local, work):
    """Async mode: the trainer's loop and each rollout worker's loop are task runs of the flow run, Running while
    the loop works and Completed when the run stops them, with their own log lines; a worker whose process died
    (SIGKILL) and that Ray restarted is a second attempt of its task run.

    The run ends by cancelling it from the API: the flow stops its loops, tears down (no actor left), ends the
    MLflow run KILLED, and the flow run ends Cancelled, in the API as in the state the flow returns."""
    import signal

    from ray._private import state as ray_state

    cfg = config(
        work,
        "loops",
        # far more than the test waits for (about 10 steps/s here), yet finite: if cancelling failed, the run would
        # still end on its own instead of holding the module's Ray for the tests after it
        "trainer.total_steps=3000",
        "rollout.num_workers=2",
        "cluster.resources.rollout.CPU=0.5",
        "checkpoint.every=0",
        "eval.every=0",
        "tracking.log_model=false",
    )
    box: dict = {}
    thread = threading.Thread(target=lambda: box.update(state=train(config=cfg, return_state=True)), daemon=True)
    thread.start()
    names = ("trainer-loop", "rollout-worker-0", "rollout-worker-1")

    def loops(flow_run_id) -> dict:
        return {name: r for name, r in flow_task_runs(flow_run_id).items() if name in names}

    deadline = time.monotonic() + 300
    run = None
    while time.monotonic() < deadline and thread.is_alive() and run is None:
        found = runs_named(work, "loops")
        run = (
            found[0] if found and mlflow_client(work).get_metric_history(found[0].info.run_id, "reward/mean") else None
        )
        time.sleep(0.2)
    assert run is not None, f"the flow never reached training: {box}"
    flow_run_id = run.data.tags["prefect.flow_run_id"]
    while (
        time.monotonic() < deadline and [state_type(r) for r in loops(flow_run_id).values()] != [StateType.RUNNING] * 3
    ):
        time.sleep(0.2)  # submitted beside the supervision: Running within moments
    assert {n: state_type(r) for n, r in loops(flow_run_id).items()} == dict.fromkeys(names, StateType.RUNNING)

    actors = ray_state.actors().values()
    workers = [a for a in actors if a["ActorClassName"] == "RolloutActor" and a["State"] == "ALIVE"]
    os.kill(min(workers, key=lambda a: a["ActorID"])["Pid"], signal.SIGKILL)  # as an OOM kill would
    while time.monotonic() < deadline and not any(  # Ray restarts it; the flow restarts its loop: attempt 2
        r.run_count == 2 and state_type(r) == StateType.RUNNING for r in loops(flow_run_id).values()
    ):
        time.sleep(0.5)
    with get_client(sync_client=True) as pc:
        pc.set_flow_run_state(flow_run_id, Cancelling(message="test: enough seen"), force=True)
    thread.join(timeout=180)
    assert not thread.is_alive(), "the flow did not stop after cancellation"
    assert box["state"].type == StateType.CANCELLED, box
    with get_client(sync_client=True) as pc:
        assert pc.read_flow_run(flow_run_id).state.type == StateType.CANCELLED
    assert mlflow_client(work).get_run(run.info.run_id).info.status == "KILLED"

    ended = loops(flow_run_id)
    assert {n: r.state.type for n, r in ended.items()} == dict.fromkeys(names, StateType.COMPLETED)
    assert sorted(r.run_count for r in ended.values()) == [1, 1, 2]  # the killed worker's task ran twice
    restarted = next(r for r in ended.values() if r.run_count == 2)
    assert any("restarted by Ray" in line for line in task_run_logs(restarted.id))
    assert any("training to step 3000" in line for line in task_run_logs(ended["trainer-loop"].id))
    assert not alive_actors()


def test_a_loop_that_fails_is_a_failed_task_run_with_its_error(prefect_api, ray_local, work, tmp_path):
    """A rollout worker's loop that raises (a reward function that always fails): its task run ends Failed with
    the worker's error, without a retry (only a worker whose process died gets a new attempt); the flow fails
    with the function's error (RewardFunctionError, its place in reward.functions, the limit that stopped it),
    and its MLflow run is FAILED with that error in its tags."""
    (tmp_path / "bad_reward.py").write_text(
        "def raises(prompts, completions, **kw):\n    raise ValueError('cannot score this')\n"
    )
    cfg = config(
        work,
        "loop-fails",
        "trainer.total_steps=40",
        "checkpoint.every=0",
        "eval.every=0",
        f"reward.functions=[{{path: {tmp_path / 'bad_reward.py'}, name: raises}}]",
        "supervision.max_consecutive_failures=3",
    )
    state = train(config=cfg, return_state=True)
    assert state.is_failed()
    assert "cannot score this" in state.message
    assert "RewardFunctionError" in state.message and "failed 3 calls in a row" in state.message
    (run,) = runs_named(work, "loop-fails")
    assert run.info.status == "FAILED"
    assert "reward.functions[0]" in run.data.tags["error"] and "ValueError: cannot score this" in run.data.tags["error"]
    worker = flow_task_runs(state.state_details.flow_run_id)["rollout-worker-0"]
    assert worker.state.type == StateType.FAILED and worker.run_count == 1
    assert "cannot score this" in worker.state.message
    assert not alive_actors()


def test_resuming_a_finished_run_says_so_and_starts_nothing(straight_run, work, capsys):
    """A run that already reached trainer.total_steps, resumed from its MLflow run id through the CLI or from its
    checkpoint directory through the flow: it says so and stops before anything starts (nothing downloaded, no
    MLflow run, no run directory, no Failed flow run, no traceback)."""
    cfg, straight, _ = straight_run
    result = straight.result()
    before = sorted(p.name for p in (work / "finished").glob("*")) if (work / "finished").exists() else []
    runs_before = len(runs_named(work, "finished"))
    base = ["train", "--config", str(REPO / "configs" / "tiny.yaml"), "--set", *overrides(work, "finished")]
    assert cli_main([*base, "--resume-from", result["mlflow_run_id"]]) == 0
    captured = capsys.readouterr()
    assert "nothing to train" in captured.err and "trainer.total_steps=6" in captured.err
    assert "Traceback" not in captured.out + captured.err
    state = train(config=config(work, "finished"), resume_from=result["checkpoint"], return_state=True)
    assert state.is_completed()
    assert "nothing to train" in state.result()["nothing_to_train"]
    assert len(runs_named(work, "finished")) == runs_before
    after = sorted(p.name for p in (work / "finished").glob("*")) if (work / "finished").exists() else []
    assert after == before  # no run directory, no download


def test_a_run_that_fails_before_producing_anything_does_not_move_latest(straight_run, work):
    """`<output_dir>/latest` points to the newest run that produced something: a run refused for resources after
    claiming its directory leaves it where it was."""
    cfg, straight, _ = straight_run
    latest = work / "straight" / "latest"
    assert latest.resolve() == Path(straight.result()["run_dir"]).resolve()
    refused = config(work, "straight", "cluster.resources.rollout.CPU=64", "tracking.run_name=refused")
    state = train(config=refused, return_state=True)
    assert state.is_failed() and "not enough resources" in state.message
    assert latest.resolve() == Path(straight.result()["run_dir"]).resolve()


def test_a_slow_checkpoint_upload_runs_beside_the_supervision_one_at_a_time_in_order(prefect_api, work, monkeypatch):
    """Each checkpoint the trainer writes is logged to MLflow by a record-checkpoint task run beside the supervision:
    polls go on while an upload is in progress (a large model's upload must not hold them up), the uploads run one
    at a time in step order, and every one is in MLflow when the run ends."""
    import flows.train as flow_train
    import tasks.checkpoints as checkpoint_tasks

    log_checkpoint, record = checkpoint_tasks.tracking.log_checkpoint, flow_train._record
    uploads, polls = [], []

    def slow_upload(tracker, path):
        began = time.monotonic()
        time.sleep(1.0)
        out = log_checkpoint(tracker, path)
        uploads.append((Path(path).name, began, time.monotonic()))
        return out

    monkeypatch.setattr(checkpoint_tasks.tracking, "log_checkpoint", slow_upload)
    monkeypatch.setattr(flow_train, "_record", lambda run, poll: (polls.append(time.monotonic()), record(run, poll)))
    cfg = config(work, "slow-upload", "cluster.host=threads", "checkpoint.every=2", "eval.every=0")
    state = train(config=cfg, return_state=True)
    assert state.is_completed(), state.message
    names = [name for name, _, _ in uploads]
    assert names[:3] == ["step_000002", "step_000004", "step_000006"], names  # then the final save's
    assert all(later >= ended for (_, _, ended), (_, later, _) in zip(uploads, uploads[1:]))  # one at a time
    assert any(began < t < ended for _, began, ended in uploads[:2] for t in polls), (uploads, polls)
    (run,) = runs_named(work, "slow-upload")
    logged = {f.path for f in mlflow_client(work).list_artifacts(run.info.run_id, "checkpoints")}
    assert {f"checkpoints/{n}" for n in names} <= logged, logged


def test_a_failed_checkpoint_upload_fails_the_run_naming_it_and_the_later_ones_do_not_run(
    prefect_api, work, monkeypatch
):
    """The upload of step 2's checkpoint raises: the run fails with that error (not with a later upload's), it does
    not hang on the uploads chained after it, and nothing after the failed one is uploaded."""
    import tasks.checkpoints as checkpoint_tasks

    log_checkpoint, uploaded = checkpoint_tasks.tracking.log_checkpoint, []

    def failing_upload(tracker, path):
        if Path(path).name == "step_000002":
            raise OSError("the artifact store is full")
        uploaded.append(Path(path).name)
        return log_checkpoint(tracker, path)

    monkeypatch.setattr(checkpoint_tasks.tracking, "log_checkpoint", failing_upload)
    cfg = config(work, "failed-upload", "cluster.host=threads", "checkpoint.every=2", "eval.every=0")
    state = train(config=cfg, return_state=True)
    assert state.is_failed() and "the artifact store is full" in state.message, state.message
    assert uploaded == [], uploaded
