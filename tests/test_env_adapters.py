"""The environments users already have, through `env.adapter` (docs/environments.md, "Adapters"), against the
real libraries: a gem-llm game (gym adapter) and an OpenEnv environment made by `openenv init` and served
locally by its own package (openenv adapter), each trained through rlhf_core.loop.run_sync on the small chat
model from a config with no glue file."""

from __future__ import annotations

import importlib.util
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from rlhf_core.config import ConfigError, load_config, validate_config

needs_gem = pytest.mark.skipif(importlib.util.find_spec("gem") is None, reason="the envs extra (gem-llm) is missing")
GAME = "game:GuessTheNumber-v0-easy"
REPO = Path(__file__).resolve().parents[1]


def adapter_cfg(tmp_path, env: dict, steps: int = 2):
    cfg = load_config(
        None,
        [
            f"run.output_dir={tmp_path}",
            "model.preset=micro-chat",
            "data.task=max3_chat",
            "data.eval_size=2",
            "rollout.max_new_tokens=6",
            "env.max_total_tokens=768",
            f"trainer.total_steps={steps}",
            "trainer.prompts_per_step=2",
            "rollout.samples_per_prompt=2",
            "rollout.prompts_per_batch=2",
            "env.workers=1",
            "eval.every=0",
            "checkpoint.every=0",
        ],
    )
    cfg.env = cfg.env.model_validate(env)
    return cfg


@needs_gem
def test_adapter_config_is_checked():
    gym = {"adapter": "gym", "path": "gem", "name": "make", "kwargs": {"env_id": GAME}}
    assert validate_config({"env": gym}).env.class_name == "GymAdapter"
    assert validate_config({"env": gym}).env.factory == "gem:make"
    tool = [{"path": str(REPO / "examples" / "envs" / "calculator.py"), "name": "add"}]
    cases = [
        ({"adapter": "gym"}, "env.adapter: gym needs env.path (a module or .py file) and env.name"),
        ({"adapter": "gym", "path": "gem"}, "env.adapter: gym needs env.path"),
        ({"adapter": "gym", "path": "no_such_module_xyz", "name": "make"}, "neither an existing .py file nor an"),
        ({"adapter": "gym", "path": "gem", "name": "no_such_thing"}, "defines no 'no_such_thing'"),
        ({"adapter": "gym", "path": "gem", "name": "make", "tools": tool}, "leave env.tools empty"),
        ({"adapter": "gymnasium", "path": "gem", "name": "make"}, "env.adapter"),
    ]
    for env, text in cases:
        with pytest.raises(ConfigError, match="env") as info:
            validate_config({"env": env})
        assert text in str(info.value), (env, str(info.value))


@needs_gem
def test_gym_adapter_seeds_the_episode_from_the_row():
    from rlhf_core.env.adapters import GymAdapter

    def game(row):
        env = GymAdapter("gem:make", {"env_id": GAME})
        opening = env.reset(row)
        return opening, env.env.game_number

    assert game({"index": 3}) == game({"index": 3})
    assert game({"seed": 11, "index": 3}) == game({"seed": 11, "index": 0})
    assert len({game({"index": i})[1] for i in range(8)}) > 1
    env = GymAdapter("gem:make", {"env_id": GAME})
    (opening,) = env.reset({"index": 0})
    assert opening["role"] == "user" and "Guess The Number" in opening["content"]
    observation, reward, done, info = env.step("\\boxed{0}")  # not a valid guess: the game ends
    assert (observation, done) == (None, True) and reward < 0 and isinstance(info, dict)


def test_the_gym_example_runs_in_the_pool():
    """examples/envs/gym_game.py through the adapter, in a spawned environment process, as a run makes it."""
    from rlhf_core.env.pool import EnvPool

    env = validate_config(
        {
            "env": {
                "adapter": "gym",
                "path": f"{REPO}/examples/envs/gym_game.py",
                "name": "CountdownGame",
                "kwargs": {"start": 1},
            }
        }
    ).env
    pool = EnvPool(env.class_path, env.class_name, env.instance_kwargs(), workers=1, timeout_s=10)

    def answer():
        while True:
            replies = pool.poll(10)
            if replies:
                (reply,) = replies
                assert reply.error is None, reply.error
                return reply.value

    try:
        pool.reset(0, {"index": 0})
        assert answer() == [{"role": "user", "content": "Count down from 1, one number per turn. Say 1."}]
        pool.step(0, "1")
        assert answer() == (None, 1.0, True, {"success": True})
    finally:
        pool.close()


