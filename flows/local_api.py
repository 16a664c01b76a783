"""A temporary Prefect API for `atrlhf train` when none is configured, owned by the CLI.

Prefect would otherwise start its own temporary server as a child in the CLI's process group: a terminal's
Ctrl-C (SIGINT to the whole group) then kills the server first, and the CLI hangs retrying its state updates
against it; a SIGTERM to the CLI leaves the server running. This server runs in its own session, so a
terminal's signals reach only the CLI, which ends the run (Ray torn down, MLflow run KILLED) while the API
still answers, and then stops the server and every process under it.

The server also dies with the CLI when the CLI is killed outright (SIGKILL, the OOM killer), when nothing in the
CLI runs to stop it: on Linux the kernel sends it SIGTERM when its parent dies (PR_SET_PDEATHSIG, set between
fork and exec), and on every platform a watchdog thread in the server (`python -m flows.local_api --parent PID
...`, which then runs uvicorn) ends it once its parent is gone.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Optional

STARTUP_TIMEOUT_S = 120.0
STOP_GRACE_S = 5.0
WATCHDOG_INTERVAL_S = 1.0
PR_SET_PDEATHSIG = 1  # linux/prctl.h


def _die_with_parent(parent: int) -> Callable[[], None]:
    """A `preexec_fn`: on Linux, the kernel sends the child SIGTERM when the thread that started it exits (the CLI
    starts the server from its main thread, so: when the CLI's process ends, however it ends). Elsewhere nothing:
    the watchdog covers it."""

    def preexec() -> None:
        if not sys.platform.startswith("linux"):
            return
        import ctypes

        try:
            ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
        except (OSError, AttributeError):
            return
        if os.getppid() != parent:  # the parent died before prctl took effect
            os._exit(1)

    return preexec


def _watch_parent(parent: int, interval_s: float = WATCHDOG_INTERVAL_S) -> None:
    """End this process (and the process group it leads) once `parent` is no longer its parent."""
    import threading

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(interval_s)
        with contextlib.suppress(OSError):
            os.killpg(os.getpgrp(), signal.SIGTERM)  # uvicorn shuts down on SIGTERM; its children with it
        time.sleep(STOP_GRACE_S)
        os._exit(1)

    threading.Thread(target=watch, name="atrlhf-parent-watchdog", daemon=True).start()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wait_healthy(url: str, process: subprocess.Popen, timeout_s: float) -> None:
    import httpx

    deadline = time.monotonic() + timeout_s
    with httpx.Client() as client:
        while time.monotonic() < deadline:
            if process.poll() is not None:
                raise RuntimeError(
                    f"the temporary Prefect API exited with code {process.returncode} before it answered"
                )
            try:
                if client.get(f"{url}/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
    raise RuntimeError(f"the temporary Prefect API did not answer at {url} within {timeout_s:g} s")


def _drain_prefect_workers(timeout_s: float = 5.0) -> None:
    """Send the log records and events Prefect still holds, bounded: otherwise they retry against the stopped
    API at exit for over a minute."""
    from prefect.events.worker import EventsWorker
    from prefect.logging.handlers import APILogWorker

    for worker in (APILogWorker, EventsWorker):
        with contextlib.suppress(Exception):
            worker.drain_all(timeout=timeout_s)


def stop_process_group(process: subprocess.Popen, grace_s: float = STOP_GRACE_S) -> None:
    """SIGTERM to the process's whole group (it leads its own session), then SIGKILL after `grace_s`."""
    if process.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGTERM)
    try:
        process.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait()


@contextlib.contextmanager
def local_prefect_api(
    log_path: Optional[Path] = None,
    while_starting: Optional[Callable[[], object]] = None,
    progress: Optional[Callable[[str], None]] = None,
) -> Iterator[Optional[str]]:
    """Yield the URL of a temporary Prefect API on 127.0.0.1 in its own session, set as PREFECT_API_URL for
    the block, and stop it (and its children) on every exit. Yields None when an API is configured.

    while_starting: called once before the block, while the server starts (after its process is spawned, before
    waiting for it to answer), or at once when an API is configured: the CLI imports its flow there, so that the
    two processes' imports (7-8 s each on 2 cores) overlap instead of adding up. `progress(line)`: told what
    starts and when it answers."""
    say = progress or (lambda line: None)
    t0 = time.monotonic()
    import prefect
    from prefect.settings import PREFECT_API_URL, get_current_settings, temporary_settings

    if get_current_settings().api.url:
        say(f"Prefect API at {get_current_settings().api.url} (PREFECT_API_URL)")
        if while_starting is not None:
            while_starting()
        yield None
        return
    port = _free_port()
    url = f"http://127.0.0.1:{port}/api"
    env = {
        **os.environ,
        "PREFECT_UI_ENABLED": "0",
        "PREFECT__SERVER_EPHEMERAL": "1",
        "PREFECT__SERVER_FINAL": "1",
        **get_current_settings().to_environment_variables(exclude_unset=True),
    }
    log = open(log_path, "ab") if log_path else subprocess.DEVNULL  # closed below
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "flows.local_api",
            "--parent",
            str(os.getpid()),
            "--app-dir",
            str(prefect.__module_path__.parent),
            "--factory",
            "prefect.server.api.server:create_app",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--log-level",
            "error",
            "--lifespan",
            "on",
        ],
        env=env,
        stdout=log,
        stderr=log,
        start_new_session=True,
        preexec_fn=_die_with_parent(os.getpid()),
    )
    say(f"starting a temporary Prefect API at {url} (PREFECT_API_URL is not set)")
    try:
        if while_starting is not None:
            while_starting()
        _wait_healthy(url, process, STARTUP_TIMEOUT_S)
        say(f"Prefect API up ({time.monotonic() - t0:.1f} s)")
        with temporary_settings(updates={PREFECT_API_URL: url}):
            try:
                yield url
            finally:
                _drain_prefect_workers()  # logs and events reach the API while it still answers
    finally:
        stop_process_group(process)
        if log is not subprocess.DEVNULL:
            log.close()


def _serve(argv: list[str]) -> None:
    """`python -m flows.local_api --parent PID UVICORN_ARGS...`: uvicorn with the parent watchdog."""
    if len(argv) < 2 or argv[0] != "--parent":
        raise SystemExit("usage: python -m flows.local_api --parent PID [uvicorn arguments]")
    _watch_parent(int(argv[1]))
    from uvicorn import main as uvicorn_main  # the click command `uvicorn`

    uvicorn_main.main(args=argv[2:], prog_name="uvicorn")


if __name__ == "__main__":
    _serve(sys.argv[1:])
