"""A run's lifecycle in one place: what it holds and how that is released, and what signals do meanwhile.

- `RunResources`: the flow's one cleanup mechanism. Whatever a run acquires (the Ray runtime, the MLflow run,
  its directory) is handed to it the moment it exists (`hold`), and released when the flow body leaves, however
  it leaves (success, failure, Ctrl-C, a worker's cancellation SIGTERM); the MLflow run ends FINISHED, FAILED or
  KILLED to match the flow run.
- Signal deferral: while cleanup runs, SIGINT / SIGTERM are recorded instead of raised (`RunResources`).
- The SIGTERM guard (`sigterm_kept`): `ray.init` replaces the SIGTERM handler with `sys.exit`; the guard puts back
  the one the flow had (Prefect's, which turns a worker's cancellation SIGTERM into TerminationSignal).
- The CLI's interrupts (`cli_signals`, `raise_if_pending`): `atrlhf train` / `sweep` turn SIGINT and SIGTERM into
  KeyboardInterrupt and also record them, because Python drops a KeyboardInterrupt raised inside a finalizer
  (a weakref callback or `__del__`: sqlalchemy's, inside MLflow's client, during a checkpoint) after printing
  "Exception ignored in ..."; the supervising loop raises a recorded one at its next tick. Under a Prefect
  worker nothing is recorded: Prefect handles its SIGTERM itself.
- `shared_ray`: a sweep joins Ray once for all its runs.

The temporary Prefect API the CLI starts (and that dies with it, even by SIGKILL) is `flows.local_api`.
"""

from __future__ import annotations

import contextlib
import math
import signal
import threading
from collections.abc import Iterator
from typing import Any

from prefect.exceptions import TerminationSignal

from rlhf_core.config import TrainConfig

# ------------------------------------------------------------------------------------- the CLI's signals
_pending: list[int] = []


def cli_handler(signum, frame) -> None:
    """SIGINT / SIGTERM handler of `atrlhf train` / `sweep`: record the signal, raise KeyboardInterrupt."""
    _pending.append(signum)
    raise KeyboardInterrupt(f"signal {signum}")


def raise_if_pending() -> None:
    """Raise KeyboardInterrupt if the CLI received a signal whose own KeyboardInterrupt was dropped."""
    if _pending:
        raise KeyboardInterrupt(f"signal {_pending[0]} (its first KeyboardInterrupt was lost in a finalizer)")


def raise_if_signalled(state):
    """The flow run's `state`, unless it failed because the CLI got a signal: then KeyboardInterrupt. A
    KeyboardInterrupt raised inside a C call (Ray's CoreWorker.wait) can leave it as another error ("SystemError:
    ... returned a result with an exception set", chained from it), which fails the flow run instead."""
    if not state.is_failed():
        return state
    result = state.result(raise_on_failure=False)
    if _pending or (isinstance(result, BaseException) and _caused_by_interrupt(result)):
        raise KeyboardInterrupt(f"signal {_pending[0] if _pending else '?'} (the flow run failed with it)")
    return state


def clear_pending() -> None:
    """Forget recorded signals (a new command in the same process)."""
    _pending.clear()


@contextlib.contextmanager
def cli_signals() -> Iterator[None]:
    """`cli_handler` for SIGINT and SIGTERM for the block (a CLI command), nothing pending before or after it (a
    flow run later in this process, a test or a notebook, starts with none); the previous handlers are back on
    exit."""
    clear_pending()
    previous = {sig: signal.signal(sig, cli_handler) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)
        clear_pending()


# ------------------------------------------------------------------------------------ the SIGTERM guard
@contextlib.contextmanager
def sigterm_kept() -> Iterator[None]:
    """Put back the SIGTERM handler the block found (`ray.init` replaces it with `sys.exit`)."""
    main = threading.current_thread() is threading.main_thread()
    previous = signal.getsignal(signal.SIGTERM) if main else None
    try:
        yield
    finally:
        if main and previous is not None:
            signal.signal(signal.SIGTERM, previous)


@contextlib.contextmanager
def shared_ray(cfg: TrainConfig, slots: int):
    """For a sweep: join Ray once for all the runs of the block (a run that finds Ray joined reuses it and
    leaves it up; parallel runs never race to start or shut it down). Without cluster.address, a local
    instance with room for `slots` runs of `cfg` at once, shut down when the block leaves. With cluster.host
    'threads' the runs need no Ray: none is started (the block yields None)."""
    from rlhf_core.distributed.cluster import connect, required_resources, teardown

    cluster = cfg.cluster
    if cluster.host == "threads":
        yield None
        return
    if not cluster.address:
        per_run = max(cluster.num_cpus or 0, required_resources(cfg)["CPU"], 1)
        cluster = cluster.model_copy(update={"num_cpus": math.ceil(per_run * slots)})
    with sigterm_kept():
        handle = connect(cluster)
    try:
        yield handle
    finally:
        teardown(handle)


# -------------------------------------------------------------------------------------- what a run holds
class _StopCleanup(KeyboardInterrupt):
    """Signals kept coming during cleanup (RunResources.FORCE_AFTER of them): stop waiting for it."""


INTERRUPTS = (KeyboardInterrupt, TerminationSignal, SystemExit)