@needs_gem
@pytest.mark.slow  # end to end: a whole run_sync on the library's game in the env pool (as the openenv one)
def test_a_gem_game_trains_through_run_sync(tmp_path):
    from rlhf_core.loop import run_sync

    env = {"adapter": "gym", "path": "gem", "name": "make", "kwargs": {"env_id": GAME}, "max_turns": 2}
    seen = []
    result = run_sync(adapter_cfg(tmp_path, env), on_step=seen.append)
    assert result["steps"] == 2 and len(seen) == 2
    for m in seen:
        assert m["env/errors"] == 0 and 1 <= m["env/turns_mean"] <= 2


def rock(observation: str) -> str:
    """A TextArena opponent (env.kwargs.opponent): always rock."""
    assert isinstance(observation, str) and observation
    return "[rock]"


def test_a_textarena_game_plays_with_no_glue():
    """The adapter plays a one-player TextArena game (GuessTheNumber, raw: the game's own messages) to its end
    with the reward of the policy's seat, and a two-player one (IteratedRockPaperScissors) against an opponent
    callable at the other seat; a two-player game without one is refused naming env.kwargs.opponent."""
    pytest.importorskip("textarena", reason="the envs extra (textarena) is not installed")
    from rlhf_core.env.adapters import TextArenaAdapter

    env = TextArenaAdapter("textarena:make", {"env_id": "GuessTheNumber-v0-raw"})
    (opening,) = env.reset({"index": 0})
    assert opening["role"] == "user" and "[GAME] You are Player 0" in opening["content"]
    observation, reward, done, _ = env.step("[10]")
    assert not done and reward == 0.0 and "[Player 0] [10]" in observation and "[GAME] The target" in observation
    assert "You are Player 0" not in observation  # only what is new since the policy's last turn
    for guess in range(1, 21):  # play it out: a win at some guess, or the game ends on its turn limit
        observation, reward, done, _ = env.step(f"[{guess}]")
        if done:
            break
    assert done and observation is None and isinstance(reward, float)
    opponent = f"{__file__}:rock"
    duel = TextArenaAdapter(
        "textarena:make",
        {"env_id": "IteratedRockPaperScissors-v0-raw", "num_players": 2, "player": 1, "opponent": opponent},
    )
    (opening,) = duel.reset({"index": 0})
    assert "You are Player 1" in opening["content"]
    rounds = 0
    while True:
        observation, reward, done, _ = duel.step("[paper]")  # paper beats the opponent's rock every round
        rounds += 1
        if done:
            break
        assert "Round result: Player 1 wins" in observation  # the round the opponent played reached the policy
    assert rounds > 1 and reward > 0, (rounds, reward)
    with pytest.raises(ValueError, match="env.kwargs.opponent"):
        TextArenaAdapter("textarena:make", {"env_id": "IteratedRockPaperScissors-v0-raw", "num_players": 2})


@pytest.mark.slow  # end to end: a whole run_sync on the library's game in the env pool (as the openenv one)
def test_a_textarena_game_trains_through_run_sync(tmp_path):
    pytest.importorskip("textarena", reason="the envs extra (textarena) is not installed")
    from rlhf_core.loop import run_sync

    env = {
        "adapter": "textarena",
        "path": "textarena",
        "name": "make",
        "kwargs": {"env_id": "GuessTheNumber-v0-raw"},
        "max_turns": 2,
    }
    seen = []
    result = run_sync(adapter_cfg(tmp_path, env), on_step=seen.append)
    assert result["steps"] == 2 and len(seen) == 2
    for m in seen:
        assert m["env/errors"] == 0 and 1 <= m["env/turns_mean"] <= 2


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def echo_server(tmp_path_factory):
    """The echo environment `openenv init` makes, its session limit raised as docs/environments.md says, served
    by uvicorn from its own package (no container). Yields (directory, base_url)."""
    pytest.importorskip("openenv", reason="the envs extra (openenv) is not installed")
    root = tmp_path_factory.mktemp("openenv")
    bindir = Path(sys.executable).parent
    subprocess.run(
        [str(bindir / "openenv"), "init", "echo_env"], cwd=root, check=True, capture_output=True, timeout=300
    )
    app = root / "echo_env" / "server" / "app.py"
    app.write_text(app.read_text().replace("max_concurrent_envs=1,", "max_concurrent_envs=8,"))
    port = _free_port()
    log = (root / "server.log").open("w")
    server = subprocess.Popen(
        [sys.executable, "-m", "uvicorn", "echo_env.server.app:app", "--host", "127.0.0.1", "--port", str(port)],
        cwd=root,
        stdout=log,
        stderr=subprocess.STDOUT,
        env={**os.environ, "PYTHONPATH": str(root)},
    )
    try:
        deadline = time.monotonic() + 120
        while "Uvicorn running" not in (root / "server.log").read_text():
            assert server.poll() is None and time.monotonic() < deadline, (root / "server.log").read_text()
            time.sleep(0.2)
        yield root, f"http://127.0.0.1:{port}"
    finally:
        server.terminate()
        server.wait(30)
        log.close()


