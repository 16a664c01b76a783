"""The README as written: its commands name the project's virtualenv, and its runnable blocks run.

A fenced block whose info string is `bash runnable` (or `python runnable`) is run as a user would run it: from
the repository root of a fresh clone (a scratch directory holding the repository's configs and examples and
a `.venv` that is this interpreter's environment, so what the commands write stays there), with bash (or the
virtualenv's python), and must exit 0. Only blocks cheap enough for the suite are marked; a block that starts
training is not.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
FENCE = re.compile(r"^```(?P<info>[^\n`]*)\n(?P<body>.*?)^```\s*$", re.S | re.M)
VENV_COMMANDS = ("python", "python3", "atrlhf", "prefect", "mlflow", "pip", "ruff", "pytest")
SHARED = ("configs", "examples", "deployments", "prefect.yaml", "pyproject.toml", "Makefile")


def blocks(text: str) -> list[tuple[int, str, str]]:
    """(line number, info string, body) of every fenced block."""
    return [(text[: m.start()].count("\n") + 1, m["info"].strip(), m["body"]) for m in FENCE.finditer(text)]


def runnable_blocks() -> list[tuple[int, str, str]]:
    return [b for b in blocks(README.read_text(encoding="utf-8")) if b[1].split()[1:2] == ["runnable"]]


def commands(body: str) -> list[list[str]]:
    """The commands of a bash block, as words: continuation lines joined, comments and heredoc bodies left out,
    each command of a `&&` / `||` / `;` / `|` chain on its own (quotes respected)."""
    out, heredoc, joined = [], None, ""
    for line in body.splitlines():
        if heredoc is not None:
            heredoc = None if line.strip() == heredoc else heredoc
            continue
        joined += line[:-1] if line.endswith("\\") else line
        if line.endswith("\\"):
            continue
        text, joined = joined, ""
        if match := re.search(r"<<-?\s*['\"]?(\w+)", text):
            heredoc = match.group(1)
        lexer = shlex.shlex(text, posix=True, punctuation_chars=True)
        lexer.commenters = "#"
        lexer.whitespace_split = True  # a word is what the shell makes one (`key=a,b` stays whole)
        command: list[str] = []
        for token in lexer:
            if token in ("&&", "||", ";", "|", "&"):
                out.append(command) if command else None
                command = []
            else:
                command.append(token)
        if command:
            out.append(command)
    return out


def test_the_parser_reads_commands_and_runnable_blocks():
    text = "x\n```bash runnable\ncat > a <<'J'\npython no\nJ\na \\\n  b  # c\n.venv/bin/python -c 1 && atrlhf x\n```\n"
    ((line, info, body),) = blocks(text)
    assert line == 2 and info == "bash runnable"
    assert commands(body) == [
        ["cat", ">", "a", "<<", "J"],
        ["a", "b"],
        [".venv/bin/python", "-c", "1"],
        ["atrlhf", "x"],
    ]
    assert commands("a --grid k=v1,v2 --set x.y=1.5e-4;b") == [["a", "--grid", "k=v1,v2", "--set", "x.y=1.5e-4"], ["b"]]


def test_readme_commands_name_the_virtualenv():
    """Every command of every bash block runs as written from the repository root of a fresh clone: the
    project's tools are called as .venv/bin/<tool> (or through make), never from a PATH the reader may not
    have set up."""
    bare = [
        (line, command)
        for line, info, body in blocks(README.read_text(encoding="utf-8"))
        if info.split()[:1] == ["bash"]
        for command in commands(body)
        if command[0] in VENV_COMMANDS
    ]
    assert not bare, f"README commands without .venv/bin/: {bare}"
    optional = [
        (line, command)
        for line, info, body in blocks(README.read_text(encoding="utf-8"))
        if info.split()[:1] == ["bash"]
        for command in commands(body)
        if any(word.startswith("[-") for word in command)
    ]
    assert not optional, f"README commands with [optional] arguments, which do not run as written: {optional}"


def test_some_blocks_are_marked_runnable():
    assert len(runnable_blocks()) >= 2


@pytest.fixture
def fresh_clone(tmp_path) -> Path:
    """A scratch repository root: the README's inputs linked in, `.venv` this interpreter's environment."""
    for name in SHARED:
        (tmp_path / name).symlink_to(ROOT / name)
    (tmp_path / ".venv").symlink_to(Path(sys.prefix))
    return tmp_path


@pytest.mark.slow
@pytest.mark.parametrize(
    "line, info, body", runnable_blocks(), ids=lambda v: f"README.md:{v}" if isinstance(v, int) else ""
)
def test_runnable_block_runs_as_written(fresh_clone, line, info, body):
    env = {k: v for k, v in os.environ.items() if k != "VIRTUAL_ENV"}
    env["PATH"] = os.pathsep.join(
        p for p in env.get("PATH", "").split(os.pathsep) if Path(p) != Path(sys.prefix) / "bin"
    )
    if info.startswith("python"):
        argv = [str(fresh_clone / ".venv" / "bin" / "python"), "-c", body]
    else:
        argv = ["bash", "-euo", "pipefail", "-c", body]
    out = subprocess.run(argv, cwd=fresh_clone, env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, (
        f"README.md:{line} failed ({out.returncode}):\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}"
    )


def readme_command(option: str) -> list[str]:
    """The words of the README's `.venv/bin/atrlhf ...` command that gives `option` a path (no <placeholder>)."""
    found = [
        command
        for _, info, body in blocks(README.read_text(encoding="utf-8"))
        if info.split()[:1] == ["bash"]
        for command in commands(body)
        if command[0] == ".venv/bin/atrlhf" and option in command and not any("<" in w for w in command)
    ]
    assert found, f"the README has no atrlhf command with {option} <a path>"
    return found[0]


