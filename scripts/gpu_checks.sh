#!/usr/bin/env bash
# Every GPU check of the project in one run, for a short lease on a CUDA machine.
#
#   OUT=/path/to/results scripts/gpu_checks.sh        # from the repository root; OUT defaults to gpu_results/
#
# Writes under $OUT: nvidia-smi.txt, verify_gpu.txt + verify_gpu.json (scripts/verify_gpu.py: device report,
# reward timings with CUDA events, the no-host-sync check, losses, buffers, closed loop, VRAM),
# pytest_cuda.txt (the CUDA tests of rewards, the text components included, and losses), reward_text.json (the text
# reward's components on the GPU vs decode + regex: benchmarks/reward.py --text --device cuda),
# pytest_vllm.txt (the same vLLM tests every CPU CI run takes, tests/test_vllm.py and tests/test_vllm_runs.py, here on
# CUDA with the vllm wheel: `make install` on a GPU machine installs it; they fail where vllm does not import),
# pytest_nccl.txt (the sharded trainer, N = 2 over NCCL vs N = 1; skips with fewer than 2 GPUs), lora_sync.json
# (weight sync bytes and seconds, full vs LoRA, on the GPU) and summary.txt. Exit status: non-zero if verify_gpu or the CUDA tests failed.
#
# The machine needs torch (CUDA), transformers, tokenizers, safetensors, pyyaml, numpy, pytest and
# hypothesis, plus pydantic. A machine that cannot reach PyPI gets the missing ones as wheels in .whl/
# (made where pip works, for that machine's Python), which this script installs into /tmp/site first:
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 -d .whl \
#     pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5
set -uo pipefail
OUT=${OUT:-gpu_results}
PY=${PY:-python3}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false RAY_USAGE_STATS_ENABLED=0
if compgen -G ".whl/*.whl" > /dev/null; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        || { echo "installing the carried wheels failed" >&2; exit 2; }
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}

status=0
{ nvidia-smi || echo "nvidia-smi not available"; } > "$OUT/nvidia-smi.txt" 2>&1

"$PY" scripts/verify_gpu.py --json-out "$OUT/verify_gpu.json" > "$OUT/verify_gpu.txt" 2>&1
verify_rc=$?
[ $verify_rc -eq 0 ] || status=1

# -k cuda selects the CUDA tests (they skip where CUDA is missing); -rs lists the skips with their reasons
"$PY" -m pytest -q -rs -p no:cacheprovider tests/test_reward.py tests/test_reward_text.py tests/test_algorithms.py -k cuda \
    > "$OUT/pytest_cuda.txt" 2>&1
cuda_rc=$?
[ $cuda_rc -eq 0 ] || status=1

# the text reward's components on the GPU against decode + regex on the host, B=256 L=1024 (docs/benchmarks.md)
if "$PY" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    "$PY" benchmarks/reward.py --text --device cuda --json > "$OUT/reward_text.json" 2> "$OUT/reward_text.txt"
    text_rc=$?
    [ $text_rc -eq 0 ] || status=1
else
    text_rc="skipped, no CUDA"
fi

# the engine against HF (log-probs, greedy, stop set, syncs and the sync probe, LoRA, in-flight updates) and whole
# runs (partial rollouts, LoRA, an engine that ignores updates) on vLLM with CUDA
"$PY" -m pytest -q -rs -p no:cacheprovider tests/test_vllm.py tests/test_vllm_runs.py > "$OUT/pytest_vllm.txt" 2>&1
vllm_rc=$?

# the sharded trainer over NCCL, N = 2 (one rank per GPU) vs N = 1 on one GPU; skips with fewer than 2 GPUs
"$PY" -m pytest -q -rs -p no:cacheprovider tests/test_sharded_trainer.py -k nccl > "$OUT/pytest_nccl.txt" 2>&1
nccl_rc=$?
[ $nccl_rc -eq 0 ] || status=1

# weight sync bytes and seconds, full vs LoRA r = 8 / 64, with the model on the GPU (figures, no target)
"$PY" benchmarks/lora_sync.py --device cuda --rounds 3 --json > "$OUT/lora_sync.json" 2> "$OUT/lora_sync.txt"
lora_rc=$?

{
    echo "verify_gpu.py exit status: $verify_rc"
    echo "CUDA tests exit status:    $cuda_rc ($(tail -n 1 "$OUT/pytest_cuda.txt"))"
    echo "text reward on the GPU:    $text_rc (reward_text.json)"
    echo "vLLM tests exit status:    $vllm_rc ($(tail -n 1 "$OUT/pytest_vllm.txt"))"
    echo "NCCL N=2 vs N=1 status:    $nccl_rc ($(tail -n 1 "$OUT/pytest_nccl.txt"))"
    echo "LoRA sync figures status:  $lora_rc (lora_sync.json)"
    echo "overall:                   $([ $status -eq 0 ] && echo PASSED || echo FAILED)"
} | tee "$OUT/summary.txt"
exit $status
