"""What `atrlhf train` and `atrlhf sweep` show in the terminal, and what goes to the run's log file instead.

- `quiet_terminal`: what a healthy run need not print is dropped from the terminal (the Prefect UI keeps it).
- `RunLog`: the run's log file holds every log record of the process in full (tracebacks included) and every line
  Ray forwards from its workers; the terminal gets no traceback, no C++ stack and no ANSI code: a failure is one
  line (`failure_line`) that names the log file.
- `train_summary`, `prefect_location`: the closing summary and where the records are.
"""

from __future__ import annotations

import logging
import os
import re
import sys
from pathlib import Path
from typing import Optional

from rlhf_core.config import TrainConfig
from rlhf_core.distributed.console import autoscaler_events, route_worker_output

RUN_LOG = "train.log"  # in the run's directory: everything the run logged, tracebacks included


class _QuietTerminal:
    """What a healthy run need not print, dropped from the terminal only (the Prefect UI keeps every line):
    Prefect's "Finished in state Completed()" per task run (and per child flow run of a sweep), which would bury
    the progress lines, and the INFO lines of the long-running loops' task runs (their progress, every 30 s).
    Failed or crashed runs still print (at ERROR)."""

    def __init__(self, loop_tasks: tuple[str, ...]):
        self.loop_tasks = loop_tasks

    def filter(self, record) -> bool:
        if record.name in ("prefect.task_runs", "prefect.flow_runs") and str(record.msg).startswith(
            "Finished in state Completed"
        ):
            return False
        return not (record.levelno < 30 and getattr(record, "task_name", None) in self.loop_tasks)


class _NoRayTokenNotice:
    """Ray's notice that token authentication is on for the local cluster it starts (the default, not news)."""

    def filter(self, record) -> bool:
        return not str(record.msg).startswith("Token authentication is enabled")


def console_handlers() -> list[logging.Handler]:
    """Prefect's console handler(s): root's, and any a logger of Prefect's holds itself."""
    from prefect.logging.handlers import PrefectConsoleHandler

    found: dict[int, logging.Handler] = {}
    for name in ("", "prefect", "prefect.task_runs", "prefect.flow_runs"):
        for handler in logging.getLogger(name).handlers:
            if isinstance(handler, PrefectConsoleHandler):
                found.setdefault(id(handler), handler)
    return list(found.values())


def quiet_terminal() -> None:
    from tasks.cluster import LOOP_TASKS

    for handler in console_handlers():
        if not any(isinstance(f, _QuietTerminal) for f in handler.filters):
            handler.addFilter(_QuietTerminal(LOOP_TASKS))
    ray_auth = logging.getLogger("ray._private.authentication.authentication_token_setup")
    if not any(isinstance(f, _NoRayTokenNotice) for f in ray_auth.filters):
        ray_auth.addFilter(_NoRayTokenNotice())


def startup_line(line: str) -> None:
    print(f"atrlhf: start-up: {line}", file=sys.stderr, flush=True)


def console_script(name: str) -> str:
    """`name` as typed from the working directory: the console script beside this interpreter
    (.venv/bin/prefect from the repository root), so the hint runs without the virtualenv on PATH."""
    path = Path(sys.executable).parent / name
    if not path.exists():
        return name
    return os.path.relpath(path) if path.is_relative_to(Path.cwd()) else str(path)


def prefect_location(flow_run_id: Optional[str], temporary_api: bool = False) -> tuple[str, str]:
    """(where the records are, how to see them)."""
    from prefect.settings import get_current_settings

    settings = get_current_settings()
    api = settings.api.url
    if api and not temporary_api:
        ui = (settings.ui_url or api.rsplit("/api", 1)[0]).rstrip("/")
        return f"the Prefect API at {api}", f"{ui}/runs/flow-run/{flow_run_id}" if flow_run_id else ui
    home = Path(str(settings.home)).expanduser()
    return (
        f"the local Prefect database under {home}",
        f"`{console_script('prefect')} server start --host 127.0.0.1`, then "
        f"http://127.0.0.1:4200/runs/flow-run/{flow_run_id}",
    )


