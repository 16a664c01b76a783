"""Shared fixtures: offline environment, a tiny policy built once per session, its tokenizer and prompts."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

# Set before transformers / ray / prefect are imported anywhere in the test session.
for _key, _value in {
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "TOKENIZERS_PARALLELISM": "false",
    "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
    "RAY_USAGE_STATS_ENABLED": "0",
}.items():
    os.environ.setdefault(_key, _value)

import pytest  # noqa: E402
import torch  # noqa: E402


def pytest_ignore_collect(collection_path, config):
    """With `-m "not slow"` (`make test-fast`), do not even import a module marked slow as a whole: those
    import Prefect, MLflow and Ray at the top (seconds of collection) for tests that would all be deselected."""
    if (
        "not slow" in (config.getoption("markexpr") or "")
        and collection_path.suffix == ".py"
        and collection_path.name.startswith("test_")
        and "\npytestmark = pytest.mark.slow" in collection_path.read_text(encoding="utf-8")
    ):
        return True
    return None


def pytest_collection_modifyitems(session, config, items):
    """Modules with end-to-end (`slow`) tests first, each module's tests kept together and in order: `make test`
    spreads the tests over processes (pytest-xdist, --dist worksteal), and the long runs started first leave the
    short unit tests to fill the other processes' time instead of one long test ending the suite alone. Keeping
    a module contiguous keeps its module-scoped fixtures set up once per process, and the modules on the local Ray
    (`ray_local`) next to each other lets them share one instance (~6 s to start and stop each time)."""
    has_slow = {item.nodeid.split("::")[0] for item in items if item.get_closest_marker("slow") is not None}
    RAY_MODULES.update(item.nodeid.split("::")[0] for item in items if "ray_local" in item.fixturenames)
    # stable: modules stay contiguous, in order; among the slow ones those on the shared Ray first, together
    items.sort(
        key=lambda item: (item.nodeid.split("::")[0] not in has_slow, item.nodeid.split("::")[0] not in RAY_MODULES)
    )


@pytest.fixture(scope="session")
def tiny_policy_dir(tmp_path_factory):
    """A 1-layer, hidden-32 tiny Llama policy and its tokenizer, saved once for the session (read-only use)."""
    from rlhf_core.model.policy import build_tiny_policy

    return build_tiny_policy("max3", tmp_path_factory.mktemp("tiny_policy"), layers=1, hidden=32, heads=2, seed=0)


@pytest.fixture(scope="session")
def chat_policy_dir(tmp_path_factory):
    """A user's real model in miniature: Qwen2 architecture, byte-level BPE tokenizer trained locally, ChatML
    chat template, generation_config.json listing <|im_end|> and <|endoftext|>; tokenizer EOS <|im_end|>."""
    from rlhf_core.model.chat import build_chat_policy

    return build_chat_policy(tmp_path_factory.mktemp("chat_policy"), style="instruct", layers=1, hidden=32, heads=2)


@pytest.fixture(scope="session")
def base_chat_policy_dir(tmp_path_factory):
    """The same chat model with a base-style tokenizer: its EOS is <|endoftext|>, not the turn end <|im_end|>."""
    from rlhf_core.model.chat import build_chat_policy

    return build_chat_policy(tmp_path_factory.mktemp("base_chat_policy"), style="base", layers=1, hidden=32, heads=2)


@pytest.fixture(scope="module")
def tool_policy(tmp_path_factory):
    """(model, tokenizer, stop ids): the chat model (its BPE merges cover the tool turns) taught to answer the
    agents' question with a call to `reveal` (turn 1 of examples/agents/tool_model.py only: a few seconds). One
    per module: tests may train it."""
    from rlhf_core.model.chat import build_chat_policy
    from rlhf_core.model.policy import load_policy, stop_token_ids
    from rlhf_core.usercode import load_attr

    tool_model = str(Path(__file__).resolve().parents[1] / "examples" / "agents" / "tool_model.py")
    out = tmp_path_factory.mktemp("tool_policy")
    corpus = load_attr(tool_model, "corpus", "test")(0)  # 8,192 positions: a framework's own system prompt fits
    build_chat_policy(out, layers=1, hidden=32, heads=2, corpus=corpus, max_positions=8192)
    model, tok = load_policy(out, dtype="float32", device="cpu")
    stops = stop_token_ids(out, tok)
    torch.manual_seed(0)
    pairs = load_attr(tool_model, "examples", "test")(tok, stops, 10, 0, 1)  # turn 1 only
    load_attr(tool_model, "supervised", "test")(model, pairs, 40, 1e-2, 2)
    return model, tok, stops


@pytest.fixture(scope="session")
def tiny_reward_model_dir(tiny_policy_dir, tmp_path_factory):
    """A sequence-classification reward model (LlamaForSequenceClassification, one label, random weights) with
    the tiny policy's architecture and word-level tokenizer: it shares the tiny policy's tokenizer."""
    from rlhf_core.reward.model import build_tiny_reward_model

    return build_tiny_reward_model(tiny_policy_dir, tmp_path_factory.mktemp("tiny_reward_model"), seed=1)


@pytest.fixture(scope="session")
def chat_reward_model_dir(chat_policy_dir, tmp_path_factory):
    """A Qwen2ForSequenceClassification reward model with the chat fixture's byte-level BPE tokenizer and ChatML
    template: for the tiny (word-level) policy it has its own tokenizer."""
    from rlhf_core.reward.model import build_tiny_reward_model

    return build_tiny_reward_model(chat_policy_dir, tmp_path_factory.mktemp("chat_reward_model"), seed=2)


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny_policy_dir):
    from rlhf_core.model.policy import load_policy

    _, tok = load_policy(tiny_policy_dir, dtype="float32", device="cpu")
    return tok


@pytest.fixture
def tiny_model(tiny_policy_dir):
    """A fresh copy of the tiny policy (tests may train or overwrite it)."""
    from rlhf_core.model.policy import load_policy

    model, _ = load_policy(tiny_policy_dir, dtype="float32", device="cpu")
    return model


@pytest.fixture(scope="session")
def max3_prompts(tiny_tokenizer):
    """(train, heldout) prompts of the max3 task, heldout capped at 50."""
    from rlhf_core.data import build_synthetic_task

    return build_synthetic_task("max3", tiny_tokenizer, heldout_frac=0.2, seed=0, eval_size=50)


@pytest.fixture(autouse=True)
def _seeded():
    """Every test starts from the same global torch RNG state (and leaves threads as it found them)."""
    threads = torch.get_num_threads()
    torch.manual_seed(0)
    yield
    torch.set_num_threads(threads)


RAY_MODULES: set[str] = set()  # the modules (node ids) with a test on `ray_local`, filled at collection
_RAY_STARTED: list[bool] = []  # whether the Ray now up in this process is the one `ray_local` started


def _shut_down_our_ray() -> None:
    if _RAY_STARTED:
        import ray

        if ray.is_initialized():
            ray.shutdown()
        _RAY_STARTED.clear()


@pytest.fixture(scope="module", autouse=True)
def _no_shared_ray_outside_its_modules(request):
    """A module that does not use `ray_local` finds no Ray up in its process, as if each Ray module had stopped its
    own: the shared instance is stopped before it (its runs start their own, or none; tests/test_threaded_host.py
    checks that the threads host started none)."""
    if request.node.nodeid not in RAY_MODULES:
        _shut_down_our_ray()
    yield


@pytest.fixture(scope="session")
def _ray_session():
    yield
    _shut_down_our_ray()


@pytest.fixture(scope="module")
def ray_local(_ray_session):
    """One local Ray (2 CPUs) per test process, shared by consecutive modules that use it (collection puts them
    next to each other); a runtime joins it and kills only its own actors. A module that leaves an actor alive
    gets it stopped, so that the next module starts on a fresh instance."""
    import ray

    if not ray.is_initialized():
        ray.init(address="local", num_cpus=2, include_dashboard=False, configure_logging=False, log_to_driver=False)
        _RAY_STARTED.append(True)
    yield
    if _RAY_STARTED and ray.is_initialized():
        from ray._private import state

        if any(info["State"] != "DEAD" for info in state.actors().values()):
            _shut_down_our_ray()


# ---------------------------------------------------------------------------------------- Prefect server
PREFECT = str(Path(sys.executable).with_name("prefect"))
POOL = "atrlhf-local"


def _start_in_session(cmd: list[str], env: dict, cwd: Path, log_path: Path):
    """A `prefect` command in its own session (so `_stop` can signal its whole group), output to log_path.
    Returns (process, the open log file)."""
    log = open(log_path, "w")
    return subprocess.Popen(cmd, env=env, cwd=cwd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True), log


def _stop(proc: subprocess.Popen, log=None, grace_s: float = 5) -> None:
    """Stop a process we started in its own session: SIGINT (graceful for prefect), then SIGKILL its group. The
    session's server and worker are thrown away with their temporary home, so a stop that takes longer than grace_s
    is not waited for (after a whole suite the Prefect worker did not stop within 15 s of SIGINT); `log` says so."""
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGINT)
            proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            if log is not None:
                log.write(f"\n[conftest] not stopped {grace_s} s after SIGINT: killed\n")
        except ProcessLookupError:
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait(timeout=30)


def _prefect(args: list[str], env: dict, timeout: float = 180) -> subprocess.CompletedProcess:
    return subprocess.run(
        [PREFECT, *args],
        env=env,
        cwd=Path(__file__).resolve().parents[1],
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.fixture(scope="session")
def prefect_server(tmp_path_factory):
    """ONE real Prefect server on 127.0.0.1 (free port, temp PREFECT_HOME) for the whole session: starting one
    (database migrations) costs 15-30 s on this machine, once instead of once per module. Tests that need an
    API take `prefect_api` (this server as the test process's API for a module) or pass `env` to the commands
    they start. Each test filters what it reads by its own flow run, deployment or run directory."""
    from flows.local_api import _free_port, _wait_healthy

    home = tmp_path_factory.mktemp("prefect_home")
    port = _free_port()
    url = f"http://127.0.0.1:{port}/api"
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    env.update(
        {
            "PREFECT_HOME": str(home),
            "PREFECT_API_URL": url,
            "PREFECT_UI_ENABLED": "false",
            "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
            "PREFECT_WORKER_QUERY_SECONDS": "1",
            "PREFECT_WORKER_PREFETCH_SECONDS": "1",
            "PREFECT_LOGGING_LEVEL": "INFO",
            # flows join a Ray started by a test: a driver joining a local cluster needs token mode to present
            # the cluster's token (~/.ray/auth_token)
            "RAY_AUTH_MODE": "token",
        }
    )
    proc, log = _start_in_session(
        [PREFECT, "server", "start", "--host", "127.0.0.1", "--port", str(port)], env, home, home / "server.log"
    )
    try:
        try:  # healthy within 300 s, the process alive meanwhile (the CLI's temporary API uses the same wait)
            _wait_healthy(url, proc, 300)
        except RuntimeError as exc:
            raise AssertionError(f"{exc}\n{(home / 'server.log').read_text()[-3000:]}") from None
        yield {"url": url, "env": env, "home": home}
    finally:
        from flows.local_api import _drain_prefect_workers

        _drain_prefect_workers()  # send what Prefect still holds while the server answers, not at exit
        _stop(proc, log)
        log.close()


@pytest.fixture(scope="session")
def prefect_home_template(prefect_server, tmp_path_factory):
    """A PREFECT_HOME whose database is migrated: a consistent copy (sqlite's backup API, safe while the server
    writes) of the session server's. A temporary API on a fresh home spends ~12 s on the migrations first (22 s
    against 10 s to answer, 2026-12-01); a user's ~/.prefect already has its database, as a copy of this does."""
    import sqlite3

    home = tmp_path_factory.mktemp("prefect_home_template")
    src, dst = sqlite3.connect(prefect_server["home"] / "prefect.db"), sqlite3.connect(home / "prefect.db")
    with dst:
        src.backup(dst)
    src.close()
    dst.close()
    return home


