"""Environments the multi-turn tests load by path (tests/test_env.py): not a test module."""

from __future__ import annotations

import asyncio
import os
import random
import sys
import time
from pathlib import Path


class CountEnv:
    """Answers each model turn with 'turn <t>' (the role env.observation_role), reward 1 per step; done after
    `turns` steps; raises at step `fail_at`; sleeps `sleep` seconds per step (in its thread)."""

    def __init__(self, turns: int = 2, fail_at: int = 0, sleep: float = 0.0, reward: float = 1.0):
        self.turns, self.fail_at, self.sleep, self.reward = turns, fail_at, sleep, reward
        self.t = 0
        self.actions: list[str] = []

    def reset(self, row):
        return [{"role": "user", "content": f"count to {row.get('answer', 3)}"}]

    def step(self, action):
        self.t += 1
        self.actions.append(action)
        if self.t == self.fail_at:
            raise ValueError(f"boom at step {self.t}")
        if self.sleep:
            time.sleep(self.sleep)
        return f"turn {self.t}", self.reward, self.t >= self.turns, {"success": self.t >= self.turns}


class AsyncSleepEnv(CountEnv):
    """CountEnv whose step is a coroutine that sleeps `sleep` seconds."""

    async def reset(self, row):
        return row["prompt"]  # the row's own prompt

    async def step(self, action):
        await asyncio.sleep(self.sleep)
        self.t += 1
        return [{"role": "user", "content": f"turn {self.t}"}], self.reward, self.t >= self.turns, {}


class SlowRowEnv(AsyncSleepEnv):
    """AsyncSleepEnv whose steps sleep `slow_s` for the row whose problem is `slow_problem`, none for the others."""

    def __init__(self, slow_problem: int = 0, slow_s: float = 3.0, **kwargs):
        super().__init__(**kwargs)
        self.slow_problem, self.slow_s = slow_problem, slow_s

    async def reset(self, row):
        self.sleep = self.slow_s if row.get("problem") == self.slow_problem else 0.0
        return row["prompt"]


class BlockingEnv(CountEnv):
    """A coroutine step that blocks its event loop (time.sleep): only killing the process stops it."""

    async def step(self, action):
        time.sleep(600)


class BadResultEnv(CountEnv):
    def step(self, action):
        return "obs", "not a number", False, {}


_made = 0


class MarkerEnv:
    """The first instance made in a process is slow: its first step waits until `fast` other trajectories
    have finished (marker files in `dir`). If the driver waited for it before generating the others' turns,
    it would never see them and fail at env.step_timeout_s."""

    def __init__(self, dir: str, fast: int, turns: int = 3):
        global _made
        self.slow = _made == 0
        _made += 1
        self.dir, self.fast, self.turns = Path(dir), fast, turns
        self.t = 0

    def reset(self, row):
        return [{"role": "user", "content": "go"}]

    async def step(self, action):
        self.t += 1
        if self.slow:
            while len(list(self.dir.glob("done-*"))) < self.fast:
                await asyncio.sleep(0.05)
            return None, 1.0, True, {"fast_done_first": True}
        if self.t >= self.turns:
            (self.dir / f"done-{id(self)}").write_text("x")
            return None, 1.0, True, {}
        return "again", 0.0, False, {}


def append_event(dir: Path, event: str, who) -> None:
    """Append '<event> <who> <wall time>' to <dir>/<pid>.log in one write (processes and threads append side by
    side)."""
    fd = os.open(dir / f"{os.getpid()}.log", os.O_WRONLY | os.O_APPEND | os.O_CREAT)
    try:
        os.write(fd, f"{event} {who} {time.time():.6f}\n".encode())
    finally:
        os.close(fd)