def train_summary(
    cfg: TrainConfig, state, result: Optional[dict], flow_run_id: Optional[str], temporary_api: bool = False
) -> str:
    from tracking import resolve_tracking_uri, ui_command
    from tracking.runs import ui_url

    where, see = prefect_location(flow_run_id, temporary_api)
    uri = (result or {}).get("mlflow_tracking_uri") or resolve_tracking_uri(cfg)
    lines = [
        "",
        "=" * 78,
        f"atrlhf train: {state.name}" + (f" — {failure_line(state.message)}" if state.message and not result else ""),
    ]
    if result and result.get("nothing_to_train"):
        lines.append(f"  {result['nothing_to_train']}")
        result = None
    if result:
        start = f"{result['eval/accuracy_start']:.3f} at the start"
        if result.get("eval/accuracy_resumed") is not None:  # a resumed run: its lineage's start, and where it resumed
            start = (
                f"{result['eval/accuracy_start']:.3f} at the lineage's start, {result['eval/accuracy_resumed']:.3f} at "
                f"the resume (step {result['resumed_at']})"
            )
        lines.append(f"  held-out accuracy   {start} -> {result['eval/accuracy']:.3f} after {result['steps']} steps")
        if "eval/pass@k" in result:
            lines.append(
                f"  sampled held-out    pass@{cfg.eval.k} {result['eval/pass@k']:.3f}, mean@{cfg.eval.k} "
                f"{result['eval/mean@k']:.3f} ({cfg.eval.n_samples} samples per prompt)"
            )
        if "reward/mean" in result:  # what the training reward is made of: correctness apart from format
            from flows.progress import reward_breakdown

            lines.append(f"  train reward        {reward_breakdown(result)} at the last step")
        if result.get("run_dir"):
            latest = Path(cfg.run.output_dir) / "latest"
            lines.append(f"  run directory       {result['run_dir']}  ({latest} points to it)")
            if (Path(result["run_dir"]) / RUN_LOG).is_file():
                lines.append(f"  run log             {Path(result['run_dir']) / RUN_LOG}")
        lines += [
            f"  final checkpoint    {result['checkpoint']}",
            f"  exported policy     {result['export']}  (rlhf_core.model.policy.load_policy loads it)",
            f"  MLflow run          {result['mlflow_run_id']}  (experiment '{cfg.tracking.experiment}', {uri})",
        ]
    lines += [
        f"  Prefect flow run    {flow_run_id}  (in {where})",
        f"  Prefect UI          {see}",
        f"  MLflow UI           {ui_command(uri)}  -> {ui_url(uri)}",
        "=" * 78,
    ]
    return "\n".join(lines)


def sweep_summary(result: dict, target: float, flow_run: str, see: str) -> str:
    from tracking import ui_command
    from tracking.runs import ui_url
    from tracking.sweep_comparison import table_markdown

    uri = result["mlflow_tracking_uri"]
    return "\n".join(
        [
            "",
            "=" * 78,
            f"atrlhf sweep {result['sweep_id']}: {result['points']} point(s), {result['ran']} ran, "
            f"{result['skipped']} skipped (finished before), {result['failed']} failed",
            "",
            table_markdown(result["rows"], target),
            f"  MLflow parent run   {result['mlflow_parent_run_id']}  ({result['mlflow_tracking_uri']})",
            f"  MLflow UI           {ui_command(uri)}  -> {ui_url(uri)}",
            f"  Prefect flow run    {flow_run}",
            f"  Prefect UI          {see}",
            "=" * 78,
        ]
    )


# ------------------------------------------------------------------------------------- failures: one line
ANSI = re.compile(r"\x1b\[[0-9;?]*[ -/]*[@-~]")
_ESCAPED_ANSI = re.compile(r"\\x1b\[[0-9;?]*[ -/]*[@-~]")
_EXCEPTION_LINE = re.compile(
    r"^(?:[A-Za-z_][\w]*\.)*([A-Za-z_]\w*(?:Error|Exception|Exit|Interrupt|Failure|Died)\w*)(?:: (.*))?$"
)
_ACTOR = re.compile(r"ray::(\w+)[.(]")
LINE_LIMIT = 500


def failure_line(error) -> str:
    """An exception (or a message) as one line for the terminal, ANSI codes dropped. A traceback's text (a Ray
    actor's, carried inside the driver's exception) comes down to its last `Error: message` line, with the
    actor it happened in: `TrainerActor: LoraConfigError: model.lora.target_modules: ...`."""
    text = _ESCAPED_ANSI.sub("", ANSI.sub("", str(error)))  # codes, and codes written out by a repr()
    lines = [part.strip() for part in text.splitlines() if part.strip()]
    line = " ".join(lines)
    causes = [m for m in map(_EXCEPTION_LINE.match, lines) if m and m.group(2)] if len(lines) > 1 else []
    if causes:  # a traceback's text: its innermost exception, and the Ray actor it was raised in
        line = f"{causes[-1].group(1)}: {causes[-1].group(2)}"
        actor = _ACTOR.search(text)
        line = f"{actor.group(1)}: {line}" if actor else line
    elif isinstance(error, BaseException) and not _EXCEPTION_LINE.match(line):
        line = f"{type(error).__name__}: {line}"
    if len(line) > LINE_LIMIT:  # the head says where, the tail the cause (an environment's error and its file:line)
        line = line[:150] + " ... " + line[len(line) - (LINE_LIMIT - 155) :]
    return line


