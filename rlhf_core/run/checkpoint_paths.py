"""Where a run's checkpoints are, told from the file system alone (no torch: the command line asks before
anything starts).

    <run.output_dir>/latest -> <run dir>          the newest run that produced something
    <run dir>/checkpoints/step_NNNNNN/meta.json   one checkpoint (rlhf_core.run.checkpoint writes the layout)
    <run dir>/policy/                             the exported policy, once the run finished

A path given to resume or evaluate may name a checkpoint, a run directory or its checkpoints/ directory: the
last two mean their newest checkpoint (`newest_checkpoint`). A path that holds none fails with a one-line
`ConfigError` naming the option, the path and the checkpoints that do exist near it (`checkpoint_target`).
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Optional

from rlhf_core.config import ConfigError

CHECKPOINTS_DIR = "checkpoints"  # a run directory's checkpoints: <run_dir>/checkpoints/step_NNNNNN
META_FILE = "meta.json"  # written into a checkpoint directory before it is renamed into place
POLICY_DIR = "policy"  # a finished run's exported policy: <run_dir>/policy
_STEP = re.compile(r"step_(\d{6,})")
SHOWN = 4  # checkpoints named in a message, newest first


def is_checkpoint(path: str | os.PathLike) -> bool:
    """A directory of this project's checkpoint layout (its meta.json is written before it gets its name)."""
    return (Path(path) / META_FILE).is_file()


def checkpoint_step(path: str | os.PathLike) -> Optional[int]:
    """The step in a checkpoint directory's name (step_000400 -> 400), or None for another name."""
    match = _STEP.fullmatch(Path(path).name)
    return int(match.group(1)) if match else None


def checkpoints_in(directory: str | os.PathLike) -> list[Path]:
    """The complete checkpoints directly under `directory` (named step_NNNNNN, holding meta.json), oldest first;
    half-written ones (`.tmp`) and anything else are left out."""
    root = Path(directory)
    try:
        entries = list(root.iterdir())
    except OSError:
        return []
    found = [(checkpoint_step(e), e) for e in entries if checkpoint_step(e) is not None and is_checkpoint(e)]
    return [e for _, e in sorted(found)]


def run_checkpoints(path: str | os.PathLike) -> list[Path]:
    """The checkpoints a checkpoint directory, a run directory or its checkpoints/ directory stands for."""
    p = Path(path)
    if is_checkpoint(p):
        return [p]
    if (p / CHECKPOINTS_DIR).is_dir():
        return checkpoints_in(p / CHECKPOINTS_DIR)
    return checkpoints_in(p)


def newest_checkpoint(path: str | os.PathLike) -> Optional[Path]:
    """`path` itself when it is a checkpoint; the newest checkpoint of a run directory (or of its checkpoints/
    directory); None when it holds none."""
    found = run_checkpoints(path)
    return found[-1] if found else None


def checkpoints_near(path: str | os.PathLike, depth: int = 3, up: int = 2, budget: int = 400) -> list[Path]:
    """The checkpoints near a path that holds none, newest step first: under its nearest existing directory (that
    directory's own checkpoints, or its runs': <dir>/<run>/checkpoints/step_N, down to `depth` levels), else
    under the directories `up` levels above it. At most `budget` directories are looked into."""
    p = Path(path).expanduser()
    base = p if p.is_dir() else p.parent
    while not base.is_dir() and base != base.parent:
        base = base.parent
    for _ in range(up + 1):
        found: list[Path] = []
        level = [base]
        for _ in range(depth):
            found += [c for d in level for c in run_checkpoints(d) if c not in found]
            budget -= len(level)
            if found or budget <= 0:
                break
            level = [child for d in level for child in _subdirs(d)][: max(budget, 0)]
        if found:
            return sorted(found, key=lambda c: (checkpoint_step(c) or 0, str(c)), reverse=True)
        if base == base.parent or budget <= 0:
            break
        base = base.parent
    return []


def _subdirs(directory: Path) -> list[Path]:
    try:
        # not through links (output_dir/latest): each run once, under its own name
        entries = (e for e in directory.iterdir() if e.is_dir() and not e.is_symlink() and not e.name.startswith("."))
        return sorted(entries)[:200]
    except OSError:
        return []


def describe_near(path: str | os.PathLike, keep: Optional[int] = None) -> str:
    """What exists near `path`, for a message: 'checkpoints that exist: a, b (newest first)' or that none does."""
    near = checkpoints_near(path)
    if not near:
        return "no checkpoint exists near it"
    shown = ", ".join(str(c) for c in near[:SHOWN]) + (f" and {len(near) - SHOWN} more" if len(near) > SHOWN else "")
    kept = f"; checkpoint.keep={keep} keeps a run's newest {keep}" if keep else ""
    return f"checkpoints that exist: {shown} (newest first{kept}; a run directory stands for its newest)"


def checkpoint_target(path: str | os.PathLike, option: str, keep: Optional[int] = None) -> Path:
    """The checkpoint `path` names (a checkpoint, or a run directory or checkpoints/ directory: its newest),
    resolved past symlinks such as <output_dir>/latest. ConfigError (one line, naming `option`, the path and
    the checkpoints near it) when it is missing or holds none."""
    p = Path(path).expanduser()
    if not p.exists():
        raise ConfigError(f"{option} {path}: it does not exist; {describe_near(p, keep)}")
    found = newest_checkpoint(p)
    if found is None:
        what = "a directory without checkpoints" if p.is_dir() else "not a directory"
        raise ConfigError(
            f"{option} {path}: {what} (a checkpoint holds {META_FILE}; a run directory holds {CHECKPOINTS_DIR}/); "
            f"{describe_near(p, keep)}"
        )
    return found.resolve()


def policy_in(path: str | os.PathLike) -> Path:
    """What to evaluate in `path`: a run directory's exported policy (<run dir>/policy), else its newest checkpoint
    (a run interrupted before its export); any other path as it is."""
    p = Path(path).expanduser()
    if holds_policy(p) or not p.is_dir():
        return p
    if holds_policy(p / POLICY_DIR):
        return p / POLICY_DIR
    return newest_checkpoint(p) or p


def holds_policy(path: str | os.PathLike) -> bool:
    """A directory `atrlhf evaluate` can score: a Hugging Face model, a checkpoint, or an exported LoRA adapter."""
    p = Path(path)
    return (p / "config.json").is_file() or is_checkpoint(p) or (p / "adapter" / "adapter_config.json").is_file()
