"""A run's lifecycle (flows/lifecycle.py): what it holds is released however the flow body leaves, signals
during cleanup are held until it is done, the CLI's interrupts are never lost, the SIGTERM guard; and the
temporary Prefect API dies with the CLI even when the CLI is killed outright (SIGKILL)."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from flows.lifecycle import RunResources, sigterm_kept
from rlhf_core.config import load_config
from tracking import MlflowTracker

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def store(_mlflow_db_template, tmp_path_factory) -> Path:
    """One SQLite store for the module; each test uses its own experiment."""
    import shutil

    return Path(shutil.copyfile(_mlflow_db_template, tmp_path_factory.mktemp("mlflow") / "mlflow.db"))


def tracking_cfg(store: Path, experiment: str):
    return load_config(
        None,
        [
            f"tracking.tracking_uri=sqlite:///{store}",
            f"tracking.experiment={experiment}",
            "tracking.log_system_metrics=false",
        ],
    )


def _status(tracker: MlflowTracker) -> str:
    return tracker.client.get_run(tracker.run_id).info.status


def test_the_flow_cleanup_ends_a_run_a_task_handed_over_before_returning(store):
    """A signal between the task creating the MLflow run and the task returning it (Prefect records the task's
    state in between): the run was handed to RunResources when it was created, which ends it KILLED."""
    resources = RunResources(logging.getLogger("test"))
    with pytest.raises(KeyboardInterrupt):
        with resources:
            MlflowTracker.start(tracking_cfg(store, "handover"), flow_run_id="flow-b", hold=resources.hold)
            raise KeyboardInterrupt  # before the flow saw the task's result
    assert _status(resources.tracker) == "KILLED"


def test_an_error_raised_while_a_termination_signal_was_handled_ends_the_run_killed(store):
    """A worker's cancellation SIGTERM that lands while Prefect creates a task run comes out of its task engine as
    "ValueError: Task run is not set", raised while handling the TerminationSignal: the run was cancelled, not
    failed, so the MLflow run ends KILLED."""
    from prefect.exceptions import TerminationSignal

    resources = RunResources(logging.getLogger("test"))
    with pytest.raises(ValueError, match="Task run is not set"):
        with resources:
            MlflowTracker.start(tracking_cfg(store, "cancelled-mid-task"), flow_run_id="flow-d", hold=resources.hold)
            try:
                raise TerminationSignal(signal=15)
            except TerminationSignal:
                raise ValueError("Task run is not set")  # noqa: B904 - as Prefect's handle_crash raises it
    assert _status(resources.tracker) == "KILLED"


def test_a_signal_during_failure_cleanup_still_ends_everything_and_is_raised_again(store):
    """Ctrl-C reaches the whole process group: the flow may be leaving on an error the same signal caused in
    a child, with its own interrupt landing in the cleanup. Every step still runs, the run ends KILLED (it
    was interrupted, not a failure of its own) and the interrupt goes on to the caller."""
    tracker = MlflowTracker.start(tracking_cfg(store, "cleanup-interrupted"), flow_run_id="flow-c")

    class SignalOnFirstLog:
        calls = 0

        def error(self, *args):
            SignalOnFirstLog.calls += 1
            if SignalOnFirstLog.calls == 1:
                raise KeyboardInterrupt

        warning = error

    resources = RunResources(SignalOnFirstLog())
    resources.tracker = tracker
    with pytest.raises(KeyboardInterrupt) as raised:
        with resources:
            raise RuntimeError("a rollout worker died")
    assert isinstance(raised.value.__cause__, RuntimeError)
    assert _status(tracker) == "KILLED"


class _SignalsItself:
    """A logger whose error / warning sends the main thread `count` SIGINTs the first time it is called.

    raise_signal, not os.kill(getpid()): a signal raised in the main thread reaches its Python handler before
    raise_signal returns, where a process-directed one may be taken by any thread and handled a little later."""

    def __init__(self, count: int = 1):
        self.count, self.calls = count, 0

    def error(self, *args):
        import signal

        self.calls += 1
        if self.calls == 1:
            for _ in range(self.count):
                signal.raise_signal(signal.SIGINT)

    warning = error


def test_a_real_signal_during_failure_cleanup_is_held_until_cleanup_is_done(store):
    """SIGINT while cleanup runs: it is recorded, not raised, so no step is cut short; the run ends KILLED;
    then it reaches the handler it would have reached (Python's: KeyboardInterrupt), which is back in place.

    Python's own handler is put in place for the test: a process started in the background by a shell
    without job control (`make test &` in a script) inherits SIGINT ignored, and there the re-raised signal
    rightly goes nowhere."""
    import signal

    inherited = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        before = signal.getsignal(signal.SIGINT)
        tracker = MlflowTracker.start(tracking_cfg(store, "real-signal"), flow_run_id="flow-d")
        resources = RunResources(_SignalsItself())
        resources.tracker = tracker
        with pytest.raises(KeyboardInterrupt):
            with resources:
                raise RuntimeError("a rollout worker died")
        assert _status(tracker) == "KILLED"
        assert signal.getsignal(signal.SIGINT) is before
    finally:
        signal.signal(signal.SIGINT, inherited)


def test_a_signal_while_a_finished_run_cleans_up_leaves_it_finished(store):
    tracker = MlflowTracker.start(tracking_cfg(store, "finished-signal"), flow_run_id="flow-e")

    resources = RunResources(_SignalsItself())
    resources.tracker = tracker
    original_end = tracker.end

    def end_with_a_signal(status):
        resources.logger.error("ending")  # sends SIGINT while the run is being ended
        original_end(status)

    tracker.end = end_with_a_signal
    with resources:
        resources.status = "FINISHED"
    assert _status(tracker) == "FINISHED"  # the work finished; the signal came after it


def test_signals_that_keep_coming_stop_the_cleanup(store):
    """A third signal during cleanup stops waiting for it (a hung teardown can still be left with Ctrl-C)."""
    import signal

    before = signal.getsignal(signal.SIGINT)
    tracker = MlflowTracker.start(tracking_cfg(store, "forced"), flow_run_id="flow-f")
    resources = RunResources(_SignalsItself(count=RunResources.FORCE_AFTER))
    resources.tracker = tracker
    with pytest.raises(KeyboardInterrupt, match="stopped waiting"):
        with resources:
            raise RuntimeError("a rollout worker died")
    assert signal.getsignal(signal.SIGINT) is before
    tracker.end("KILLED")


def test_an_interrupt_a_finalizer_swallowed_is_raised_again_by_the_loop():
    """Python drops a KeyboardInterrupt raised inside a finalizer ("Exception ignored in ..."): the CLI's handler
    records the signal, and the supervising loop's `raise_if_pending` raises it at its next tick."""
    import gc

    from flows import lifecycle

    lifecycle.clear_pending()

    class Finalized:
        def __del__(self):
            lifecycle.cli_handler(signal.SIGINT, None)  # as if Ctrl-C landed while this finalizer ran

    Finalized()
    gc.collect()  # the KeyboardInterrupt raised in __del__ was printed and dropped: we are still here
    with pytest.raises(KeyboardInterrupt, match="lost in a finalizer"):
        lifecycle.raise_if_pending()
    lifecycle.clear_pending()
    lifecycle.raise_if_pending()  # nothing pending: no raise


def test_a_flow_run_failed_by_a_signal_inside_a_c_call_counts_as_interrupted():
    """A KeyboardInterrupt raised inside a C call (Ray's CoreWorker.wait) surfaces as "SystemError: ... returned a
    result with an exception set", chained from it, and fails the flow run: `raise_if_signalled` makes that the
    CLI's interrupt (exit 130), whether the signal was recorded or only chained; other outcomes pass through."""
    from prefect.states import Completed, Failed

    from flows import lifecycle

    def failed_inside_wait() -> SystemError:
        try:
            try:
                raise KeyboardInterrupt("signal 15")
            except KeyboardInterrupt as interrupt:
                raise SystemError("<cyfunction CoreWorker.wait> returned a result with an exception set") from interrupt
        except SystemError as exc:
            return exc

    lifecycle.clear_pending()
    with pytest.raises(KeyboardInterrupt, match=r"signal \? \(the flow run failed with it\)"):
        lifecycle.raise_if_signalled(Failed(data=failed_inside_wait()))
    plain = Failed(data=RuntimeError("trainer failed"))
    assert lifecycle.raise_if_signalled(plain) is plain  # a failure of its own stays the run's failure
    table = Failed(data={"rows": []})  # a failed sweep carries its table
    assert lifecycle.raise_if_signalled(table) is table
    with pytest.raises(KeyboardInterrupt):
        lifecycle.cli_handler(signal.SIGTERM, None)
    with pytest.raises(KeyboardInterrupt, match="signal 15"):
        lifecycle.raise_if_signalled(plain)  # the CLI got a signal: the failure is the signal's
    done = Completed(data={"ok": 1})
    assert lifecycle.raise_if_signalled(done) is done
    lifecycle.clear_pending()


def test_the_sigterm_guard_puts_back_the_handler_ray_replaces():
    def flows_handler(signum, frame):
        pass

    before = signal.signal(signal.SIGTERM, flows_handler)
    try:
        with sigterm_kept():
            signal.signal(signal.SIGTERM, lambda *a: sys.exit(0))  # what ray.init does
        assert signal.getsignal(signal.SIGTERM) is flows_handler
    finally:
        signal.signal(signal.SIGTERM, before)


def test_a_run_holds_one_of_each_kind():
    class Runtime:
        def teardown(self, failed=False):
            pass

    resources = RunResources(logging.getLogger("test"))
    runtime = Runtime()
    assert resources.hold(runtime) is runtime and resources.runtime is runtime
    resources.hold(runtime)  # the same one again is fine
    with pytest.raises(RuntimeError, match="already holds a runtime"):
        resources.hold(Runtime())
    with pytest.raises(TypeError, match="not int"):
        resources.hold(3)


@pytest.mark.slow
def test_the_temporary_prefect_api_dies_with_a_killed_cli(tmp_path, prefect_home_template):
    """`atrlhf train` killed outright (SIGKILL, as the OOM killer does: no handler, no cleanup runs): the temporary
    Prefect API it started, and everything under it, is gone within 30 s."""
    import shutil

    shutil.copytree(prefect_home_template, tmp_path / "prefect")
    env = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"}
    env.update({"PREFECT_HOME": str(tmp_path / "prefect"), "PYTHONUNBUFFERED": "1"})
    cmd = [
        str(Path(sys.executable).parent / "atrlhf"),
        "train",
        "--set",
        f"run.output_dir={tmp_path / 'run'}",
        f"tracking.tracking_uri=sqlite:///{tmp_path / 'mlflow.db'}",
        "trainer.total_steps=100000",
        "model.preset=micro",
        "data.eval_size=20",
        "cluster.num_cpus=2",
    ]
    log_path = tmp_path / "train.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 300
        while "run directory" not in log_path.read_text(errors="replace"):  # the flow runs: the API answers
            assert proc.poll() is None and time.monotonic() < deadline, log_path.read_text(errors="replace")[-3000:]
            time.sleep(0.5)
        servers = [p for p in psutil.Process(proc.pid).children() if "flows.local_api" in " ".join(p.cmdline())]
        assert len(servers) == 1, [p.cmdline() for p in psutil.Process(proc.pid).children()]
        under = [servers[0], *servers[0].children(recursive=True)]
        proc.kill()
        proc.wait(timeout=30)
        _, alive = psutil.wait_procs(under, timeout=30)
        assert not alive, f"left running 30 s after the CLI was killed: {[(p.pid, p.cmdline()) for p in alive]}"
    finally:
        if proc.poll() is None:
            proc.kill()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # Ray's processes, if any outlived the driver
