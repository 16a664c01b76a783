"""What `atrlhf train` / `sweep` print, and what goes to the run's log file instead (flows/terminal.py): a failure
inside a Ray actor reaches the terminal as one line with its cause and the log file's name, with no traceback,
no C++ stack and no ANSI code; the log file holds all of it."""

from __future__ import annotations

import io
import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

from flows.terminal import RunLog, WorkerOutput, _OneLineErrors, failure_line

REPO = Path(__file__).resolve().parents[1]
ESC = "\x1b"

# what Ray 2.x carries to the driver when an actor's __init__ raises (abridged; its colours included)
ACTOR_DIED = (
    f"The actor died because of an error raised in its creation task, {ESC}[36mray::TrainerActor.__init__()"
    f"{ESC}[39m (pid=6315, ip=127.0.0.1, actor_id=14cb83, repr=<rlhf_core.distributed.trainer_actor.TrainerActor>)\n"
    '  File "/repo/rlhf_core/distributed/trainer_actor.py", line 62, in __init__\n'
    "    self.model, self.tokenizer = build.build_policy(cfg, policy_dir)\n"
    "                                 ^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^\n"
    '  File "/repo/rlhf_core/model/lora.py", line 62, in apply_lora\n'
    "    raise LoraConfigError(problem)\n"
    "rlhf_core.model.lora.LoraConfigError: model.lora.target_modules: ['q_projx'] match no linear layer of the model"
)


class ActorDiedError(Exception):
    pass


def test_a_ray_actors_failure_is_one_line_with_the_actor_and_the_cause():
    line = failure_line(ActorDiedError(ACTOR_DIED))
    assert (
        line
        == "TrainerActor: LoraConfigError: model.lora.target_modules: ['q_projx'] match no linear layer of the model"
    )
    state_message = "Flow run encountered an exception: ActorDiedError: " + ACTOR_DIED.replace(ESC, "\\x1b")
    assert failure_line(state_message) == line  # the flow run's state message: the same line
    assert failure_line(ValueError("plain")) == "ValueError: plain"
    assert failure_line(KeyError("k")) == "KeyError: 'k'"
    assert len(failure_line("x" * 5000)) <= 500
    # a long one keeps its head and its tail: an environment's own error, with its file and line, is at the end
    deep = "/deep" * 60
    env_error = (
        f"RunFailed: rollout worker 0 failed: EnvError: environment MyEnv ({deep}/env.py) failed 20 calls in a row "
        f"(supervision.max_consecutive_failures=20); the last (raised): step: ValueError: no such move "
        f"(at {deep}/env.py:41)"
    )
    line = failure_line(env_error)
    assert len(line) <= 500 and line.startswith("RunFailed: rollout worker 0 failed: EnvError: environment MyEnv")
    assert "ValueError: no such move (at /deep" in line and line.endswith("/env.py:41)")


def test_worker_output_keeps_crash_dumps_and_ansi_off_the_terminal(tmp_path):
    log = logging.getLogger("test.workers")
    log.propagate, log.level = False, logging.INFO
    records = io.StringIO()
    log.addHandler(logging.StreamHandler(records))
    terminal = io.StringIO()
    out = WorkerOutput(log, terminal)
    trainer = {"pid": 11, "actor_name": "TrainerActor", "is_err": True}
    out({**trainer, "lines": [f"{ESC}[33mwarming up{ESC}[0m"]})
    out({**trainer, "lines": ["Traceback (most recent call last):", '  File "x.py", line 1, in f', "    g()"]})
    out({**trainer, "lines": ["ValueError: inside", "carrying on"]})  # the traceback's end, then normal output
    out({**trainer, "lines": ["Exception raised in creation task: The actor died", "[2026 E 1 1] logging.cc:125: x"]})
    out({**trainer, "lines": ["*** SIGABRT received at time=1 on cpu 0 ***", "PC: @ 0x7f (unknown)"]})
    out({"pid": "autoscaler", "lines": ["======== Autoscaler status ========", "Node status"]})
    shown = terminal.getvalue().splitlines()
    assert shown == ["(TrainerActor pid=11) warming up", "(TrainerActor pid=11) carrying on"]
    logged = records.getvalue()
    for text in ("ValueError: inside", "SIGABRT", "logging.cc", "Autoscaler status", "warming up"):
        assert text in logged
    assert ESC not in terminal.getvalue() + logged