def test_the_readme_resume_and_evaluate_examples_run_as_written_after_make_train(fresh_clone, monkeypatch):
    """After `make train` (configs/tiny.yaml: 400 steps, a checkpoint every 20, checkpoint.keep=3 keeps
    360, 380 and 400) the README's resume command resumes the newest checkpoint and trains on, and its evaluate
    command finds what to score, exported or not (after Ctrl-C): both as written, up to where training or scoring
    starts (what follows is tests/test_flow.py's and tests/test_cli_checks.py's)."""
    import flows.cli

    run = fresh_clone / "runs" / "tiny" / "20261130-231502-witty-otter"
    for step in (360, 380, 400):
        ckpt = run / "checkpoints" / f"step_{step:06d}"
        ckpt.mkdir(parents=True)
        (ckpt / "meta.json").write_text(f'{{"format_version": 2, "step": {step}}}')
    (run.parent / "latest").symlink_to(run.name, target_is_directory=True)
    monkeypatch.chdir(fresh_clone)
    started = {}

    def train(cfg, resume_from):
        started["train"] = (cfg, resume_from)
        return 0

    def evaluate(cfg, target, **options):
        started["evaluate"] = target
        return 0

    monkeypatch.setattr(flows.cli, "cmd_train", train)
    monkeypatch.setattr(flows.cli, "cmd_evaluate", evaluate)

    resume = readme_command("--resume-from")
    assert flows.cli.main(resume[1:]) == 0
    cfg, resume_from = started["train"]
    assert resume_from == str((run / "checkpoints" / "step_000400").resolve())
    assert cfg.trainer.total_steps > 400, "the example trains on past what make train reached"

    evaluate = readme_command("--checkpoint")
    assert flows.cli.main(evaluate[1:]) == 0  # no policy/: the run was stopped before its export
    (run / "policy").mkdir()
    (run / "policy" / "config.json").write_text("{}")
    assert flows.cli.main(evaluate[1:]) == 0 and started["evaluate"] == "runs/tiny/latest"


@pytest.mark.slow
def test_the_readme_sweep_example_runs_as_written(fresh_clone, monkeypatch, prefect_api, _mlflow_db_template, capsys):
    """The README's `atrlhf sweep` command as written, from a fresh clone: its grid (2 losses x 2 staleness bounds)
    and seeds (2) are read, every point is validated before anything starts, and all 8 points train to the
    comparison, each at the bound it names. The one change: each point trains 2 steps of a smaller batch on the
    in-process threads host (the base config the command loads, changed where the command hands it to the sweep;
    tests/test_sweep.py runs sweeps on Ray)."""
    import shutil

    import flows.cli
    from rlhf_core.config import apply_overrides, validate_config

    shutil.copyfile(_mlflow_db_template, fresh_clone / "mlflow.db")  # the store the command uses (cwd), made
    monkeypatch.chdir(fresh_clone)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)  # as a newcomer's shell: no store set elsewhere
    real_sweep, started = flows.cli.cmd_sweep, {}

    def shortened(cfg, grid, seeds, *rest):
        started.update(cfg=cfg, grid=grid, seeds=seeds)
        data = cfg.model_dump(mode="json")
        short = ["trainer.total_steps=2", "trainer.prompts_per_step=4", "rollout.prompts_per_batch=4"]
        short.append("cluster.host=threads")  # in-process (no Ray processes): the Ray host's sweep is test_sweep's
        apply_overrides(data, [*short, "data.eval_size=20", "eval.every=0", "checkpoint.every=0"])
        return real_sweep(validate_config(data), grid, seeds, *rest)

    monkeypatch.setattr(flows.cli, "cmd_sweep", shortened)
    sweep = readme_command("--grid")
    assert flows.cli.main(sweep[1:]) == 0
    out = capsys.readouterr().out
    assert started["grid"] == {"algorithm.loss": ["grpo", "m2po"], "runtime.max_staleness": [1, 4]}
    assert started["seeds"] == 2 and started["cfg"].trainer.total_steps == 200  # configs/staleness_sweep.yaml
    assert "8 point(s), 8 ran, 0 skipped (finished before), 0 failed" in out, out[-3000:]

    import re

    from mlflow.tracking import MlflowClient

    # the store the sweep names in its summary (sqlite:///mlflow.db in the working directory, as the README says)
    uri = re.search(r"MLflow parent run\s+\S+\s+\((\S+)\)", out).group(1)
    client = MlflowClient(uri)
    exp = client.get_experiment_by_name(started["cfg"].tracking.experiment)
    assert exp is not None, (uri, [e.name for e in client.search_experiments()])
    children = client.search_runs([exp.experiment_id], filter_string="tags.`atrlhf.sweep_role` = 'child'")
    assert len(children) == 8 and all(c.info.status == "FINISHED" for c in children)
    for child in children:  # each point trains at the staleness bound it names
        bound = float(child.data.tags["runtime.max_staleness"])
        assert [m.value for m in client.get_metric_history(child.info.run_id, "async/max_staleness")] == [bound] * 2