@pytest.fixture(scope="session")
def _mlflow_db_template(tmp_path_factory):
    """An MLflow SQLite store with its tables made (~3 s for each fresh database on this machine; a copy opens
    in 0.1 s). Made once for the whole run: the pytest-xdist workers share it (their temporary directories have
    one parent), the first to need it makes it under a lock and the others wait for it."""
    import fcntl

    from mlflow.tracking import MlflowClient

    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent
    folder = root / "mlflow_template"
    folder.mkdir(exist_ok=True)
    path = folder / "mlflow.db"
    with open(folder / "lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not path.exists():
            made = folder / "making.db"
            made.unlink(missing_ok=True)
            MlflowClient(f"sqlite:///{made}").search_experiments()
            os.replace(made, path)  # whole or absent: a worker that failed to make it leaves no half of one
    return path


@pytest.fixture
def mlflow_db(_mlflow_db_template, tmp_path):
    """tmp_path / 'mlflow.db': a fresh, empty MLflow store (a copy of the session's template) for a test's run."""
    import shutil

    return Path(shutil.copyfile(_mlflow_db_template, tmp_path / "mlflow.db"))


@pytest.fixture(scope="module")
def prefect_api(prefect_server):
    """The session's Prefect server as this process's API for one module (`temporary_settings`)."""
    import contextlib

    import prefect.context
    from prefect.settings import PREFECT_API_URL, temporary_settings

    with contextlib.ExitStack() as stack:
        stack.enter_context(temporary_settings({PREFECT_API_URL: prefect_server["url"]}))
        # also as the process-global settings context, as prefect_test_harness does: a flow run in a thread
        # (the cancel tests) starts from that, not from this thread's context
        global_context = getattr(prefect.context, "_temporary_global_settings_context", None)  # private, 3.8 on
        if global_context is not None:
            stack.enter_context(global_context(prefect.context.get_settings_context()))
        else:  # Prefect 3.7 (beside vLLM: fastapi < 0.137): a thread's settings fall back to GLOBAL_SETTINGS_CONTEXT
            saved = prefect.context.GLOBAL_SETTINGS_CONTEXT
            prefect.context.GLOBAL_SETTINGS_CONTEXT = prefect.context.get_settings_context()
            stack.callback(setattr, prefect.context, "GLOBAL_SETTINGS_CONTEXT", saved)
        yield prefect_server


@pytest.fixture(scope="session")
def prefect_deployed(prefect_server, tmp_path_factory):
    """`prefect work-pool create` + `prefect deploy --all` from prefect.yaml on the session's server, and a
    `process` worker, once for the session (tests/test_deployment.py, tests/test_sweep_deployment.py)."""
    env = prefect_server["env"]
    created = _prefect(["work-pool", "create", POOL, "--type", "process"], env)
    assert created.returncode == 0, created.stdout + created.stderr
    deploy = _prefect(["--no-prompt", "deploy", "--all"], env)
    assert deploy.returncode == 0, deploy.stdout[-3000:] + deploy.stderr[-3000:]
    logdir = tmp_path_factory.mktemp("worker")
    worker, log = _start_in_session(
        [PREFECT, "worker", "start", "--pool", POOL, "--type", "process"], env, logdir, logdir / "worker.log"
    )
    try:
        yield {"worker_log": logdir / "worker.log"}
    finally:
        _stop(worker, log)
        log.close()


def drive(run, timeout_s: float = 240.0) -> list[dict]:
    """Start a launched DistributedRun's loops and poll until its trainer reaches cfg.trainer.total_steps; stop
    the loops and return every step's metrics (in lockstep at runtime.max_staleness 0, as any run)."""
    import time

    run.start()
    metrics: list[dict] = []
    deadline = time.monotonic() + timeout_s
    while True:
        poll = run.poll()
        metrics.extend(poll["metrics"])
        if poll["done"]:
            break
        assert time.monotonic() < deadline, f"the run did not reach its last step within {timeout_s:g} s"
        time.sleep(0.1)
    run.stop()
    metrics.extend(run.poll()["metrics"])
    return sorted(metrics, key=lambda m: m["step"])
