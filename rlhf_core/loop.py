"""The in-process entry: `run_sync(cfg)` trains in one process, in lockstep, with the roles' cycles of the Ray
runtime (`rlhf_core.run.roles`) hosted by `rlhf_core.hosts.in_process` (over `rlhf_core.run.local`'s parts) under
the one supervision loop. Used by tests, by the lockstep baseline, and by anyone debugging without Ray; its
checkpoints have the one layout, so a run of either host resumes from the other's. The names here stay
importable from `rlhf_core.loop` (docs/api.md)."""

from rlhf_core.hosts.in_process import run_sync
from rlhf_core.run.local import (
    RunParts,
    build_run,
    evaluate_parts,
    export_run,
    generate_step_batch,
    restore_run_checkpoint,
    save_run_checkpoint,
    warm_start,
)

__all__ = [
    "RunParts",
    "build_run",
    "evaluate_parts",
    "export_run",
    "generate_step_batch",
    "restore_run_checkpoint",
    "run_sync",
    "save_run_checkpoint",
    "warm_start",
]