def _caused_by_interrupt(exc: BaseException | None) -> bool:
    """Whether `exc` is an interrupt, or was raised while one was being handled (its __context__ chain)."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        if isinstance(exc, INTERRUPTS):
            return True
        seen.add(id(exc))
        exc = exc.__cause__ or exc.__context__
    return False


class RunResources:
    """What one flow run holds, released when the flow body leaves, however it leaves.

    Tasks hand over what they acquire the moment it exists (`hold`, passed to them by the flow), not when they
    return: a task's result reaches the flow only after Prefect has recorded the task run's state, so a signal
    can land between "the MLflow run was created" and "the flow has it". The MLflow status is written first
    (one quick write): a worker kills the process if teardown outlasts its grace period.

    Cleanup runs to completion even when a signal lands in the middle of it: a terminal's Ctrl-C reaches the
    whole process group, so the flow may be leaving on an error that the same signal caused elsewhere (a child
    that died of it) with the interrupt still pending. While cleanup runs (in the main thread) SIGINT and
    SIGTERM are recorded instead of raised; a third one stops waiting and raises at once. A signal that lands
    before the MLflow run is ended makes it KILLED. When the body left on an error, a recorded signal is then
    delivered to the handler it would have reached (the CLI exits 130; under a worker, Prefect's SIGTERM
    handling); when the body returned (finished, or cancelled) the run's own outcome stands."""

    FORCE_AFTER = 3  # signals during cleanup: this many stop waiting for it

    def __init__(self, logger):
        self.logger = logger
        self.runtime: Any = None  # rlhf_core.distributed.DistributedRun
        self.tracker: Any = None  # the MLflow run's tracker (tracking.MlflowTracker)
        self.run_dir: Any = None  # this run's directory (rlhf_core.run.preflight.RunDirClaim), locked until release
        self.status = "FAILED"  # until the body says otherwise
        self.interrupted = False  # a signal landed during cleanup

    def hold(self, obj: Any) -> Any:
        """Take `obj` (a runtime, a tracker or a run directory claim) into the run's keeping; returns it."""
        kind = _kind(obj)
        current = getattr(self, kind)
        if current is not None and current is not obj:
            raise RuntimeError(f"this run already holds a {kind}")
        setattr(self, kind, obj)
        return obj

    def __enter__(self) -> RunResources:
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        # an error raised while a signal was being handled is the signal's (Prefect's task engine can turn the
        # worker's TerminationSignal, landing while it creates a task run, into "ValueError: Task run is not set")
        left_on_error = exc_type is not None and not _caused_by_interrupt(exc)
        if exc_type is not None and not left_on_error:
            self.status = "KILLED"
        elif left_on_error:
            self.status = "FAILED"
        with self._signals_deferred() as pending:
            self._release(exc_type, exc)
        if left_on_error and pending:  # as if it had arrived now: the handler it would have reached raises
            signal.raise_signal(pending[0])
        elif left_on_error and self.interrupted:  # an interrupt raised in a cleanup step (not a signal)
            raise KeyboardInterrupt("interrupted while the run was ending") from exc
        return False

    def _release(self, exc_type, exc) -> None:
        if exc_type is not None and self.status == "KILLED":  # (a cancelled body returned: no exception)
            message = "interrupted: tearing down the runtime and ending the MLflow run as KILLED"
            self._shielded(lambda: self.logger.warning(message), "logging")
        elif exc_type is not None:
            self._shielded(lambda: self.logger.error("run failed: %s: %s", exc_type.__name__, exc), "logging")
        tracker = self.tracker
        if tracker is not None:
            if self.status == "FAILED" and exc_type is not None and not self.interrupted:
                self._shielded(
                    lambda: tracker.set_tags({"error": f"{exc_type.__name__}: {exc}"[:5000]}),
                    "tagging the MLflow run with the error",
                )
            self._shielded(lambda: tracker.end(self._mlflow_status()), "ending the MLflow run")
        if self.runtime is not None:  # teardown is idempotent: a no-op after the teardown task
            # a run that failed or was interrupted does not wait for a loop stuck mid-batch: its actors are killed
            self._shielded(lambda: self.runtime.teardown(failed=exc_type is not None), "teardown")
        if self.run_dir is not None:
            self._shielded(self.run_dir.release, "releasing the run directory")

    def _mlflow_status(self) -> str:
        return "KILLED" if self.interrupted and self.status != "FINISHED" else self.status

    @contextlib.contextmanager
    def _signals_deferred(self):
        """SIGINT / SIGTERM recorded (yielded list of signal numbers) instead of raised, in the main thread;
        the previous handlers are back on exit. The FORCE_AFTER-th signal raises KeyboardInterrupt at once."""
        pending: list[int] = []
        if threading.current_thread() is not threading.main_thread():
            yield pending  # signals reach only the main thread
            return

        def record(signum, frame):
            pending.append(signum)
            self.interrupted = True
            if len(pending) >= self.FORCE_AFTER:
                raise _StopCleanup(f"{len(pending)} signals during cleanup: stopped waiting for it")

        previous = {}
        try:
            for sig in (signal.SIGINT, signal.SIGTERM):
                previous[sig] = signal.signal(sig, record)
            yield pending
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def _shielded(self, fn, what: str, attempts: int = 3) -> None:
        """Run a cleanup step to completion even if an interrupt is raised in it; a failing step is logged and
        the next one runs."""
        for _ in range(attempts):
            try:
                fn()
                return
            except _StopCleanup:
                raise
            except (KeyboardInterrupt, TerminationSignal, SystemExit):
                self.interrupted = True
                with contextlib.suppress(BaseException):
                    self.logger.warning("%s interrupted; finishing it", what)
            except Exception as exc:
                with contextlib.suppress(BaseException):
                    self.logger.error("%s failed: %s: %s", what, type(exc).__name__, exc)
                return


def _kind(obj: Any) -> str:
    """Which of RunResources' slots `obj` belongs in, by what it can do."""
    if hasattr(obj, "teardown"):
        return "runtime"
    if hasattr(obj, "end") and hasattr(obj, "run_id"):
        return "tracker"
    if hasattr(obj, "release") and hasattr(obj, "path"):
        return "run_dir"
    raise TypeError(f"a run holds a runtime, a tracker or a run directory, not {type(obj).__name__}")
