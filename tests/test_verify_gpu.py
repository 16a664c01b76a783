"""scripts/verify_gpu.py on a CPU-only machine: exit 0, says the CUDA measurements were skipped, and the
same run's JSON report has every check passed and no GPU target judged. One subprocess, --quick."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "verify_gpu.py"


@pytest.mark.slow  # runs the whole verification script (trains a model): ~45 s on 2 cores
@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only path and wording")
def test_verify_gpu_quick_on_cpu(tmp_path):
    out = tmp_path / "verify.json"
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--quick", "--json-out", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        cwd=SCRIPT.parents[1],
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-4000:]
    assert "CUDA measurements were skipped" in proc.stdout
    assert "ALL VERIFICATIONS PASSED (EXIT 0)" in proc.stdout

    report = json.loads(out.read_text())
    assert report["ok"] is True and report["failed"] == []
    assert report["cuda_measurements"] == "skipped" and report["device"]["device"] == "cpu"
    assert "reward.no_host_sync" in report["skipped"]
    names = {c["name"] for c in report["checks"]}
    assert {
        "reward B=64 L=256 correct on device",
        "reward B=256 L=1024 correct on device",
        "loss ppo forward+backward on device",
        "loss grpo forward+backward on device",
        "loss m2po_trust_region forward+backward on device",
        "loss m2po_ratio_sq forward+backward on device",
        "group-aware buffer",
        "versioned buffer staleness eviction",
        "closed loop on-policy (run_sync)",
        "closed loop stale-k tau=1 (run_stale)",
    } <= names
    assert all(c["passed"] for c in report["checks"])
    assert report["timings"]["reward/tensor_native/B=256,L=1024"]["method"] == "perf_counter"
    assert report["targets"] == {}  # the GPU target is not judged on a CPU


def test_verify_gpu_parts_in_process():
    """The buffer checks pass and the CPU timer reports perf_counter figures (in-process, cheap)."""
    sys.path.insert(0, str(SCRIPT.parent))
    try:
        import verify_gpu
    finally:
        sys.path.remove(str(SCRIPT.parent))
    rep = verify_gpu.Report(quiet=True)
    verify_gpu.check_buffers(torch.device("cpu"), rep)
    assert [c["passed"] for c in rep.checks] == [True, True]
    t = verify_gpu.time_ms(lambda: None, torch.device("cpu"), repeats=5, warmup=1)
    assert t["method"] == "perf_counter" and t["repeats"] == 5
    json.dumps(rep.checks)  # serialisable