class ChaosEnv:
    """Fails at random, seeded per episode (seed, the row's problem, the instance's number in its process). At
    each step, with probability `crash` it kills its process (os._exit), `raises` it raises, `hang` it sleeps
    `hang_s` (past env.step_timeout_s), `bad` it returns a non-string observation; else 'turn <t>', reward 1,
    done after `turns` steps. finish(reason) gives `finish_reward` when set. Every event is appended to
    <dir>/<pid>.log as '<event> <instance>' (open, step, crash, raise, hang, bad, finish-<reason>, close; a
    second close of an instance writes close-again)."""

    made = 0  # instances made in this process

    def __init__(self, dir: str, seed: int = 0, crash=0.0, raises=0.0, hang=0.0, bad=0.0, hang_s=1.0, turns=3, **kw):
        ChaosEnv.made += 1
        self.n, self.uid = ChaosEnv.made, f"{os.getpid()}-{ChaosEnv.made}"
        self.dir, self.seed, self.turns, self.hang_s = Path(dir), seed, turns, hang_s
        self.rates = (crash, raises, hang, bad)
        self.finish_reward = kw.get("finish_reward")
        self.t, self.closed = 0, False
        self.rng = random.Random(0)

    def log(self, event: str) -> None:
        append_event(self.dir, event, self.uid)

    def reset(self, row):
        self.log("open")
        self.rng = random.Random(f"{self.seed}:{row.get('problem', row.get('answer'))}:{self.n}")
        return row["prompt"]

    def step(self, action):
        self.t += 1
        self.log("step")
        u = self.rng.random()
        crash, raises, hang, bad = self.rates
        if u < crash:
            self.log("crash")
            os._exit(17)
        if u < crash + raises:
            self.log("raise")
            raise ValueError(f"injected failure at step {self.t}")
        if u < crash + raises + hang:
            self.log("hang")
            time.sleep(self.hang_s)
        elif u < crash + raises + hang + bad:
            self.log("bad")
            return [{"role": "user", "content": 42}], 0.0, False, {}
        return f"turn {self.t}", 1.0, self.t >= self.turns, {}

    def finish(self, reason):
        self.log(f"finish-{reason}")
        return self.finish_reward

    def close(self):
        self.log("close-again" if self.closed else "close")
        self.closed = True


class CrashOnceEnv(ChaosEnv):
    """The first instance (in any process) to take a step waits until `others` other instances of its process have
    each taken a step, then kills its process; once (the file <dir>/crashed says it happened). Its step is a
    coroutine, as are the others'. Until the crash, an instance's later steps wait for it (the file
    <dir>/crash_logged), so that the `others` are still in mid-episode when it comes, however loaded the machine.
    tag_opening: reset's opening names the process (an environment a replay cannot reproduce)."""

    def __init__(self, dir: str, others: int = 3, tag_opening: bool = False, **kwargs):
        super().__init__(dir, **kwargs)
        self.others, self.tag_opening = others, tag_opening

    def reset(self, row):
        opening = super().reset(row)
        return f"{opening} (process {os.getpid()})" if self.tag_opening else opening  # differs in a new process

    async def step(self, action):
        if self.t == 0:
            try:
                os.close(os.open(self.dir / "crashed", os.O_CREAT | os.O_EXCL))
            except FileExistsError:
                pass
            else:
                log = self.dir / f"{os.getpid()}.log"
                # `others` other instances in mid-episode (each stepped), not `others` steps: one fast episode's
                # three steps would leave the others unopened, and the crash would cost fewer episodes than meant
                while (
                    len({ln.split()[1] for ln in log.read_text().splitlines() if ln.startswith("step ")}) < self.others
                ):
                    await asyncio.sleep(0.005)
                self.log("crash")
                os.close(os.open(self.dir / "crash_logged", os.O_CREAT | os.O_EXCL))
                os._exit(17)
        else:  # mid-episode until the crash: an episode that ended before it would not be restarted (a loaded machine)
            while (self.dir / "crashed").exists() and not (self.dir / "crash_logged").exists():
                await asyncio.sleep(0.005)
        return ChaosEnv.step(self, action)


