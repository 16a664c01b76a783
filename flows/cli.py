"""`atrlhf`: train with the supervised Prefect flow, or score a policy on held-out prompts.

    atrlhf train [--config PATH] [--set key=value ...] [--resume-from RUN_ID_OR_CHECKPOINT]
    atrlhf evaluate --checkpoint PATH_OR_RUN_ID [--config PATH] [--set key=value ...]
    atrlhf score --input FILE.jsonl [--config PATH] [--set key=value ...] [--json]
    atrlhf sweep [--config PATH] [--set key=value ...] --grid key=v1,v2 [--grid ...] [--seeds N]
                 [--max-parallel N] [--metric NAME] [--target ACC] [--sweep-id ID]
    atrlhf serve --checkpoint PATH_OR_RUN_OR_latest [--port N] [--config PATH] [--set key=value ...]

The config is validated before anything else is imported or started: a bad field exits with status 2 and
a message naming it. Prefect, Ray and MLflow are imported inside the commands only, so a bad command line
fails fast without loading them.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Optional

from rlhf_core.config import ConfigError, TrainConfig, load_config, parse_grid_item
from rlhf_core.sweep_grid import check_grid

EXIT_CONFIG = 2
EXIT_FAILED = 1
EXIT_INTERRUPTED = 130

# Quiet, offline defaults for the libraries the commands use; explicit settings in the environment win.
_QUIET_ENV = {
    "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
    "RAY_USAGE_STATS_ENABLED": "0",
    "DO_NOT_TRACK": "1",
    "MLFLOW_DISABLE_TELEMETRY": "true",
    "MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR": "false",
    "MLFLOW_LOGGING_LEVEL": "WARNING",  # MLflow's own INFO lines (another format) say nothing the run does not
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "TOKENIZERS_PARALLELISM": "false",
}


def _overrides(groups: Optional[list[list[str]]]) -> list[str]:
    return [item for group in (groups or []) for item in group]


def _add_config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", metavar="PATH", help="YAML config (default: the built-in tiny demo; see configs/)")
    p.add_argument(
        "--set",
        dest="overrides",
        metavar="KEY=VALUE",
        nargs="+",
        action="append",
        help="override a config field, e.g. --set trainer.total_steps=50 runtime.max_staleness=0",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="atrlhf",
        description="Asynchronous RL fine-tuning of language models "
        "(PPO/GRPO/M2PO) on Ray, supervised by Prefect, tracked in MLflow.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="{train,evaluate,score,sweep,serve}")
    t = sub.add_parser(
        "train",
        help="run the training flow locally (Prefect, Ray, MLflow)",
        description="Run the supervised training flow in this process: a temporary Prefect API "
        "(or PREFECT_API_URL), local Ray (or cluster.address), MLflow in sqlite:///mlflow.db "
        "(or tracking.tracking_uri / MLFLOW_TRACKING_URI).",
    )
    _add_config_args(t)
    t.add_argument(
        "--resume-from",
        metavar="RUN_OR_PATH",
        help="an MLflow run id (continue that run from its newest checkpoint) or a checkpoint directory",
    )
    e = sub.add_parser(
        "evaluate",
        help="score a policy on the held-out prompts",
        description="Greedy held-out accuracy of a checkpoint directory, an exported Hugging Face "
        "directory, or the model an MLflow run logged. The config names the task and the data.",
    )
    _add_config_args(e)
    e.add_argument(
        "--checkpoint",
        required=True,
        metavar="PATH_OR_RUN",
        help="checkpoint directory, exported model directory, or MLflow run id",
    )
    e.add_argument("--json", action="store_true", help="print one JSON object instead of a sentence")
    s = sub.add_parser(
        "score",
        help="score responses by hand with the configured reward",
        description="Score responses with the config's whole reward exactly as training does (the same tokenizer, "
        "stop set, answer tokenization, reward components, reward.functions and reward model) and print the total "
        "and every reward column per line, and the means. "
        "Each JSONL line holds the answer (under data.answer_key, default 'answer'; data.answer_after_marker "
        "applies) and either 'response' (text, tokenized with the model's tokenizer with NO special tokens "
        "added; special-token text such as <|im_end|> in it becomes that token) or 'response_ids' (token ids). "
        "Responses are the generated tokens only, without the prompt; the prompt may be given as a dataset "
        "row gives it (data.prompt_key or data.messages_key): the reward functions and the reward model see it. "
        "Other keys are columns the reward functions get.",
    )
    _add_config_args(s)
    s.add_argument("--input", required=True, metavar="FILE.jsonl", help="responses and answers, one JSON object a line")
    s.add_argument("--json", action="store_true", help="print one JSON object (rows and means) instead of a table")
    w = sub.add_parser(
        "sweep",
        help="run a grid of training runs and compare them (Prefect child flow runs, MLflow parent/child)",
        description="Run every point of the grid (times the seeds) as a child flow run of atrlhf-train, at most "
        "--max-parallel at once; one MLflow parent run with a child run per point; a comparison table and plot "
        "in both UIs. --set applies to every point. Rerunning the same sweep skips the points already finished. "
        "Exits 1 when a point failed (the others still run).",
    )
    _add_config_args(w)
    w.add_argument(
        "--grid",
        action="append",
        required=True,
        metavar="KEY=V1,V2",
        help="a varied config key and its values (parsed like --set values), e.g. --grid algorithm.loss=grpo,m2po",
    )
    w.add_argument("--seeds", type=int, default=1, help="seeds per point: trainer.seed, +1, ... (default 1)")
    w.add_argument("--max-parallel", type=int, default=1, help="points run at once (default 1)")
    w.add_argument("--metric", default="eval/accuracy", help="the metric plotted against steps (default eval/accuracy)")
    w.add_argument("--target", type=float, default=0.9, help="the accuracy of 'time to target' (default 0.9)")
    w.add_argument("--sweep-id", help="name the sweep (default: a hash of the base config, grid and seeds)")
    # --- serve (flows/serve.py) ---
    v = sub.add_parser(
        "serve",
        help="serve a policy on an OpenAI-compatible endpoint (loopback, random key)",
        description="Serve a checkpoint, an exported policy, an MLflow run's logged model or `latest` (run.output_dir/"
        "latest) at http://127.0.0.1:PORT/v1 (chat completions with tools, completions, models) behind a random key; "
        "prints the URL and the key. docs/agents.md.",
    )
    _add_config_args(v)
    v.add_argument(
        "--checkpoint", required=True, metavar="PATH_OR_RUN", help="checkpoint, model directory, run id, latest"
    )
    v.add_argument("--port", type=int, default=0, help="port on 127.0.0.1 (default: a free one)")
    return parser


def _load(args) -> TrainConfig:
    return load_config(args.config, _overrides(args.overrides))


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        cfg = _load(args)
    except ConfigError as exc:
        print(f"atrlhf: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    for key, value in _QUIET_ENV.items():
        os.environ.setdefault(key, value)
    if args.command == "train":
        if cfg.reward.model.path:  # before the Prefect API, Ray or MLflow start
            from rlhf_core.preflight import check_reward_model_config

            try:
                check_reward_model_config(cfg.reward.model.path)
            except ConfigError as exc:
                print(f"atrlhf: {exc}", file=sys.stderr)
                return EXIT_CONFIG
        if args.resume_from:  # a run that already reached total_steps: say so before anything starts
            from tasks.checkpoints import nothing_to_train

            finished = nothing_to_train(cfg, args.resume_from)
            if finished:
                print(f"atrlhf: {finished}", file=sys.stderr)
                return 0
        return cmd_train(cfg, args.resume_from)
    if args.command == "score":
        if cfg.env.enabled:  # a trajectory file, replayed with the environment's rewards
            return cmd_score_trajectories(cfg, args.input, as_json=args.json)
        return cmd_score(cfg, args.input, as_json=args.json)
    if args.command == "sweep":
        try:
            grid = parse_grid(args.grid)
        except ConfigError as exc:
            print(f"atrlhf: {exc}", file=sys.stderr)
            return EXIT_CONFIG
        if args.seeds < 1 or args.max_parallel < 1:
            print("atrlhf: --seeds and --max-parallel must be at least 1", file=sys.stderr)
            return EXIT_CONFIG
        return cmd_sweep(cfg, grid, args.seeds, args.max_parallel, args.metric, args.target, args.sweep_id)
    run_config_overrides = None if args.config else _overrides(args.overrides)  # no --config: the run's own
    if args.command == "serve":
        from flows.serve import cmd_serve

        return cmd_serve(cfg, args.checkpoint, args.port, run_config_overrides)
    return cmd_evaluate(cfg, args.checkpoint, as_json=args.json, run_config_overrides=run_config_overrides)


# ------------------------------------------------------------------------------------------------ train
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


def _quiet_terminal() -> None:
    import logging

    from prefect.logging.handlers import PrefectConsoleHandler

    from tasks.cluster import LOOP_TASKS

    seen = set()
    for name in ("", "prefect", "prefect.task_runs", "prefect.flow_runs"):  # the console handler: root's
        for handler in logging.getLogger(name).handlers:
            if isinstance(handler, PrefectConsoleHandler) and id(handler) not in seen:
                seen.add(id(handler))
                if not any(isinstance(f, _QuietTerminal) for f in handler.filters):
                    handler.addFilter(_QuietTerminal(LOOP_TASKS))
    ray_auth = logging.getLogger("ray._private.authentication.authentication_token_setup")
    if not any(isinstance(f, _NoRayTokenNotice) for f in ray_auth.filters):
        ray_auth.addFilter(_NoRayTokenNotice())


def _startup_line(line: str) -> None:
    print(f"atrlhf: start-up: {line}", file=sys.stderr, flush=True)


def cmd_train(cfg: TrainConfig, resume_from: Optional[str]) -> int:
    """Run the flow in this process. SIGTERM ends it like Ctrl-C: the runtime is torn down, the MLflow run
    ends KILLED, and the temporary Prefect API (when no API is configured) is stopped last."""
    import importlib

    from flows.lifecycle import cli_signals
    from flows.local_api import local_prefect_api

    with cli_signals():
        # the flow's imports (prefect, mlflow through tasks; ray is imported at launch) while the API starts
        with local_prefect_api(
            while_starting=lambda: importlib.import_module("flows.train"), progress=_startup_line
        ) as temporary_api:
            from flows.train import train

            _quiet_terminal()
            try:
                state = train(config=cfg, resume_from=resume_from, return_state=True)
            except KeyboardInterrupt:
                print(
                    "\natrlhf: interrupted; the runtime was torn down and the MLflow run ended KILLED.", file=sys.stderr
                )
                return EXIT_INTERRUPTED
            flow_run_id = str(state.state_details.flow_run_id) if state.state_details.flow_run_id else None
            result = state.result(raise_on_failure=False)
            ok = state.is_completed() and isinstance(result, dict)
            print(_train_summary(cfg, state, result if ok else None, flow_run_id, temporary_api is not None))
    if ok:
        return 0
    if state.is_cancelled():
        return EXIT_INTERRUPTED
    if isinstance(result, BaseException):
        print(f"atrlhf: the run failed: {type(result).__name__}: {result}", file=sys.stderr)
    return EXIT_FAILED


def _console_script(name: str) -> str:
    """`name` as typed from the working directory: the console script beside this interpreter
    (.venv/bin/prefect from the repository root), so the hint runs without the virtualenv on PATH."""
    path = Path(sys.executable).parent / name
    if not path.exists():
        return name
    return os.path.relpath(path) if path.is_relative_to(Path.cwd()) else str(path)


def _prefect_location(flow_run_id: Optional[str], temporary_api: bool = False) -> tuple[str, str]:
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
        f"`{_console_script('prefect')} server start --host 127.0.0.1`, then "
        f"http://127.0.0.1:4200/runs/flow-run/{flow_run_id}",
    )


def _train_summary(
    cfg: TrainConfig, state, result: Optional[dict], flow_run_id: Optional[str], temporary_api: bool = False
) -> str:
    from tasks.mlflow_client import resolve_tracking_uri, ui_command

    where, see = _prefect_location(flow_run_id, temporary_api)
    uri = (result or {}).get("mlflow_tracking_uri") or resolve_tracking_uri(cfg)
    lines = [
        "",
        "=" * 78,
        f"atrlhf train: {state.name}" + (f" — {state.message}" if state.message and not result else ""),
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
        lines += [
            f"  final checkpoint    {result['checkpoint']}",
            f"  exported policy     {result['export']}  (rlhf_core.models.load_policy loads it)",
            f"  MLflow run          {result['mlflow_run_id']}  (experiment '{cfg.tracking.experiment}', {uri})",
        ]
    lines += [
        f"  Prefect flow run    {flow_run_id}  (in {where})",
        f"  Prefect UI          {see}",
        f"  MLflow UI           {ui_command(uri)}  -> http://127.0.0.1:5000",
        "=" * 78,
    ]
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------------ sweep
def parse_grid(items: Sequence[str]) -> dict[str, list]:
    """--grid arguments -> {dotted key: [values]}; a key given twice is an error."""
    grid: dict[str, list] = {}
    for item in items:
        key, values = parse_grid_item(item)
        if key in grid:
            raise ConfigError(f"--grid {key} is given twice; list all its values in one --grid")
        grid[key] = values
    return check_grid(grid)  # a repeated value, say, is refused before anything starts


def cmd_sweep(
    cfg: TrainConfig,
    grid: dict[str, list],
    seeds: int,
    max_parallel: int,
    metric: str,
    target: float,
    sweep_id: Optional[str],
) -> int:
    """Run the sweep flow in this process (against a temporary Prefect API when none is configured)."""
    import importlib

    from flows.lifecycle import cli_signals
    from flows.local_api import local_prefect_api

    with cli_signals():
        with local_prefect_api(
            while_starting=lambda: importlib.import_module("flows.sweep"), progress=_startup_line
        ) as temporary_api:
            from flows.sweep import sweep
            from tasks.mlflow_client import ui_command
            from tasks.mlflow_client.sweep_comparison import table_markdown

            _quiet_terminal()
            try:
                state = sweep(
                    base_config=cfg,
                    grid=grid,
                    seeds=seeds,
                    max_parallel=max_parallel,
                    metric=metric,
                    target=target,
                    sweep_id=sweep_id,
                    return_state=True,
                )
            except KeyboardInterrupt:
                print("\natrlhf: interrupted; the sweep stopped.", file=sys.stderr)
                return EXIT_INTERRUPTED
            flow_run_id = str(state.state_details.flow_run_id) if state.state_details.flow_run_id else None
            result = state.result(raise_on_failure=False)
            ok = isinstance(result, dict)  # a Failed sweep with failed points still carries its table
            where, see = _prefect_location(flow_run_id, temporary_api is not None)
    if not ok:
        print(f"atrlhf: the sweep failed: {type(result).__name__}: {result}", file=sys.stderr)
        return EXIT_CONFIG if isinstance(result, ConfigError) else EXIT_FAILED
    lines = [
        "",
        "=" * 78,
        f"atrlhf sweep {result['sweep_id']}: {result['points']} point(s), {result['ran']} ran, "
        f"{result['skipped']} skipped (finished before), {result['failed']} failed",
        "",
        table_markdown(result["rows"], target),
        f"  MLflow parent run   {result['mlflow_parent_run_id']}  ({result['mlflow_tracking_uri']})",
        f"  MLflow UI           {ui_command(result['mlflow_tracking_uri'])}  -> http://127.0.0.1:5000",
        f"  Prefect flow run    {flow_run_id}  ({state.name}, in {where})",
        f"  Prefect UI          {see}",
        "=" * 78,
    ]
    print("\n".join(lines))
    for row in result["rows"]:
        if row["error"]:
            print(f"atrlhf: point {row['point']} failed: {row['error']}", file=sys.stderr)
    return EXIT_FAILED if result["failed"] else 0


# --------------------------------------------------------------------------------------------- evaluate
def cmd_evaluate(
    cfg: TrainConfig, target: str, as_json: bool = False, run_config_overrides: Optional[list[str]] = None
) -> int:
    """Score `target` (flows.evaluate). `run_config_overrides`: when no --config was given, the --set items (the
    policy's own train_config.yaml, with them, then replaces cfg); None when one was."""
    from flows.evaluate import evaluate
    from rlhf_core.checkpoint import CheckpointError
    from rlhf_core.models import ModelLoadError

    try:
        done = evaluate(cfg, target, run_config_overrides or [], use_run_config=run_config_overrides is not None)
    except ConfigError as exc:
        print(f"atrlhf: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    except (FileNotFoundError, CheckpointError, ModelLoadError) as exc:
        print(f"atrlhf: {exc}", file=sys.stderr)
        return EXIT_FAILED
    cfg, result = done.cfg, done.result
    if done.run_config:
        print(f"atrlhf: using the run's config {done.run_config} (pass --config to use another)", file=sys.stderr)
    if as_json:
        print(json.dumps({"policy": done.policy, **result}))
    else:
        where = f"MLflow run {done.mlflow_run_id}" if done.mlflow_run_id else done.policy
        print(
            f"held-out accuracy {result['eval/accuracy']:.3f} (mean reward {result['eval/reward_mean']:.3f}) on "
            f"{result['eval/prompts']} {cfg.data.task} prompts — {where}"
        )
        if "eval/pass@k" in result:
            print(
                f"sampled: pass@{cfg.eval.k} {result['eval/pass@k']:.3f}, "
                f"mean@{cfg.eval.k} {result['eval/mean@k']:.3f} ({cfg.eval.n_samples} samples per prompt, "
                f"temperature {cfg.eval.temperature:g})"
            )
    return 0


# ------------------------------------------------------------------------------------------------ score
def cmd_score(cfg: TrainConfig, input_path: str, as_json: bool = False) -> int:
    """Score the responses of `input_path` with cfg's whole reward (rlhf_core.scoring); 1 on bad input."""
    from rlhf_core.data import DatasetError
    from rlhf_core.models import ModelLoadError
    from rlhf_core.reward.functions.external import RewardFunctionError
    from rlhf_core.reward.functions.pool import FunctionLoadError
    from rlhf_core.scoring import Scorer, column_means, reward_terms, score_file

    try:
        with Scorer(cfg) as scorer:
            rows, ids, scores = score_file(scorer, input_path)
    except (DatasetError, ModelLoadError, ValueError, RewardFunctionError, FunctionLoadError) as exc:
        print(f"atrlhf: {exc}", file=sys.stderr)
        return EXIT_FAILED
    names = list(scores)  # "total", then every reward column in config order
    means = column_means(scores)
    if as_json:

        def number(v: float):  # JSON has no NaN: a row a function does not apply to is null
            return None if math.isnan(v) else v

        out_rows = [
            {"line": r["line"], "tokens": len(t), **{name: number(scores[name][i]) for name in names}}
            for i, (r, t) in enumerate(zip(rows, ids))
        ]
        mean = {name: number(v) for name, v in means.items()}
        print(json.dumps({"input": str(input_path), "rows": out_rows, "mean": mean, "count": len(rows)}))
        return 0
    weights = " + ".join(f"{w:g} x {name}" for name, w in reward_terms(cfg))
    print(f"{input_path}: {len(rows)} responses; total = {weights}")
    width = max(len(n) for n in names)
    print("  line  tokens  " + "  ".join(f"{n:>{width}}" for n in names))
    for i, (r, t) in enumerate(zip(rows, ids)):
        print(f"{r['line']:>6}  {len(t):>6}  " + "  ".join(f"{scores[n][i]:>{width}.3f}" for n in names))
    print("  mean" + " " * 10 + "  ".join(f"{means[n]:>{width}.3f}" for n in names))
    return 0


def cmd_score_trajectories(cfg: TrainConfig, input_path: str, as_json: bool = False) -> int:
    """With an env: section, `atrlhf score` replays a trajectory file (rlhf_core/env/score.py): each line's
    assistant turns stepped through a fresh environment; prints reward/env, turns and success per line."""
    from rlhf_core.env.pool import EnvLoadError
    from rlhf_core.env.score import read_trajectories, score_trajectories

    try:
        records = read_trajectories(input_path)
        results = score_trajectories(cfg.env, records, cfg.reward.function_workers)
    except (EnvLoadError, OSError, ValueError) as exc:
        print(f"atrlhf: {exc}", file=sys.stderr)
        return EXIT_FAILED
    rows = [{"line": r["line"], **res} for r, res in zip(records, results)]
    mean = sum(r["env_reward"] for r in rows) / len(rows)
    if as_json:
        print(json.dumps({"input": str(input_path), "rows": rows, "mean": {"reward/env": mean}, "count": len(rows)}))
        return 0
    print(f"{input_path}: {len(rows)} trajectories replayed in {cfg.env.class_name}")
    print("  line  reward/env  turns  success  observations_match  error")
    for r in rows:
        print(
            f"{r['line']:>6}  {r['env_reward']:>10.3f}  {r['turns']:>5}  {str(r['success']):>7}  "
            f"{str(r['observations_match']):>18}  {r['error'] or ''}"
        )
    print(f"  mean  {mean:>10.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
