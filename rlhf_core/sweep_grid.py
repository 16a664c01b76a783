"""A sweep's points: a grid of config values times seeds, each point a training run's config.

`expand_grid` says what the points are, `sweep_id` names the sweep (a hash: a rerun with the same base
config, grid and seeds finds the same sweep), `point_config` gives a point's config (its own output
directory and run name), `check_points` validates every value and every point before any point starts.
Plain Python on the config: no Prefect, no MLflow (flows/sweep.py runs the points; tracking/
records them).
"""

from __future__ import annotations

import hashlib
import itertools
import json
from dataclasses import dataclass
from typing import Any

from rlhf_core.config import ConfigError, TrainConfig, apply_overrides, migrate_config, validate_config
from rlhf_core.run.fleet_config import check_shareable, fleet_base

SEED_KEY = "trainer.seed"


@dataclass(frozen=True)
class SweepPoint:
    """One training run of a sweep: the varied values (grid order) and its trainer.seed."""

    values: tuple[tuple[str, Any], ...]
    seed: int

    @property
    def name(self) -> str:
        """Readable and unique in the sweep: `algorithm.loss=m2po,runtime.max_staleness=4,seed=1`."""
        return ",".join([*(f"{k}={value_text(v)}" for k, v in self.values), f"seed={self.seed}"])

    @property
    def label(self) -> str:
        """The name with each key shortened to its last part where that stays unambiguous:
        `loss=m2po,max_staleness=4,seed=1`."""
        short = [k.rsplit(".", 1)[-1] for k, _ in self.values]
        keys = [s if short.count(s) == 1 and s != "seed" else k for s, (k, _) in zip(short, self.values)]
        return ",".join([*(f"{k}={value_text(v)}" for k, (_, v) in zip(keys, self.values)), f"seed={self.seed}"])

    def run_name(self, sweep: str) -> str:
        """The child's MLflow run and Prefect flow run name: the varied values first, so that names cut short
        in a UI's column still differ (`max_staleness=4,seed=1 (sweep-0a1b2c3d4e)`)."""
        return f"{self.label} ({sweep})"

    @property
    def dirname(self) -> str:
        """The name as a directory name (no '/', no '=')."""
        return "".join(c if c.isalnum() or c in "-_." else "_" for c in self.name.replace("=", "-"))

    @property
    def group(self) -> str:
        """The point without its seed: what the plot averages over seeds."""
        return ",".join(f"{k}={value_text(v)}" for k, v in self.values) or "base"


def value_text(value: Any) -> str:
    """A grid value as text: a string as it is, anything else as JSON."""
    return value if isinstance(value, str) else json.dumps(value)


def seed_list(base: TrainConfig, seeds: int | list[int]) -> list[int]:
    """`seeds` as a count (base trainer.seed, +1, +2, ...) or an explicit list."""
    if isinstance(seeds, bool) or not isinstance(seeds, (int, list)):
        raise ConfigError(f"sweep seeds: expected a count or a list of integers, got {seeds!r}")
    if isinstance(seeds, int):
        if seeds < 1:
            raise ConfigError(f"sweep seeds: the count must be at least 1, got {seeds}")
        return [base.trainer.seed + i for i in range(seeds)]
    if not seeds or not all(isinstance(s, int) and not isinstance(s, bool) for s in seeds):
        raise ConfigError(f"sweep seeds: expected a non-empty list of integers, got {seeds!r}")
    _refuse_repeated([str(s) for s in seeds], seeds, "sweep seeds: ", " listed", each="seed")
    return list(seeds)


def check_grid(grid: dict[str, list]) -> dict[str, list]:
    """A grid is {dotted.key: [values]}. Only its shape is checked here: `check_points` validates the values."""
    if not isinstance(grid, dict):
        raise ConfigError(f"sweep grid: expected a mapping of dotted keys to lists of values, got {grid!r}")
    for key, values in grid.items():
        if not isinstance(key, str) or not key or any(not part for part in key.split(".")):
            raise ConfigError(f"sweep grid: {key!r} is not a dotted config key such as runtime.max_staleness")
        if not isinstance(values, list) or not values:
            raise ConfigError(f"sweep grid: {key} needs a non-empty list of values, got {values!r}")
        if key == SEED_KEY:
            raise ConfigError(f"sweep grid: vary {SEED_KEY} with `seeds`, not in the grid")
        _refuse_repeated([value_text(v) for v in values], values, f"sweep grid: {key} lists ", "")
    return grid