@pytest.mark.slow
def test_an_openenv_environment_trains_through_run_sync(tmp_path, echo_server, monkeypatch):
    from rlhf_core.loop import build_run, run_sync

    root, url = echo_server
    monkeypatch.syspath_prepend(str(root))  # the client package `openenv init` made (spawned processes inherit it)
    env = {
        "adapter": "openenv",
        "path": "echo_env.client",
        "name": "EchoEnv",
        "kwargs": {"base_url": url},
        "max_turns": 2,
        "max_sessions": 3,
    }
    cfg = adapter_cfg(tmp_path, env)
    parts = build_run(cfg)
    try:
        trajs = parts.worker.env.run(parts.engine, parts.train_prompts[:4], 2, parts.worker.sampling)
        assert [t.error for t in trajs] == [None] * 8
        # the echo server answers each turn with the model's text; the turn limit cuts the episode
        assert all(t.transcript[0].text == "Echo Env environment ready!" and t.turns == 2 for t in trajs)
        assert all(t.truncated and t.cut == "max_turns" for t in trajs)
        assert all(t.transcript[2].text == t.transcript[1].text for t in trajs)
        result = run_sync(cfg, parts=parts)
    finally:
        parts.worker.close()
    assert result["steps"] == 2
    example = load_config(str(REPO / "examples" / "envs" / "openenv_echo.yaml"))  # its factory imports here
    assert example.env.adapter == "openenv" and example.env.class_name == "OpenEnvAdapter"


def test_max_sessions_caps_the_episodes_open_at_once(chat_policy_dir, tmp_path):
    """env.max_sessions=2: of 6 episodes, never more than 2 are open (between reset and close) at once."""
    from rlhf_core.model.policy import load_policy, stop_token_ids
    from rlhf_core.rollout import HFEngine, SamplingParams
    from rlhf_core.rollout.multiturn import EnvRunner
    from tests.test_env import prompts_for

    model, tok = load_policy(chat_policy_dir, dtype="float32", device="cpu")
    stops = stop_token_ids(chat_policy_dir, tok)
    fixtures = str(Path(__file__).parent / "env_fixtures.py")
    env = {"path": fixtures, "name": "ChaosEnv", "kwargs": {"dir": str(tmp_path), "turns": 2}, "max_sessions": 2}
    cfg = validate_config({"env": env})
    runner = EnvRunner(cfg.env, tok, stops, 1)
    open_now, most = set(), [0]
    reset, close = runner.pool.reset, runner.pool.close_episode

    def counting_reset(eid, row):
        open_now.add(eid)
        most[0] = max(most[0], len(open_now))
        reset(eid, row)

    def counting_close(eid):
        open_now.discard(eid)
        close(eid)

    runner.pool.reset, runner.pool.close_episode = counting_reset, counting_close
    try:
        trajs = runner.run(HFEngine(model, stops, tok.pad_token_id, seed=0), prompts_for(tok, 3), 2, SamplingParams(4))
    finally:
        runner.close()
    assert [t.error for t in trajs] == [None] * 6 and all(t.turns == 2 for t in trajs)
    assert most[0] == 2 and not open_now
    (log,) = tmp_path.glob("*.log")
    assert log.read_text().count("open ") == 6 and log.read_text().count("close ") == 6
