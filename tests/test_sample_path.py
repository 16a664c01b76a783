"""Following one sample from prompt to trainer enters each module once.

One lockstep step of the in-process host (prompts from the queue -> the rollout role -> the worker -> its episode
runner -> the engine -> the reward -> the buffer -> the trainer role -> the trainer -> the published version) is run
under a profiler that sees every call into a project module. A call into a module that is already on the stack
below its caller is a move back: the module called something that called it again (the worker handing its own
method to the episode runner, a host's lambda run by the role it hosts). None is left, but in the two places where
the call back is the design:

- rlhf_core.types: a batch's hint objects (the answers' text) follow its tensors through `select` and `to`;
- rlhf_core.algorithms: the registry calls the registered function (a built-in or a user's loss), which uses the
  registry's helpers.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from rlhf_core.config import load_config

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = str(ROOT / "rlhf_core")
CALLED_BACK_BY_DESIGN = ("rlhf_core.types", "rlhf_core.algorithms")

TINY = [
    "model.preset=micro",
    "rollout.prompts_per_batch=4",
    "trainer.prompts_per_step=4",
    "rollout.samples_per_prompt=4",
    "data.eval_size=8",
    "runtime.max_staleness=0",
]


def _module(code) -> str | None:
    path = code.co_filename
    if not path.startswith(PACKAGE):
        return None
    return str(Path(path).relative_to(ROOT).with_suffix("")).replace("/", ".")


def moves_back(fn) -> dict[str, int]:
    """Run `fn()` under a profiler; returns 'module <- caller <- ... <- module' (each chain of modules that called
    back into one already on the stack) -> how often, but those of CALLED_BACK_BY_DESIGN."""
    found: dict[str, int] = {}

    def profile(frame, event, arg):
        if event != "call":
            return
        module = _module(frame.f_code)
        if module is None:
            return
        stack: list[str] = []  # the project modules below, nearest first, a run of one module counted once
        back = frame.f_back
        while back is not None:
            below = _module(back.f_code)
            if below is not None and (not stack or stack[-1] != below):
                stack.append(below)
            back = back.f_back
        if stack and stack[0] != module and module in stack[1:] and not module.startswith(CALLED_BACK_BY_DESIGN):
            chain = " <- ".join([module, *stack[: stack.index(module, 1) + 1]])
            found[chain] = found.get(chain, 0) + 1

    sys.setprofile(profile)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return found


@pytest.fixture(scope="module")
def parts(tmp_path_factory):
    from rlhf_core.run.local import build_run, lockstep_step

    out = tmp_path_factory.mktemp("sample_path")
    built = build_run(load_config(ROOT / "configs" / "tiny.yaml", [*TINY, f"run.output_dir={out}"]))
    lockstep_step(built)  # the first step's one-off work (lazy imports, tables) is not the path
    return built


def test_one_sample_from_prompt_to_trainer_enters_each_module_once(parts):
    from rlhf_core.run.local import lockstep_step

    step = parts.trainer.step
    found = moves_back(lambda: lockstep_step(parts))
    assert parts.trainer.step == step + 1  # the profiled call did train one step
    assert not found, f"calls back into a module already on the stack: {found}"


def test_the_check_sees_a_runner_calling_back_into_its_worker(parts, monkeypatch):
    """The shape round three left: the rollout worker gave the episode runner its own `_score` method, so a sample
    entered the worker twice. A scorer compiled as part of rollout/worker.py is found."""
    from rlhf_core.run.local import lockstep_step

    source = "def score(rows, patterns, repeats, batch):\n    return reward(rows, patterns, repeats, batch)\n"
    namespace = {"reward": parts.worker.score}
    exec(compile(source, str(ROOT / "rlhf_core" / "rollout" / "worker.py"), "exec"), namespace)
    monkeypatch.setattr(parts.worker, "score", namespace["score"])
    found = moves_back(lambda: lockstep_step(parts))
    assert list(found) == ["rlhf_core.rollout.worker <- rlhf_core.rollout.episodes <- rlhf_core.rollout.worker"]


def test_a_multi_turn_sample_enters_each_module_once(tmp_path, chat_policy_dir):
    """The same through an environment's episodes (the runner's turns, the environment processes' pool)."""
    from rlhf_core.run.local import build_run, lockstep_step

    overrides = [*TINY[1:], "trainer.warm_start.steps=0", f"model.path={chat_policy_dir}", f"run.output_dir={tmp_path}"]
    parts = build_run(load_config(ROOT / "configs" / "tiny-multiturn.yaml", overrides))
    try:
        lockstep_step(parts)
        found = moves_back(lambda: lockstep_step(parts))
        assert parts.trainer.step == 2 and parts.worker.last_trajectories  # it trained on episodes
    finally:
        parts.worker.close()
    assert not found, f"calls back into a module already on the stack: {found}"