def _refuse_repeated(texts: list[str], values: list, before: str, after: str, each: str = "value") -> None:
    """Raise ConfigError when a text occurs more than once (two points would share a name): the message names
    the repeated texts between `before` and `after`, shows `values` and asks to list each `each` once."""
    repeated = _repeated(texts)
    if repeated:
        raise ConfigError(
            f"{before}{', '.join(repeated)}{after} more than once in {values!r}: two points would share one name "
            f"and one directory; list each {each} once"
        )


def _repeated(texts: list[str]) -> list[str]:
    """The texts that occur more than once, in order of their first occurrence."""
    return [t for i, t in enumerate(texts) if texts.count(t) > 1 and texts.index(t) == i]


def expand_grid(grid: dict[str, list], seeds: list[int]) -> list[SweepPoint]:
    """Every combination of the grid's values (grid order, the last key fastest), times every seed. Two
    points whose names or directory names coincide are refused (ConfigError): they would share one run."""
    keys = list(grid)
    points = [
        SweepPoint(tuple(zip(keys, combo)), seed)
        for combo in itertools.product(*(grid[k] for k in keys))
        for seed in seeds
    ]
    seen: dict[str, SweepPoint] = {}
    for point in points:
        for taken in (point.name, point.dirname):
            other = seen.setdefault(taken, point)
            if other is not point:
                why = (
                    "list each value and seed once"
                    if other.name == point.name
                    else "their names differ only in characters a directory name replaces with '_'"
                )
                raise ConfigError(
                    f"sweep points {other.name!r} and {point.name!r} would share one name or directory "
                    f"({taken!r}): {why}"
                )
    return points


def sweep_id(base: TrainConfig, grid: dict[str, list], seeds: list[int]) -> str:
    """Deterministic: the same base config, grid and seeds give the same id (what a rerun resumes by)."""
    blob = json.dumps({"base": base.model_dump(mode="json"), "grid": grid, "seeds": seeds}, sort_keys=True)
    return "sweep-" + hashlib.sha256(blob.encode()).hexdigest()[:10]


def point_config(base: TrainConfig, point: SweepPoint, sweep: str) -> dict:
    """The child's config as a plain mapping, NOT validated (`check_points` does, before the sweep starts; the
    child validates it again). Its own output directory `<run.output_dir>/<sweep id>/<point>` and run name."""
    data = base.model_dump(mode="json")
    for key, value in point.values:  # each as `--set key=value` after the base: typed last, it wins
        apply_overrides(data, [f"{key}={json.dumps(value)}"])
        migrate_config(data, old_wins=True)
    apply_overrides(
        data,
        [
            f"{SEED_KEY}={point.seed}",
            f"run.output_dir={json.dumps(f'{base.run.output_dir}/{sweep}/{point.dirname}')}",
            f"tracking.run_name={json.dumps(point.run_name(sweep))}",
        ],
    )
    return data


def check_points(base: TrainConfig, grid: dict[str, list], seeds: list[int], sweep: str = "sweep") -> list[TrainConfig]:
    """Every point's config validated before any point starts: each grid value first on its own, as `--set key=value`
    on the base config would be (a typo'd key or a bad value is named with its --grid item), then each combination
    (the rules between fields). Returns the validated configs, one per point of the first seed. ConfigError, one
    line, naming the --grid item or the point."""
    for key, values in grid.items():
        for value in values:
            data = base.model_dump(mode="json")
            try:
                apply_overrides(data, [f"{key}={json.dumps(value)}"])
                migrate_config(data, old_wins=True)
                validate_config(data)
            except ConfigError as exc:
                raise ConfigError(f"--grid {key}={value_text(value)}: {_one_line(exc)}") from None
    configs = []
    for point in expand_grid(grid, seeds[:1]):
        try:
            configs.append(validate_config(point_config(base, point, sweep)))
        except ConfigError as exc:
            raise ConfigError(f"sweep point {point.group}: {_one_line(exc)}") from None
    return configs


def _one_line(exc: ConfigError) -> str:
    """A validation message on one line, without its 'invalid configuration (...):' header."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    if len(lines) > 1 and lines[0].startswith("invalid configuration"):
        lines = lines[1:]
    return "; ".join(lines)


def shared_points(base: TrainConfig, points: list[SweepPoint], sweep: str) -> dict[str, TrainConfig]:
    """Every point's validated config on a shared fleet (the threads host, `fleet_base`), by point name;
    ConfigError where they cannot share one (`check_shareable`)."""
    fleet = fleet_base(base)
    configs = {p.name: validate_config(point_config(fleet, p, sweep)) for p in points}
    check_shareable(configs)
    return configs
