"""`atrlhf`: train with the supervised Prefect flow, or score a policy on held-out prompts.

    atrlhf train [--config PATH] [--set key=value ...] [--resume-from RUN_ID_OR_CHECKPOINT]
    atrlhf evaluate --checkpoint PATH_OR_RUN_ID [--config PATH] [--set key=value ...]
    atrlhf score --input FILE.jsonl [--config PATH] [--set key=value ...] [--json]
    atrlhf sweep [--config PATH] [--set key=value ...] --grid key=v1,v2 [--grid ...] [--seeds N]
                 [--max-parallel N] [--metric NAME] [--target ACC] [--sweep-id ID] [--shared-fleet]
    atrlhf serve --checkpoint PATH_OR_RUN_OR_latest [--port N] [--config PATH] [--set key=value ...]
    atrlhf audit RUN_DIR_OR_RUN_ID_OR_latest [--config PATH] [--json]

The config is validated before anything else is imported or started: a bad field exits with status 2 and
a message naming it; so does every path and name it uses (model, data, resume target, LoRA target modules,
sweep grid, reward functions and environment: flows/checks.py), each with one line, nothing created. Prefect,
Ray and MLflow are imported inside the commands only, so a bad command line fails fast without loading them.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Optional

from flows.checks import check_evaluate, check_sweep, check_train, parse_grid
from flows.score import cmd_score, cmd_score_trajectories
from flows.terminal import (
    RUN_LOG,
    RunLog,
    failure_line,
    prefect_location,
    quiet_terminal,
    startup_line,
    sweep_summary,
    train_summary,
)
from flows.terminal import train_summary as _train_summary  # noqa: F401 (the name tests import)
from rlhf_core.config import ConfigError, TrainConfig, load_config

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
    sub = parser.add_subparsers(dest="command", required=True, metavar="{train,evaluate,score,sweep,serve,scale}")
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
        help="an MLflow run id (continue that run from its newest checkpoint), a checkpoint directory, or a run "
        "directory (its newest checkpoint: runs/tiny/latest continues the newest run); without --config, with the "
        "run's own config (its checkpoint's train_config.yaml), the --set items on top",
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
        help="checkpoint directory, exported model directory, run directory (its exported policy, else its newest "
        "checkpoint: runs/tiny/latest) or MLflow run id (its logged model, else its newest checkpoint)",
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
        "row gives it (data.prompt_key, or a row's messages): the reward functions and the reward model see it. "
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
    w.add_argument(
        "--shared-fleet",
        action="store_true",
        help="run every point at once on one base model, one rollout engine and one trainer process (LoRA points "
        "that differ only in what an adapter run may: lora, trainer, algorithm, reward, staleness bound)",
    )
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
    # --- scale (flows/scale.py) ---
    c = sub.add_parser(
        "scale",
        help="change the number of rollout workers of a live run",
        description="Ask a running training run for N rollout workers: the run's supervision applies it at its next "
        "poll (a health event in the Prefect UI, cluster/rollout_workers in MLflow) and this command prints its "
        "answer. Refused while the run's cluster.autoscale is enabled. docs/cluster.md.",
    )
    c.add_argument("run", metavar="RUN_DIR_OR_RUN_ID", help="the run's directory (runs/tiny/latest) or MLflow run id")
    c.add_argument("--rollout-workers", type=int, required=True, metavar="N", help="rollout workers wanted (>= 1)")
    c.add_argument("--tracking-uri", help="MLflow tracking URI of a run id (default MLFLOW_TRACKING_URI, ./mlflow.db)")
    c.add_argument("--wait-s", type=float, default=30.0, help="seconds to wait for the run's answer (default 30)")
    a = sub.add_parser("audit", help="print a run's audit: what each configured mechanism did (flows/audit.py)")
    a.add_argument("run", metavar="RUN_DIR_OR_RUN_ID", help="the run's directory, MLflow run id, or latest")
    a.add_argument("--config", help="the YAML whose run.output_dir holds `latest` (default: the embedded defaults)")
    a.add_argument("--tracking-uri", help="MLflow tracking URI of a run id (default MLFLOW_TRACKING_URI, ./mlflow.db)")
    a.add_argument("--json", action="store_true", help="print the audit as JSON")
    return parser


def _load(args) -> TrainConfig:
    return load_config(args.config, _overrides(args.overrides))


def _refuse(exc: ConfigError) -> int:
    print(f"atrlhf: {exc}", file=sys.stderr)
    return EXIT_CONFIG


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "scale":  # a request to a live run: no config of its own
        from flows.scale import cmd_scale

        return cmd_scale(args.run, args.rollout_workers, args.tracking_uri, args.wait_s)
    if args.command == "audit":  # reads what a run wrote
        from flows.audit import cmd_audit

        try:
            output_dir = load_config(args.config).run.output_dir if args.config else TrainConfig().run.output_dir
        except ConfigError as exc:
            return _refuse(exc)
        return cmd_audit(args.run, output_dir, args.tracking_uri, as_json=args.json)
    try:
        cfg = _load(args)
    except ConfigError as exc:
        return _refuse(exc)
    for key, value in _QUIET_ENV.items():
        os.environ.setdefault(key, value)
    if args.command == "train":
        try:  # every path and name, before the Prefect API, Ray or MLflow start (flows/checks.py)
            resume_from = check_train(cfg, args.resume_from)
            if resume_from and not args.config:  # the run continues with its own config, the --set items on top
                from tracking.resume import resume_config

                cfg, source = resume_config(cfg, resume_from, _overrides(args.overrides))
                if source:
                    print(f"atrlhf: using the run's config, {source} (pass --config to use another)", file=sys.stderr)
                    check_train(cfg, None)
        except ConfigError as exc:
            return _refuse(exc)
        if resume_from:  # a run that already reached total_steps: say so before anything starts
            from tracking.resume import nothing_to_train

            finished = nothing_to_train(cfg, resume_from)
            if finished:
                print(f"atrlhf: {finished}", file=sys.stderr)
                return 0
        return cmd_train(cfg, resume_from)
    if args.command == "score":
        if cfg.env.enabled:  # a trajectory file, replayed with the environment's rewards
            return cmd_score_trajectories(cfg, args.input, as_json=args.json)
        return cmd_score(cfg, args.input, as_json=args.json)
    if args.command == "sweep":
        if args.seeds < 1 or args.max_parallel < 1:
            print("atrlhf: --seeds and --max-parallel must be at least 1", file=sys.stderr)
            return EXIT_CONFIG
        try:  # every value of the grid and every point, before any point starts
            grid = parse_grid(args.grid)
            check_sweep(cfg, grid, args.seeds, shared_fleet=args.shared_fleet)
        except ConfigError as exc:
            return _refuse(exc)
        return cmd_sweep(
            cfg, grid, args.seeds, args.max_parallel, args.metric, args.target, args.sweep_id, args.shared_fleet
        )
    try:
        if args.checkpoint == "latest":  # run.output_dir/latest: its exported policy, else its newest checkpoint
            from flows.serve import latest_policy

            try:
                args.checkpoint = str(latest_policy(cfg))
            except FileNotFoundError as exc:
                raise ConfigError(str(exc)) from None
        check_evaluate(cfg, args.checkpoint, config_given=bool(args.config))
    except ConfigError as exc:
        return _refuse(exc)
    run_config_overrides = None if args.config else _overrides(args.overrides)  # no --config: the run's own
    if args.command == "serve":
        from flows.serve import cmd_serve

        return cmd_serve(cfg, args.checkpoint, args.port, run_config_overrides)
    return cmd_evaluate(cfg, args.checkpoint, as_json=args.json, run_config_overrides=run_config_overrides)


# ------------------------------------------------------------------------------------------------ train
def cmd_train(cfg: TrainConfig, resume_from: Optional[str]) -> int:
    """Run the flow in this process. SIGTERM ends it like Ctrl-C: the runtime is torn down, the MLflow run
    ends KILLED, and the temporary Prefect API (when no API is configured) is stopped last. Everything the run
    logs, and its Ray workers print, goes in full to <run dir>/train.log; the terminal gets one line a failure."""
    import importlib

    from flows.lifecycle import cli_signals, raise_if_signalled
    from flows.local_api import local_prefect_api

    with cli_signals():
        # the flow's imports (prefect, mlflow through tasks; ray is imported at launch) while the API starts
        with local_prefect_api(
            while_starting=lambda: importlib.import_module("flows.train"), progress=startup_line
        ) as temporary_api:
            from flows.train import train

            quiet_terminal()
            cfg, flow = _named_run(cfg, train)
            run_log = RunLog(cfg.run.run_dir / RUN_LOG)
            with run_log:
                try:
                    state = raise_if_signalled(flow(config=cfg, resume_from=resume_from, return_state=True))
                except KeyboardInterrupt:
                    print(
                        "\natrlhf: interrupted; the runtime was torn down and the MLflow run ended KILLED. "
                        + _where_it_stopped(cfg),
                        file=sys.stderr,
                    )
                    return EXIT_INTERRUPTED
            flow_run_id = str(state.state_details.flow_run_id) if state.state_details.flow_run_id else None
            result = state.result(raise_on_failure=False)
            ok = state.is_completed() and isinstance(result, dict)
            print(train_summary(cfg, state, result if ok else None, flow_run_id, temporary_api is not None))
    if ok:
        return 0
    if state.is_cancelled():
        return EXIT_INTERRUPTED
    if isinstance(result, BaseException):
        log = f" (the full trace: {run_log.path})" if run_log.written() else ""
        print(f"atrlhf: the run failed: {failure_line(result)}{log}", file=sys.stderr)
    return EXIT_FAILED


def _named_run(cfg: TrainConfig, train):
    """(cfg, flow): the run's directory named here, as the flow would name it (<UTC time>-<flow run name>), so that
    its log file is known before the flow starts; a run.name the user set stays."""
    if cfg.run.name:
        return cfg, train
    from prefect.utilities.names import generate_slug

    from rlhf_core.run.preflight import default_run_name

    flow_run_name = generate_slug(2)
    cfg = cfg.model_copy(deep=True)
    cfg.run.name = default_run_name(flow_run_name)
    return cfg, train.with_options(flow_run_name=flow_run_name)


def _where_it_stopped(cfg: TrainConfig) -> str:
    """After Ctrl-C: what to resume or evaluate (the run's newest checkpoint), in the user's words."""
    from rlhf_core.run.checkpoint_paths import newest_checkpoint

    run_dir = cfg.run.run_dir
    newest = newest_checkpoint(run_dir) if run_dir.is_dir() else None
    if newest is None:
        return "It wrote no checkpoint."
    return (
        f"Its newest checkpoint is {newest}: --resume-from {run_dir} continues it, "
        f"evaluate --checkpoint {run_dir} scores it."
    )


# ------------------------------------------------------------------------------------------------ sweep
def cmd_sweep(
    cfg: TrainConfig,
    grid: dict[str, list],
    seeds: int,
    max_parallel: int,
    metric: str,
    target: float,
    sweep_id: Optional[str],
    shared_fleet: bool = False,
) -> int:
    """Run the sweep flow in this process (against a temporary Prefect API when none is configured); everything it
    logs goes in full to <run.output_dir>/<sweep id>/sweep.log, the terminal gets one line a failed point."""
    import importlib

    from flows.lifecycle import cli_signals, raise_if_signalled
    from flows.local_api import local_prefect_api
    from rlhf_core.sweep_grid import seed_list
    from rlhf_core.sweep_grid import sweep_id as make_sweep_id

    sweep_id = sweep_id or make_sweep_id(cfg, grid, seed_list(cfg, seeds))  # the flow's own, known before it runs
    with cli_signals():
        with local_prefect_api(
            while_starting=lambda: importlib.import_module("flows.sweep"), progress=startup_line
        ) as temporary_api:
            from flows.sweep import sweep

            quiet_terminal()
            run_log = RunLog(Path(cfg.run.output_dir) / sweep_id / "sweep.log")
            with run_log:
                try:
                    state = sweep(
                        base_config=cfg,
                        grid=grid,
                        seeds=seeds,
                        max_parallel=max_parallel,
                        metric=metric,
                        target=target,
                        sweep_id=sweep_id,
                        shared_fleet=shared_fleet,
                        return_state=True,
                    )
                    raise_if_signalled(state)
                except KeyboardInterrupt:
                    print("\natrlhf: interrupted; the sweep stopped.", file=sys.stderr)
                    return EXIT_INTERRUPTED
            flow_run_id = str(state.state_details.flow_run_id) if state.state_details.flow_run_id else None
            result = state.result(raise_on_failure=False)
            ok = isinstance(result, dict)  # a Failed sweep with failed points still carries its table
            where, see = prefect_location(flow_run_id, temporary_api is not None)
    log = f" (the full trace: {run_log.path})" if run_log.written() else ""
    if not ok:
        print(f"atrlhf: the sweep failed: {failure_line(result)}{log}", file=sys.stderr)
        return EXIT_CONFIG if isinstance(result, ConfigError) else EXIT_FAILED
    print(sweep_summary(result, target, f"{flow_run_id}  ({state.name}, in {where})", see))
    for row in result["rows"]:
        if row["error"]:
            print(f"atrlhf: point {row['point']} failed: {failure_line(row['error'])}{log}", file=sys.stderr)
    return EXIT_FAILED if result["failed"] else 0


# --------------------------------------------------------------------------------------------- evaluate
def cmd_evaluate(
    cfg: TrainConfig, target: str, as_json: bool = False, run_config_overrides: Optional[list[str]] = None
) -> int:
    """Score `target` (flows.evaluate). `run_config_overrides`: when no --config was given, the --set items (the
    policy's own train_config.yaml, with them, then replaces cfg); None when one was."""
    from flows.evaluate import evaluate
    from rlhf_core.model.policy import ModelLoadError
    from rlhf_core.run.checkpoint import CheckpointError
    from rlhf_core.run.evaluation import failed_episodes

    try:
        done = evaluate(cfg, target, run_config_overrides or [], use_run_config=run_config_overrides is not None)
    except ConfigError as exc:
        print(f"atrlhf: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    except (FileNotFoundError, CheckpointError, ModelLoadError) as exc:
        print(f"atrlhf: {exc}", file=sys.stderr)
        return EXIT_FAILED
    cfg, result = done.cfg, done.result
    if done.note:  # a run directory or an MLflow run without an exported policy: its newest checkpoint
        print(f"atrlhf: scoring {done.note}", file=sys.stderr)
    if done.run_config:
        print(f"atrlhf: using the run's config {done.run_config} (pass --config to use another)", file=sys.stderr)
    if as_json:
        print(json.dumps({"policy": done.policy, **result}))
    else:
        where = f"MLflow run {done.mlflow_run_id}" if done.mlflow_run_id else done.policy
        print(
            f"held-out {'accuracy' if cfg.eval.metric == 'accuracy' else 'mean ' + cfg.eval.metric} "
            f"{result['eval/accuracy']:.3f} (mean reward {result['eval/reward_mean']:.3f}) on "
            f"{result['eval/prompts']} {cfg.data.task} prompts — {where}{failed_episodes(result)}"
        )
        if "eval/pass@k" in result:
            print(
                f"sampled: pass@{cfg.eval.k} {result['eval/pass@k']:.3f}, "
                f"mean@{cfg.eval.k} {result['eval/mean@k']:.3f} ({cfg.eval.n_samples} samples per prompt, "
                f"temperature {cfg.eval.temperature:g})"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
