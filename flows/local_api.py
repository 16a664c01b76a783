"""A temporary Prefect API for `atrlhf train` when none is configured, owned by the CLI.

Prefect would otherwise start its own temporary server as a child in the CLI's process group: a terminal's
Ctrl-C (SIGINT to the whole group) then kills the server first, and the CLI hangs retrying its state updates
against it; a SIGTERM to the CLI leaves the server running. This server runs in its own session, so a
terminal's signals reach only the CLI, which ends the run (Ray torn down, MLflow run KILLED) while the API
still answers, and then stops the server and every process under it.
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
    log_path: Optional[Path] = None, while_starting: Optional[Callable[[], object]] = None
) -> Iterator[Optional[str]]:
    """Yield the URL of a temporary Prefect API on 127.0.0.1 in its own session, set as PREFECT_API_URL for
    the block, and stop it (and its children) on every exit. Yields None when an API is configured.

    while_starting: called once before the block, while the server starts (after its process is spawned, before
    waiting for it to answer), or at once when an API is configured: the CLI imports its flow there, so that the
    two processes' imports (7-8 s each on 2 cores) overlap instead of adding up."""
    import prefect
    from prefect.settings import PREFECT_API_URL, get_current_settings, temporary_settings

    if get_current_settings().api.url:
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
            "uvicorn",
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
    )
    try:
        if while_starting is not None:
            while_starting()
        _wait_healthy(url, process, STARTUP_TIMEOUT_S)
        with temporary_settings(updates={PREFECT_API_URL: url}):
            try:
                yield url
            finally:
                _drain_prefect_workers()  # logs and events reach the API while it still answers
    finally:
        stop_process_group(process)
        if log is not subprocess.DEVNULL:
            log.close()