class CrashBesideWaitersEnv(ChaosEnv):
    """Plain (threaded) steps. On the first step of each instance of a process, before the crash: the last of
    `others` + 1 instances to step kills its process (once: the file <dir>/crashed says it happened) while the
    others are still running theirs (each waits `wait_s`, longer than the crash takes to come): `others` + 1
    calls are running at the death, the crashing one started last. After the crash, steps as ChaosEnv (no failures)."""

    def __init__(self, dir: str, others: int = 3, wait_s: float = 60.0, **kwargs):
        super().__init__(dir, **kwargs)
        self.others, self.wait_s = others, wait_s

    def step(self, action):
        if self.t > 0 or (self.dir / "crashed").exists():
            return ChaosEnv.step(self, action)
        self.log("step")
        if (self.dir / f"{os.getpid()}.log").read_text().count("step ") > self.others:
            try:
                os.close(os.open(self.dir / "crashed", os.O_CREAT | os.O_EXCL))
            except FileExistsError:
                pass
            else:
                self.log("crash")
                os._exit(17)
        time.sleep(self.wait_s)  # the crash comes first: this process dies with the call still running
        self.t += 1
        return f"turn {self.t}", 1.0, self.t >= self.turns, {}


class BadValuesEnv:
    """Returns, for the row whose answer is `k`, the k-th malformed value below (the last one is well formed)."""

    def __init__(self):
        self.k = 0

    def reset(self, row):
        self.k = int(row["answer"])
        return 42 if self.k == 9 else row["prompt"]

    def step(self, action):
        return [
            ([{"role": "user", "content": 42}], 0.0, False, {}),
            ("obs", float("nan"), False, {}),
            ("obs", 0.0, "yes", {}),
            ("obs", 0.0, False, "info"),
            ("x" * 51, 0.0, False, {}),
            (None, 1.0, True, {"success": "False"}),
            ([{"content": "hi"}], 0.0, False, {}),
            ("obs", 0.0, False, {"tool_calls": "two"}),
            (None, 1.0, True, {"success": True}),
        ][self.k]


class RowEnv:
    """Shows the row reset got (info['row'] at its one step) and whether its process imported torch."""

    def reset(self, row):
        self.row = row
        return row["prompt"]

    def step(self, action):
        return None, 0.0, True, {"row": self.row, "torch": "torch" in sys.modules}


class NoStep:
    def reset(self, row):
        return "x"


def add(a: float, b: float) -> float:
    """Add two numbers.

    Args:
        a: The first number.
        b: The second number.
    """
    return a + b


def slow(seconds: float) -> str:
    """Sleep, then say so.

    Args:
        seconds: How long to sleep.
    """
    time.sleep(seconds)
    return "slept"


def divide(a: float, b: float) -> float:
    """Divide a by b.

    Args:
        a: The dividend.
        b: The divisor.
    """
    return a / b


def undocumented(x):
    return x


class HangHalfEnv:
    """Plain (threaded) calls. An instance made for an even row (`problem`) hangs in its first step for
    `hang_s` (past env.step_timeout_s: its thread overruns); an odd one ends at its first step. Its close()
    logs 'close-during-step' when it runs while the instance's step still runs, else 'close'; every event goes
    to <dir>/<pid>.log as '<event> <problem>'."""

    def __init__(self, dir: str, hang_s: float = 600.0):
        self.dir, self.hang_s, self.in_step, self.problem = Path(dir), hang_s, False, -1

    def log(self, event: str) -> None:
        append_event(self.dir, event, self.problem)

    def reset(self, row):
        self.problem = int(row["problem"])
        return row["prompt"]

    def step(self, action):
        self.in_step = True
        try:
            if self.problem % 2 == 0:
                self.log("hang")
                time.sleep(self.hang_s)
            return "done", 1.0, True, {}
        finally:
            self.in_step = False

    def close(self):
        self.log("close-during-step" if self.in_step else "close")
