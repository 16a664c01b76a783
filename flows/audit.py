"""`atrlhf audit <run dir | MLflow run id | latest>`: print a run's audit (rlhf_core.supervision.audit).

The audit is <run dir>/audit.json, kept current by the run's supervision while it runs and final at its end (also
when it failed or was cancelled); `latest` is run.output_dir/latest (the newest run that wrote a checkpoint). An
MLflow run id names its run directory by its `atrlhf.run_dir` tag.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Optional

from flows.scale import ScaleError, resolve_run_dir
from rlhf_core.run.preflight import LATEST
from rlhf_core.supervision.audit import AUDIT_FILE

MARK = {"ok": "ok", "inactive": "INACTIVE", "failed": "FAILED", "pending": "pending"}


def read_audit(target: str, output_dir: str, tracking_uri: Optional[str] = None) -> tuple[Path, dict]:
    """(the audit file, its report) of a run directory, an MLflow run id or `latest` (under output_dir)."""
    if target == "latest":
        target = str(Path(output_dir) / LATEST)
        if not Path(target).exists():
            raise ScaleError(f"{target} does not exist: no run under {output_dir} has written a checkpoint yet")
    path = resolve_run_dir(target, tracking_uri, running=False) / AUDIT_FILE
    if not path.is_file():
        raise ScaleError(f"{path} does not exist: the run kept no audit (supervision.audit off, or it never polled)")
    try:
        return path, json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ScaleError(f"{path} is not valid JSON: {exc}") from None


def format_audit(report: dict, width: int = 100) -> str:
    """The audit as a terminal table: check, verdict, evidence (wrapped)."""
    import textwrap

    checks = report.get("checks", [])
    name_w = max([len("check")] + [len(c["name"]) for c in checks])
    state = "final" if report.get("final") else "so far (the run is still going)"
    lines = [
        f"run audit, {state}: {MARK.get(report.get('verdict'), report.get('verdict'))} "
        f"after {report.get('steps', 0)} trainer steps",
        "",
    ]
    lines.append(f"{'check'.ljust(name_w)}  {'verdict'.ljust(8)}  evidence")
    for c in checks:
        wrapped = textwrap.wrap(str(c["evidence"]), max(30, width - name_w - 12)) or [""]
        lines.append(f"{c['name'].ljust(name_w)}  {MARK.get(c['verdict'], c['verdict']).ljust(8)}  {wrapped[0]}")
        lines.extend(" " * (name_w + 12) + more for more in wrapped[1:])
    return "\n".join(lines)


def cmd_audit(target: str, output_dir: str, tracking_uri: Optional[str] = None, as_json: bool = False) -> int:
    """Exit 0 when the audit found nothing against the run, 1 when a check failed or was inactive, 2 when there is
    no audit to read."""
    try:
        path, report = read_audit(target, output_dir, tracking_uri)
    except ScaleError as exc:
        print(f"atrlhf: {exc}", file=sys.stderr)
        return 2
    if as_json:
        print(json.dumps(report, indent=2))
    else:
        print(f"{path}\n{format_audit(report)}")
    return 1 if report.get("verdict") in ("failed", "inactive") else 0