class _OneLineErrors:
    """On the terminal, a failure is the CLI's one closing line: Prefect's records of it (the traceback of a failed
    task or flow run, its 'Finished in state Failed(...)'), and any record that carries a traceback, several lines
    or ANSI codes at ERROR, go to the run's log file (and the Prefect UI) only."""

    def filter(self, record: logging.LogRecord) -> bool:
        if str(record.msg).startswith(("Finished in state Failed", "Finished in state Crashed")):
            return False
        if record.levelno < logging.ERROR:
            return True
        message = record.getMessage()
        return not (record.exc_info or "\n" in message or "\x1b" in message or "\\x1b" in message)


# ---------------------------------------------------------------------------------- Ray workers' output
_FATAL = re.compile(
    r"Exception raised in creation task|The actor died|Stack trace:|\*\*\* SIG[A-Z]+ received|Fatal Python error"
)


class WorkerOutput:
    """Replaces what Ray prints of its workers' stdout and stderr (`log_to_driver`): every line goes to the run's
    log file; the terminal gets a worker's lines without ANSI codes, and not its crash dumps (a Python traceback,
    and everything a dying worker prints: Ray's C++ stack, the signal, the interpreter's fatal error)."""

    def __init__(self, log: logging.Logger, stream=None):
        self.log = log
        self.stream = stream
        self.dead: set = set()  # pids whose output showed a fatal crash
        self.in_traceback: set = set()  # pids in the middle of a Python traceback

    def __call__(self, data: dict, ignore_prefix: bool = False) -> None:
        pid = data.get("pid")
        name = data.get("actor_name") or data.get("task_name")
        prefix = "" if ignore_prefix else f"({name + ' ' if name else ''}pid={pid}) "
        lines = [ANSI.sub("", raw) for raw in data.get("lines") or []]
        for line in lines:
            self.log.info("%s%s", prefix, line)
        if pid == "autoscaler":  # its status reports to the log; on the terminal only its events, as Ray does
            shown = [f"(autoscaler) {ANSI.sub('', event)}" for event in autoscaler_events(lines)]
        elif pid == "raylet":
            shown = [f"(raylet) {line}" for line in lines if line.strip()]
        else:
            shown = [prefix + line for line in self._not_crash_dumps(pid, lines)]
        if shown:
            stream = self.stream or sys.stderr
            stream.write("".join(f"{line}\n" for line in shown))
            stream.flush()

    def _not_crash_dumps(self, pid, lines: list[str]) -> list[str]:
        kept = []
        for line in lines:
            if _FATAL.search(line):
                self.dead.add(pid)
            if line.startswith("Traceback (most recent call last)"):
                self.in_traceback.add(pid)
            elif pid in self.in_traceback:
                if _EXCEPTION_LINE.match(line.strip()) and not line[:1].isspace():
                    self.in_traceback.discard(pid)  # its last line: the exception
            elif pid not in self.dead and line.strip():
                kept.append(line)
        return kept


# ------------------------------------------------------------------------------------------- the run log
class _RunLogHandler(logging.FileHandler):
    """A file handler that creates its directory (and the file) at the first record only."""

    def _open(self):
        Path(self.baseFilename).parent.mkdir(parents=True, exist_ok=True)
        return super()._open()


class RunLog:
    """For the block: every log record of the process, and every line Ray forwards from its workers, in full in
    `path`; on the terminal one line per failure (`_OneLineErrors`) and no worker's crash dump."""

    WORKERS = "atrlhf.ray_workers"

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self.handler = _RunLogHandler(self.path, encoding="utf-8", delay=True)
        self.handler.setFormatter(logging.Formatter("%(asctime)s | %(levelname)-7s | %(name)s - %(message)s"))
        self._undo: list = []

    def __enter__(self) -> RunLog:
        root = logging.getLogger()
        root.addHandler(self.handler)
        self._undo.append(lambda: root.removeHandler(self.handler))
        for handler in console_handlers():
            one_line = _OneLineErrors()
            handler.addFilter(one_line)
            self._undo.append(lambda h=handler, f=one_line: h.removeFilter(f))
        workers = logging.getLogger(self.WORKERS)
        workers.propagate, workers.level = False, logging.INFO  # the log file only, never the console
        workers.addHandler(self.handler)
        self._undo.append(lambda: workers.removeHandler(self.handler))
        undo_ray = route_worker_output(WorkerOutput(workers))
        if undo_ray is not None:
            self._undo.append(undo_ray)
        return self

    def __exit__(self, *exc) -> None:
        for undo in reversed(self._undo):
            undo()
        self._undo.clear()
        self.handler.close()

    def written(self) -> bool:
        return self.path.is_file()
