"""`atrlhf score`: responses scored with a run's whole reward, or a trajectory file replayed in its environment;
prints a table or one JSON object."""

from __future__ import annotations

import json
import math
import sys

from rlhf_core.config import TrainConfig

EXIT_FAILED = 1  # as flows.cli: the command ran and failed


def cmd_score(cfg: TrainConfig, input_path: str, as_json: bool = False) -> int:
    """Score the responses of `input_path` with cfg's whole reward (rlhf_core.scoring); 1 on bad input."""
    from rlhf_core.data import DatasetError
    from rlhf_core.model.policy import ModelLoadError
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
        results = score_trajectories(cfg.env, records, cfg.env.workers)
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