def test_prefects_records_of_a_failure_stay_off_the_terminal():
    keep = _OneLineErrors()

    def record(level, msg, exc=False):
        r = logging.LogRecord("prefect.flow_runs", level, __file__, 1, msg, None, None)
        if exc:
            try:
                raise RuntimeError("boom")
            except RuntimeError:
                r.exc_info = sys.exc_info()
        return r

    assert keep.filter(record(logging.INFO, "step 4/8 | reward 0.5"))
    assert keep.filter(record(logging.WARNING, "health: staleness high"))
    assert keep.filter(record(logging.ERROR, "run failed: ConfigError: one line"))
    assert not keep.filter(record(logging.ERROR, "Task run failed with exception: RuntimeError", exc=True))
    assert not keep.filter(record(logging.INFO, "Finished in state Failed('Flow run encountered an exception')"))
    assert not keep.filter(record(logging.ERROR, "run failed: ActorDiedError: died\n  File ..."))
    assert not keep.filter(record(logging.ERROR, f"run failed: {ESC}[36mray::TrainerActor"))


def test_the_run_log_holds_every_record_in_full_and_is_made_at_the_first(tmp_path):
    path = tmp_path / "runs" / "r1" / "train.log"
    with RunLog(path) as run_log:
        assert not path.parent.exists()  # nothing created until something is logged
        try:
            raise ValueError("deep inside")
        except ValueError:
            logging.getLogger("prefect.flow_runs").error("Encountered exception during execution", exc_info=True)
        logging.getLogger(RunLog.WORKERS).info("(TrainerActor pid=1) a worker's line")
    assert run_log.written()
    text = path.read_text()
    assert "Traceback (most recent call last)" in text and "ValueError: deep inside" in text
    assert "(TrainerActor pid=1) a worker's line" in text
    logging.getLogger("prefect.flow_runs").error("after the block")  # the handler is gone with the block
    assert "after the block" not in path.read_text()


@pytest.mark.slow
def test_a_failure_inside_the_ray_actors_is_one_line_in_the_terminal(prefect_server, tmp_path):
    """The real thing: a LoRA typo let through to the actors (the check before start-up is switched off), so
    that they die in __init__ (SIGABRT, Ray's C++ stack): the terminal names the actor, the cause and the log."""
    script = (
        "import sys, flows.checks\n"
        "flows.checks.check_lora_targets = lambda cfg: None  # let the typo reach the actors\n"
        "from flows.cli import main\n"
        "sys.exit(main(['train', '--set', 'model.lora.target_modules=[q_projx]', 'trainer.total_steps=2',\n"
        "               'model.preset=micro', 'cluster.num_cpus=2',\n"
        f"               'run.output_dir={tmp_path / 'runs'}',\n"
        f"               'tracking.tracking_uri=sqlite:///{tmp_path / 'm.db'}']))\n"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO), "PREFECT_API_URL": prefect_server["url"]}
    env.pop("RAY_ADDRESS", None)
    out = subprocess.run(
        [sys.executable, "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600
    )
    terminal = out.stdout + out.stderr
    assert out.returncode == 1, terminal[-3000:]
    for noise in ("Traceback", "SIGABRT", "logging.cc", "Stack trace", ESC, "\\x1b"):
        assert noise not in terminal, noise
    (last,) = [line for line in out.stderr.splitlines() if line.startswith("atrlhf: the run failed:")]
    assert "TrainerActor: LoraConfigError: model.lora.target_modules: ['q_projx']" in last or (
        "RolloutActor: LoraConfigError" in last
    )
    log = Path(last.rsplit("(the full trace: ", 1)[1].rstrip(")"))
    assert log.parent.parent == tmp_path / "runs" and log.name == "train.log"
    text = log.read_text()
    assert "Traceback (most recent call last)" in text and "LoraConfigError" in text
    assert json.dumps("q_projx")[1:-1] in text
