"""`atrlhf serve`: the agent endpoint (rlhf_core.agent.server) over a trained policy, for evaluation harnesses and
for trying a model by hand with any OpenAI client.

    atrlhf serve --checkpoint <checkpoint dir | exported policy dir | MLflow run id | latest> [--port N]

The policy is found as `atrlhf evaluate` finds it (flows.evaluate.located: a path as it is, an MLflow run id's
logged model downloaded; `latest`: run.output_dir/latest, its exported policy or else its newest checkpoint)
and loaded with the config it was trained with (its train_config.yaml) unless --config is given. The endpoint
listens on 127.0.0.1 behind a random key, printed with the URL; the request's own sampling settings apply.
Ctrl-C or SIGTERM stop it.
"""

from __future__ import annotations

import signal
import sys
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from rlhf_core.config import ConfigError, TrainConfig, load_config

LATEST = "latest"


@dataclass
class Serving:
    server: object  # rlhf_core.agent.server.AgentServer, started
    policy: str  # what is served, in the user's words (a path, or the MLflow run id)
    run_config: Optional[str]  # the run's own config used; None: the given one

    @property
    def url(self) -> str:
        return self.server.base_url

    @property
    def key(self) -> str:
        return self.server.key

    def close(self) -> None:
        self.server.close()


def latest_policy(cfg: TrainConfig) -> Path:
    """run.output_dir/latest (the newest run that produced something): its exported policy, else its newest
    checkpoint. FileNotFoundError says what is missing."""
    from rlhf_core.run.checkpoint import CHECKPOINTS_DIR

    run_dir = Path(cfg.run.output_dir) / LATEST
    if not run_dir.exists():
        raise FileNotFoundError(f"--checkpoint latest: {run_dir} does not exist (no run has checkpointed under it)")
    if (run_dir / "policy" / "config.json").is_file():
        return run_dir / "policy"
    steps = sorted((run_dir / CHECKPOINTS_DIR).glob("step_*"))
    if not steps:
        raise FileNotFoundError(f"--checkpoint latest: {run_dir} holds neither policy/ nor checkpoints/step_*")
    return steps[-1]


def start(
    cfg: TrainConfig, target: str, port: int = 0, overrides: Sequence[str] = (), use_run_config: bool = True
) -> Serving:
    """Load the policy `target` names and start the endpoint over it (module doc)."""
    from flows.evaluate import located
    from rlhf_core.agent.server import AgentServer
    from rlhf_core.policy_eval import policy_to_evaluate
    from rlhf_core.run import build
    from rlhf_core.run.checkpoint import inspect_path, load_checkpoint

    if target == LATEST:
        target = str(latest_policy(cfg))
    with located(cfg, target) as found:
        path, run_id = found.path, found.run_id
        run_config = inspect_path(path).run_config if use_run_config else None
        source = None
        if run_config is not None:
            source = f"the train_config.yaml of MLflow run {run_id}'s logged model" if run_id else str(run_config)
            try:
                cfg = load_config(run_config, list(overrides))
            except ConfigError as exc:
                raise ConfigError(f"the run's own config ({source}) does not load ({exc}); pass --config") from None
        policy_dir, checkpoint = policy_to_evaluate(cfg, path)
        build.setup_process(cfg, cfg.trainer.seed)
        model, tokenizer = build.build_policy(cfg, policy_dir, adapters=checkpoint is not None)
        if checkpoint is not None:
            load_checkpoint(checkpoint, model)
        stop_ids = build.build_stop_ids(cfg, tokenizer, policy_dir)
    engine = build.build_policy_engine(cfg, model, tokenizer, policy_dir, from_checkpoint=checkpoint is not None)
    name = run_id or Path(checkpoint or policy_dir).name
    server = AgentServer(tokenizer, stop_ids, model_name=name, max_context=cfg.env.max_total_tokens, port=port)
    server.serve(engine)
    server.start()
    return Serving(server, run_id or str(checkpoint or policy_dir), source)


def cmd_serve(
    cfg: TrainConfig, target: str, port: int = 0, run_config_overrides: Optional[list[str]] = None, stop=None
) -> int:
    """`atrlhf serve`: start, print the URL and key, serve until Ctrl-C / SIGTERM (or `stop`, an Event, is
    set). `run_config_overrides`: as cmd_evaluate's (None when --config was given)."""
    from rlhf_core.model.policy import ModelLoadError
    from rlhf_core.run.checkpoint import CheckpointError

    try:
        serving = start(cfg, target, port, run_config_overrides or [], use_run_config=run_config_overrides is not None)
    except ConfigError as exc:
        print(f"atrlhf: {exc}", file=sys.stderr)
        return 2
    except (FileNotFoundError, CheckpointError, ModelLoadError, OSError) as exc:
        print(f"atrlhf: {exc}", file=sys.stderr)
        return 1
    if serving.run_config:
        print(f"atrlhf: using the run's config {serving.run_config} (pass --config to use another)", file=sys.stderr)
    print(f"serving {serving.policy} (model {serving.server.model_name!r})", flush=True)
    print(f"  OPENAI_BASE_URL={serving.url}", flush=True)
    print(f"  OPENAI_API_KEY={serving.key}", flush=True)
    print("Ctrl-C stops it.", flush=True)
    stop = stop or threading.Event()
    previous = None
    if threading.current_thread() is threading.main_thread():
        previous = signal.signal(signal.SIGTERM, lambda *_: stop.set())
    try:
        while not stop.wait(0.5):
            pass
    except KeyboardInterrupt:
        pass
    finally:
        serving.close()
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
    return 0
