"""What a user sees in MLflow 3: the experiment opens on its runs, the run is named after the flow run, and
the policy shows under the run's logged models and loads back. A SQLite store in tmp_path; no server."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("mlflow")

from rlhf_core.config import load_config  # noqa: E402
from tracking import (  # noqa: E402
    EXPERIMENT_KIND,
    EXPERIMENT_KIND_TAG,
    LOGGED_MODEL_NAME,
    MODEL_ARTIFACT_PATH,
    MlflowTracker,
    load_logged_policy,
    log_checkpoint,
)
from tracking.artifacts import log_model  # noqa: E402


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> Path:
    """One SQLite store for the module (creating one takes seconds); each test uses its own experiment."""
    return tmp_path_factory.mktemp("mlflow") / "mlflow.db"


def tracking_cfg(store: Path, experiment: str, *overrides):
    return load_config(
        None,
        [
            f"tracking.tracking_uri=sqlite:///{store}",
            f"tracking.experiment={experiment}",
            "tracking.log_system_metrics=false",
            *overrides,
        ],
    )


def test_experiment_is_tagged_for_model_training_and_run_takes_the_flow_run_name(store):
    cfg = tracking_cfg(store, "named")
    tracker = MlflowTracker.start(cfg, flow_run_id="abc", run_name="crimson-otter")
    try:
        exp = tracker.client.get_experiment(tracker.experiment_id)
        assert exp.tags[EXPERIMENT_KIND_TAG] == EXPERIMENT_KIND == "custom_model_development"
        assert tracker.client.get_run(tracker.run_id).info.run_name == "crimson-otter"
    finally:
        tracker.end("FINISHED")
    # an explicit tracking.run_name wins over the flow run's name
    named = MlflowTracker.start(tracking_cfg(store, "named", "tracking.run_name=mine"), run_name="crimson-otter")
    named.end("FINISHED")
    assert named.client.get_run(named.run_id).info.run_name == "mine"


def test_an_existing_untagged_experiment_gets_the_tag_but_a_chosen_kind_stays(store):
    cfg = tracking_cfg(store, "old")
    from tracking import client as mlflow_client
    from tracking import resolve_tracking_uri

    client = mlflow_client(resolve_tracking_uri(cfg))
    client.create_experiment("old")
    client.create_experiment("genai", tags={EXPERIMENT_KIND_TAG: "genai_development"})
    tracker = MlflowTracker.start(cfg)
    tracker.end("FINISHED")
    assert client.get_experiment_by_name("old").tags[EXPERIMENT_KIND_TAG] == EXPERIMENT_KIND
    other = MlflowTracker.start(tracking_cfg(store, "genai"))
    other.end("FINISHED")
    assert client.get_experiment_by_name("genai").tags[EXPERIMENT_KIND_TAG] == "genai_development"


def test_the_policy_is_a_logged_model_of_the_run_and_loads_back(store, tmp_path, tiny_policy_dir):
    cfg = tracking_cfg(store, "model")
    tracker = MlflowTracker.start(cfg)
    uri = log_model(tracker, tiny_policy_dir, step=6)
    tracker.end("FINISHED")
    client = tracker.client
    run = client.get_run(tracker.run_id)
    assert uri == f"models:/{run.data.tags['model.id']}"
    assert not client.list_artifacts(tracker.run_id, MODEL_ARTIFACT_PATH)  # stored once: no model/ copy
    # the run's "Logged models": an output of the run, READY, with the policy's files as its artifacts
    outputs = run.outputs.model_outputs
    assert [o.model_id for o in outputs] == [run.data.tags["model.id"]] and outputs[0].step == 6
    model = client.get_logged_model(run.data.tags["model.id"])
    assert model.name == LOGGED_MODEL_NAME and model.source_run_id == tracker.run_id
    assert str(model.status) in ("READY", "LoggedModelStatus.READY")
    found = client.search_logged_models([tracker.experiment_id], filter_string=f"source_run_id = '{tracker.run_id}'")
    assert [m.model_id for m in found] == [model.model_id]
    import mlflow.artifacts

    local = mlflow.artifacts.download_artifacts(artifact_uri=model.artifact_location, dst_path=str(tmp_path / "lm"))
    files = {p.name for p in Path(local).iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= files
    # ... and load_logged_policy(run_id) still loads it
    loaded, tokenizer = load_logged_policy(tracker.run_id, tracking_uri=cfg.tracking.tracking_uri)
    assert loaded.config.model_type == "llama" and tokenizer.eos_token_id is not None


def test_a_run_of_an_earlier_version_with_a_model_artifact_still_loads(store, tiny_policy_dir):
    """Runs logged before the LoggedModel existed hold the policy under model/ only: load_logged_policy reads it."""
    cfg = tracking_cfg(store, "older")
    tracker = MlflowTracker.start(cfg)
    tracker.client.log_artifacts(tracker.run_id, str(tiny_policy_dir), MODEL_ARTIFACT_PATH)
    tracker.end("FINISHED")
    assert "model.id" not in tracker.client.get_run(tracker.run_id).data.tags
    loaded, _ = load_logged_policy(tracker.run_id, tracking_uri=cfg.tracking.tracking_uri)
    assert loaded.config.model_type == "llama"


def test_a_half_uploaded_checkpoint_is_skipped_and_a_dead_parent_is_marked(store, tmp_path):
    """kill -9 during an upload leaves a checkpoint without its COMPLETE marker and the run RUNNING: resume
    takes the newest complete checkpoint, and the new run names its parent, which is marked FAILED."""
    from tracking import RESUMED_FROM_RUN, RESUMED_FROM_STEP, latest_checkpoint_artifact

    cfg = tracking_cfg(store, "lineage")
    parent = MlflowTracker.start(cfg)
    for step in (2, 4):
        ckpt = tmp_path / f"step_{step:06d}"
        ckpt.mkdir()
        (ckpt / "state.pt").write_bytes(b"x" * 10)
        if step == 2:
            log_checkpoint(parent, ckpt)
        else:  # the upload a killed driver left behind: files, but no COMPLETE marker
            parent.client.log_artifacts(parent.run_id, str(ckpt), f"checkpoints/{ckpt.name}")
    uri = f"sqlite:///{store}"
    assert latest_checkpoint_artifact(parent.run_id, uri) == "checkpoints/step_000002"
    assert parent.client.get_run(parent.run_id).info.status == "RUNNING"  # its driver never ended it

    child = MlflowTracker.start(cfg, resume_run_id=parent.run_id, resume_step=2)
    assert child.run_id != parent.run_id
    tags = child.client.get_run(child.run_id).data.tags
    assert tags[RESUMED_FROM_RUN] == parent.run_id and tags[RESUMED_FROM_STEP] == "2"
    old = child.client.get_run(parent.run_id)
    assert old.info.status == "FAILED" and "driver" in old.data.tags["atrlhf.ended"]

    parent.log_metrics([{"step": s, "reward/mean": s / 10} for s in (1, 2, 3)])  # step 3 was never kept
    child.log_metrics([{"step": s, "reward/mean": s / 10} for s in (3, 4)])
    history, _ = child.lineage_history()
    assert [row["step"] for row in history] == [1, 2]
    child.end("FINISHED")


def test_a_signal_while_the_run_is_being_opened_ends_it_killed(store, monkeypatch):
    """Ctrl-C after MLflow created the run but before `start` returned: the run ends KILLED, not RUNNING."""
    from mlflow.tracking import MlflowClient

    def interrupted(self, cfg, exclude=()):
        raise KeyboardInterrupt

    monkeypatch.setattr(MlflowTracker, "log_params", interrupted)
    cfg = tracking_cfg(store, "interrupted-start")
    held = []
    with pytest.raises(KeyboardInterrupt):
        MlflowTracker.start(cfg, flow_run_id="flow-a", hold=held.append)
    client = MlflowClient(f"sqlite:///{store}")
    [run] = client.search_runs([client.get_experiment_by_name("interrupted-start").experiment_id])
    assert run.info.status == "KILLED"
    assert [t.run_id for t in held] == [run.info.run_id]  # handed over as soon as it existed


def _write_checkpoint(root: Path, step: int) -> Path:
    """A stand-in checkpoint where the layout puts step `step` (files, not weights: pruning reads no weights)."""
    from rlhf_core.run.checkpoint import checkpoint_dir

    ckpt = checkpoint_dir(root.parent, step, under=root)
    ckpt.mkdir(parents=True)
    (ckpt / "state.pt").write_bytes(b"x" * 10)
    (ckpt / "meta.json").write_text(f'{{"step": {step}}}')
    return ckpt


def test_keep_checkpoints_bounds_disk_and_mlflow_and_resume_still_finds_a_complete_one(store, tmp_path):
    """checkpoint.keep=2, checkpoints recorded at steps 2, 4, 6, 8 as the flow records them (log, then
    prune up to the step just recorded): the two newest stay on disk and in MLflow, a newer one the trainer
    already wrote is left for its own turn, a newer upload without its marker is not taken for a checkpoint,
    and resume by run id downloads the newest complete one."""
    from rlhf_core.run.checkpoint import prune_checkpoints
    from tracking import download_artifact, latest_checkpoint_artifact, prune_checkpoint_artifacts

    assert load_config(None, []).checkpoint.keep == 3  # the default: a few
    tracker = MlflowTracker.start(tracking_cfg(store, "retention", "checkpoint.keep=2"))
    assert tracker.keep_checkpoints == 2
    root = tmp_path / "run" / "checkpoints"
    (root / "step_000010.tmp").mkdir(parents=True)  # a checkpoint being written: never touched
    (root / "step_000001").mkdir()  # not a checkpoint (no meta.json): not ours to delete
    for step in (2, 4, 6, 8):
        ckpt = _write_checkpoint(root, step)
        if step == 8:
            _write_checkpoint(root, 10)  # the trainer wrote step 10 before the flow recorded step 8
        log_checkpoint(tracker, ckpt)
        prune_checkpoints(root, tracker.keep_checkpoints, newest_step=step)
        prune_checkpoint_artifacts(tracker, tracker.keep_checkpoints)
    kept = ["step_000001", "step_000006", "step_000008", "step_000010", "step_000010.tmp"]
    assert sorted(p.name for p in root.iterdir()) == kept
    listed = sorted(a.path for a in tracker.client.list_artifacts(tracker.run_id, "checkpoints"))
    assert listed == ["checkpoints/step_000006", "checkpoints/step_000008"]
    on_disk = Path(tracker.client.get_run(tracker.run_id).info.artifact_uri.removeprefix("file://")) / "checkpoints"
    assert sorted(p.name for p in on_disk.iterdir()) == ["step_000006", "step_000008"]  # deleted, not just hidden

    # an upload a killed driver left half done (no COMPLETE marker) is neither resumed from nor counted
    tracker.client.log_artifacts(
        tracker.run_id, str(_write_checkpoint(tmp_path / "half", 12)), "checkpoints/step_000012"
    )
    assert prune_checkpoint_artifacts(tracker, 2) == []
    uri = f"sqlite:///{store}"
    assert latest_checkpoint_artifact(tracker.run_id, uri) == "checkpoints/step_000008"
    got = download_artifact(tracker.run_id, "checkpoints/step_000008", uri, tmp_path / "resume")
    assert (got / "state.pt").read_bytes() == b"x" * 10
    # keep=1 keeps the newest complete one only; 0 keeps everything
    assert prune_checkpoint_artifacts(tracker, 0) == [] and prune_checkpoints(root, 0) == []
    assert prune_checkpoint_artifacts(tracker, 1) == ["checkpoints/step_000006"]
    assert latest_checkpoint_artifact(tracker.run_id, uri) == "checkpoints/step_000008"
    assert [p.name for p in prune_checkpoints(root, 1)] == ["step_000006", "step_000008"]
    tracker.end("FINISHED")


def test_what_the_mlflow_ui_shows_reads(store):
    """A sweep's child lists no per-run params (run.name, run.output_dir, tracking.run_name: tags instead), a run
    carries `resumed_from` only when it resumed, and a constant learning rate of 3e-4 also goes as
    policy/lr_micro = 300 (MLflow draws a constant series on value ± 1: 3e-4 reads as a flat 0)."""
    from tracking.plots import log_plots

    parent = MlflowTracker.start(tracking_cfg(store, "ui"), tags={"resumed_from": ""})
    cfg = tracking_cfg(store, "ui", "run.name=point-a", "run.output_dir=/tmp/sweep-x/point-a", "tracking.run_name=x/a")
    child = MlflowTracker.start(cfg, tags={"resumed_from": "", "atrlhf.sweep_point": "a"}, parent_run_id=parent.run_id)
    run = child.client.get_run(child.run_id)
    for key in ("run.name", "run.output_dir", "tracking.run_name"):
        assert key not in run.data.params and key in parent.client.get_run(parent.run_id).data.params
    assert run.data.tags["run.output_dir"] == "/tmp/sweep-x/point-a" and run.data.tags["run.name"] == "point-a"
    assert run.data.params["trainer.lr"] == "0.0003"
    assert "resumed_from" not in run.data.tags and run.data.tags["atrlhf.sweep_point"] == "a"
    resumed = MlflowTracker.start(tracking_cfg(store, "ui"), tags={"resumed_from": parent.run_id})
    assert resumed.client.get_run(resumed.run_id).data.tags["resumed_from"] == parent.run_id

    child.log_metrics([{"step": s, "policy/lr": 3e-4, "reward/mean": s / 4} for s in (1, 2)])
    assert [m.value for m in child.metric_history("policy/lr")] == [3e-4, 3e-4]
    assert [m.value for m in child.metric_history("policy/lr_micro")] == pytest.approx([300.0, 300.0])
    # the reward curve comes back as a PNG for the run's summary artifact
    plots = log_plots(child, [{"step": 1, "reward/mean": 0.25}, {"step": 2, "reward/mean": 0.5}], {0: 8}, [])
    assert plots.reward_curve_png[:8] == b"\x89PNG\r\n\x1a\n" and "](data:image/png;base64," in plots.markdown
    assert "plots/reward_curve.png" in plots.artifacts
    for tracker in (parent, child, resumed):
        tracker.end("FINISHED")


def test_the_mlflow_links_follow_where_the_ui_answers(monkeypatch):
    """The run's link (Prefect summary, link artifact) and the UI command follow $ATRLHF_MLFLOW_UI_URL, else a
    tracking server's URL, else `mlflow ui`'s default port 5000."""
    from tracking.runs import UI_URL_ENV, run_url, ui_command

    local = "sqlite:////tmp/x/mlflow.db"
    monkeypatch.delenv(UI_URL_ENV, raising=False)
    assert run_url(local, "1", "abc") == "http://127.0.0.1:5000/#/experiments/1/runs/abc"
    assert ui_command(local).endswith(f"ui --backend-store-uri {local} --host 127.0.0.1 --port 5000")
    assert run_url("http://mlflow:8080/", "1", "abc") == "http://mlflow:8080/#/experiments/1/runs/abc"
    monkeypatch.setenv(UI_URL_ENV, "http://127.0.0.1:5055/")
    assert run_url(local, "2", "def") == "http://127.0.0.1:5055/#/experiments/2/runs/def"
    assert ui_command(local).endswith("--host 127.0.0.1 --port 5055")


def test_each_checkpoint_is_one_short_line_retention_included(store, tmp_path, monkeypatch):
    """What the terminal shows of checkpoint bookkeeping (tasks/checkpoints.record_checkpoint, as the flow records
    the trainer's checkpoints): one line per checkpoint, naming its step and what retention deleted, without the
    run directory's path (said once at the start); the details at DEBUG."""
    import logging

    import tasks.checkpoints as checkpoints

    logger = logging.getLogger("test-checkpoint-lines")
    logger.setLevel(logging.DEBUG)
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append
    logger.addHandler(handler)
    monkeypatch.setattr(checkpoints, "get_run_logger", lambda: logger)
    tracker = MlflowTracker.start(tracking_cfg(store, "checkpoint-lines", "checkpoint.keep=2"))
    root = tmp_path / "runs" / "tiny" / "20261204-000000-a-run" / "checkpoints"
    try:
        for step in (2, 4, 6):
            checkpoints.record_checkpoint.fn(tracker, str(_write_checkpoint(root, step)), step)
    finally:
        logger.removeHandler(handler)
    tracker.end("FINISHED")
    lines = [r.getMessage() for r in records if r.levelno >= logging.INFO]
    assert lines == [
        "checkpoint at step 2: step_000002 (also in MLflow)",
        "checkpoint at step 4: step_000004 (also in MLflow)",
        "checkpoint at step 6: step_000006 (also in MLflow); older ones deleted (checkpoint.keep=2): step_000002",
    ]
    assert sorted(p.name for p in root.iterdir()) == ["step_000004", "step_000006"]
    assert str(root) in records[-1].getMessage() and records[-1].levelno == logging.DEBUG


def test_a_signal_during_an_mlflow_write_lands_after_it():
    """SIGTERM in the middle of a client call is held until the call returns, then handled as usual."""
    import os
    import signal
    import threading
    import time

    from tracking.uninterrupted import Uninterrupted

    order: list[str] = []

    class Store:
        def write(self) -> str:
            order.append("write started")
            time.sleep(0.3)  # the signal arrives here
            order.append("write done")
            return "ok"

    previous = signal.signal(signal.SIGTERM, lambda signum, frame: order.append("handled"))
    try:
        threading.Timer(0.1, os.kill, (os.getpid(), signal.SIGTERM)).start()
        assert Uninterrupted(Store()).write() == "ok"
        time.sleep(0.05)
        assert order == ["write started", "write done", "handled"]
        assert signal.getsignal(signal.SIGTERM) is not None and order.count("handled") == 1
    finally:
        signal.signal(signal.SIGTERM, previous)


def test_per_poll_metrics_are_written_in_the_background_and_a_failed_write_surfaces_at_the_next_call(store):
    """log_metrics(wait=False), the supervision's per-poll metrics: the call returns before they are written (in
    order, on the run's writer thread), every point is in the run once it ends, and a write that failed raises at
    the next call (one poll late)."""
    tracker = MlflowTracker.start(tracking_cfg(store, "async-metrics"))
    rows = [{"step": s, "loss": 0.5 / s, "reward/mean": s / 100} for s in range(1, 1201)]  # 3 calls of <= 1000
    assert tracker.log_metrics(rows, wait=False) == 2400
    assert tracker.log_metrics([{"step": 1201, "loss": 0.1}], wait=False) == 1
    assert 1 <= len(tracker.in_flight) <= 2  # queued, the first perhaps written already
    assert [m.step for m in tracker.metric_history("loss")] == list(range(1, 1202))  # reading waits for them
    tracker.log_metrics([{"step": 1202, "loss": 0.1}], wait=False)
    tracker.end("FINISHED")
    assert not tracker.in_flight and tracker.writer is None
    assert tracker.client.get_metric_history(tracker.run_id, "loss")[-1].step == 1202  # end() waited

    failing = MlflowTracker.start(tracking_cfg(store, "async-metrics"))
    failing.client.delete_run(failing.run_id)  # MLflow refuses writes to a deleted run
    failing.log_metrics([{"step": 1, "loss": 1.0}], wait=False)  # queued
    with pytest.raises(Exception, match="deleted"):
        failing.flush()
    failing.log_metrics([{"step": 2, "loss": 1.0}], wait=False)
    failing.in_flight[0].exception()  # let it end (it fails)
    with pytest.raises(Exception, match="deleted"):
        failing.log_metrics([{"step": 3, "loss": 1.0}], wait=False)  # the failed write surfaces here
