#!/usr/bin/env bash
# deploy/gpu-check.sh: check this project on a GPU machine end to end (about 5 minutes on one
# GPU once the packages are installed).
#
#   deploy/gpu-check.sh --out runs/gpu-check       # install, test, benchmark
#   deploy/gpu-check.sh --dry-run                   # validate the GPU configs, print the plan
#
# Steps: a venv with a CUDA torch (PyPI's Linux x86-64 wheel is the CUDA build; the PyTorch
# index is the fallback), the project, the default model; `pytest -m gpu tests/gpu`; then
# `longspark bench throughput` serving plain and spec decoding over HTTP at C=1, 8 and 32,
# the TP=1 target and the drafter sharing one GPU (deploy/gpu-single.yaml's layout).
# Writes nvidia-smi.txt, pytest-gpu.txt, throughput.json (+ .png) and bench.log under --out.
# Exit status: 0 all passed, 1 a step failed, 2 bad arguments or no GPU.
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0}
TORCH_CUDA_INDEX=${TORCH_CUDA_INDEX:-https://download.pytorch.org/whl/cu128}
CONCURRENCY=1,8,32
CONFIGS=(deploy/gpu-node.yaml deploy/gpu-single.yaml)

usage() {
    cat <<EOF
usage: deploy/gpu-check.sh [--out DIR] [--venv DIR] [--dry-run] [--help]

  --out DIR    where the reports go (default: runs/gpu-check-<UTC time>)
  --venv DIR   the virtual environment to create or reuse (default: .venv-gpu)
  --dry-run    validate ${CONFIGS[*]} and print the plan; install and run nothing
  --help       this text

Environment: TORCH_SPEC (default $TORCH_SPEC), TORCH_CUDA_INDEX (the fallback index,
default $TORCH_CUDA_INDEX).
EOF
}

die() {
    echo "gpu-check: error: $*" >&2
    exit 2
}

OUT="" VENV="$ROOT/.venv-gpu" DRY_RUN=0
while (($#)); do
    case "$1" in
        --out) (($# >= 2)) || die "--out needs a directory"; OUT=$2; shift 2 ;;
        --out=*) OUT=${1#--out=}; shift ;;
        --venv) (($# >= 2)) || die "--venv needs a directory"; VENV=$2; shift 2 ;;
        --venv=*) VENV=${1#--venv=}; shift ;;
        --dry-run) DRY_RUN=1; shift ;;
        -h | --help) usage; exit 0 ;;
        *) die "unknown argument '$1' (see --help)" ;;
    esac
done
[[ -n $OUT ]] || OUT="$ROOT/runs/gpu-check-$(date -u +%Y%m%dT%H%M%SZ)"
[[ -n $VENV ]] || die "--venv needs a directory"
PY="$VENV/bin/python"
cd "$ROOT"

BENCH=(
    bench throughput --device cuda --concurrency "$CONCURRENCY" --num-prompts 16
    --max-tokens 128 --serve-arg gpus_per_rank=0.5 --serve-arg drafter_gpus=0.5
    --serve-arg kv_cache_tokens=131072 --json "$OUT/throughput.json" --plot "$OUT/throughput.png"
)

# The Serve configs a GPU machine deploys, validated as build_app validates them (no Ray).
validate_configs() {
    "$1" - "${CONFIGS[@]}" <<'EOF'
import sys
from pathlib import Path

from pydantic import ValidationError

from services.serving.config import ServeArgs
from services.serving.launch import load_config

for name in sys.argv[1:]:
    args, _ = load_config(Path(name))
    try:
        cfg = ServeArgs.model_validate(args)
    except ValidationError as exc:
        err = exc.errors()[0]
        where = ".".join(str(p) for p in err["loc"])
        sys.exit(f"gpu-check: error: {name}: {where + ': ' if where else ''}{err['msg']}")
    gpus = sum(b.get("GPU", 0) for b in cfg.bundles())
    print(
        f"    {name}: device {cfg.device}, tp {cfg.tp}, mode {cfg.mode},"
        f" {gpus:g} GPU(s) per replica, bundles {cfg.bundles()}"
    )
EOF
}

print_plan() {
    cat <<EOF
gpu-check plan
  out:       $OUT
  venv:      $VENV (created if missing)
  torch:     pip install $TORCH_SPEC (PyPI: the CUDA build); if CUDA is still not
             available: pip install ${TORCH_SPEC}+$(basename "$TORCH_CUDA_INDEX") --index-url $TORCH_CUDA_INDEX
  project:   pip install -e '.[dev,bench]'; longspark model fetch
  tests:     pytest -q -m gpu tests/gpu -> $OUT/pytest-gpu.txt
  benchmark: longspark ${BENCH[*]}
  configs:
EOF
}

if ((DRY_RUN)); then
    for candidate in "$PY" "$ROOT/.venv/bin/python" python3; do
        if command -v "$candidate" >/dev/null && "$candidate" -c "import services.serving.config" 2>/dev/null; then
            print_plan
            validate_configs "$candidate"
            echo "dry run: nothing installed or run"
            exit 0
        fi
    done
    die "--dry-run needs a python with this project installed (make install)"
fi

command -v nvidia-smi >/dev/null && nvidia-smi -L >/dev/null 2>&1 ||
    die "no NVIDIA GPU here (nvidia-smi -L failed)"
mkdir -p "$OUT"
nvidia-smi >"$OUT/nvidia-smi.txt"
print_plan

cuda_torch() { "$PY" -c "import sys, torch; sys.exit(not torch.cuda.is_available())" 2>/dev/null; }

echo "== venv and CUDA torch"
[[ -x $PY ]] || python3 -m venv "$VENV"
"$PY" -m pip install -q --upgrade pip || true  # offline: keep the one there
if ! cuda_torch; then
    "$PY" -m pip install -q "$TORCH_SPEC" || true
    if ! cuda_torch; then
        "$PY" -m pip install -q --force-reinstall "${TORCH_SPEC}+$(basename "$TORCH_CUDA_INDEX")" \
            --index-url "$TORCH_CUDA_INDEX"
    fi
fi
cuda_torch || { echo "gpu-check: error: torch installed but torch.cuda.is_available() is False" >&2; exit 1; }
"$PY" -c "import torch; print('torch', torch.__version__, 'CUDA', torch.version.cuda, torch.cuda.get_device_name(0))"

echo "== project and model"
"$PY" -m pip install -q -e ".[dev,bench]"
validate_configs "$PY"
"$VENV/bin/longspark" model fetch

status=0
echo "== pytest -m gpu tests/gpu"
"$PY" -m pytest -q -m gpu tests/gpu 2>&1 | tee "$OUT/pytest-gpu.txt" || status=1

echo "== served benchmark: plain and spec at C=$CONCURRENCY"
"$VENV/bin/longspark" "${BENCH[@]}" >"$OUT/bench.log" 2>&1 || status=1
tail -n 3 "$OUT/bench.log"
"$PY" - "$OUT/throughput.json" <<'EOF' || status=1
import json
import sys

report = json.load(open(sys.argv[1]))
for row in report["comparison"]:
    print(
        f"  {row['stage']:5} plain {row['plain_tokens_per_s']} tok/s, spec"
        f" {row['spec_tokens_per_s']} tok/s (x{row['spec_over_plain_tokens_per_s']}),"
        f" tau {row['tau']}, greedy identical {row['greedy_identical']}"
    )
print("  problems:", report["problems"] or "none")
sys.exit(1 if report["problems"] else 0)
EOF

echo "gpu-check: $([[ $status == 0 ]] && echo passed || echo FAILED); reports in $OUT"
exit "$status"
