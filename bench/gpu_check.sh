#!/usr/bin/env bash
# The prepared GPU check: on a GPU host without network, install from wheels brought along, run
# the hardware tests, and print /act p50/p99 on CPU, CUDA and CUDA graph for each policy.
# Made to finish within 10 minutes on one GPU: the install from local wheels (about a minute),
# the hardware tests (capped at 3 minutes) and the figures (20 s per configuration, capped at
# 5 minutes for 2 policies x 3 configurations).
#
#   bench/gpu_check.sh --bundle [DIR]   on a machine WITH network (Linux x86_64, Python 3.11,
#                                       like the GPU host): download every wheel into DIR
#                                       (default build/gpu-wheels), then carry the repository,
#                                       DIR included, to the GPU host
#   bench/gpu_check.sh [--wheels DIR]   on the GPU host: install into build/gpu-venv from DIR
#                                       only (pip --no-index), then test and measure
#   bench/gpu_check.sh --dry-run        on a CPU host: the same steps with the existing .venv,
#                                       no install, hardware tests collected (and skipped), CPU
#                                       figures only: proves the script runs end to end
#
# Options: --models a.onnx,b.onnx (default: the packaged demo policies), --requests N (per
# configuration, default 300), --python PY (default python3.11, else python3).
# Writes bench/results/gpu_check.json and build/gpu-check.log; exits non-zero when a step fails.
set -euo pipefail

cd "$(dirname "$0")/.."
ROOT=$(pwd)
WHEELS="$ROOT/build/gpu-wheels"
VENV="$ROOT/build/gpu-venv"
MODELS=""
REQUESTS=300
DRY=0
BUNDLE=0
PY=$(command -v python3.11 || command -v python3)
ORT="onnxruntime-gpu[cuda,cudnn]==1.31.1"

while [ $# -gt 0 ]; do
    case "$1" in
        --bundle) BUNDLE=1; if [ $# -gt 1 ] && [ "${2#--}" = "$2" ]; then WHEELS=$(realpath -m "$2"); shift; fi ;;
        --wheels) WHEELS=$(realpath -m "$2"); shift ;;
        --models) MODELS="$2"; shift ;;
        --requests) REQUESTS="$2"; shift ;;
        --python) PY="$2"; shift ;;
        --dry-run) DRY=1 ;;
        -h|--help) sed -n '2,20p' "$0"; exit 0 ;;
        *) echo "gpu_check.sh: unknown option $1 (try --help)" >&2; exit 2 ;;
    esac
    shift
done

say() { printf '\n== %s ==\n' "$*"; }

if [ "$BUNDLE" = 1 ]; then
    say "downloading wheels into $WHEELS"
    mkdir -p "$WHEELS"
    # the project's dependencies with the dev and GPU extras, ONNX Runtime with its CUDA 13
    # and cuDNN 9 wheels, and the build backend that an editable install needs. TensorRT is
    # optional (its tests skip without it): PyPI's tensorrt-cu13-libs is a stub that fetches
    # the real wheel from NVIDIA's own index at install time, so put the real
    # tensorrt_cu13_libs-10.*.whl into the bundle yourself (pip download from that index).
    "$PY" -m pip download --dest "$WHEELS" ".[dev,gpu]" "$ORT" "setuptools>=68" wheel
    rm -f "$WHEELS"/affinity-*  # the project itself is installed from the repository
    du -sh "$WHEELS"
    echo "carry $ROOT (with ${WHEELS#"$ROOT"/}) to the GPU host and run bench/gpu_check.sh there"
    exit 0
fi

mkdir -p "$ROOT/build"
exec > >(tee "$ROOT/build/gpu-check.log") 2>&1
START=$(date +%s)

if [ "$DRY" = 1 ]; then
    PYTHON="$ROOT/.venv/bin/python"
    [ -x "$PYTHON" ] || { echo "--dry-run uses .venv: python3 -m venv .venv && .venv/bin/pip install -e '.[dev]'" >&2; exit 2; }
    say "dry run on $(uname -n): no install, CPU only"
else
    [ -d "$WHEELS" ] || { echo "no wheels in $WHEELS: build the bundle with --bundle on a machine with network" >&2; exit 2; }
    say "GPUs"
    nvidia-smi --query-gpu=index,uuid,name,memory.total,compute_cap,driver_version,mig.mode.current --format=csv
    say "installing from $WHEELS (no network)"
    "$PY" -m venv "$VENV"
    extras="dev,gpu"
    if ls "$WHEELS"/tensorrt_cu13_libs-* >/dev/null 2>&1; then extras="$extras,tensorrt"; fi
    "$VENV/bin/pip" install --no-index --find-links "$WHEELS" --quiet -e ".[$extras]" "$ORT"
    PYTHON="$VENV/bin/python"
fi
"$PYTHON" -c 'import onnxruntime as o; print("onnxruntime", o.__version__, o.get_available_providers())'

status=0
say "hardware tests"
if [ "$DRY" = 1 ]; then
    # collected and skipped without RUN_HARDWARE_TESTS: proves they import and parametrize
    timeout 180 "$PYTHON" -m pytest -q -rs -m hardware tests/test_hardware.py || status=1
else
    RUN_HARDWARE_TESTS=1 timeout 180 "$PYTHON" -m pytest -q -rs -m hardware tests/test_hardware.py || status=1
fi

say "/act p50/p99: CPU, CUDA, CUDA graph"
args=(--requests "$REQUESTS" --budget 20)
[ -n "$MODELS" ] && args+=(--models "$MODELS")
[ "$DRY" = 1 ] && args+=(--dry-run)
timeout 300 "$PYTHON" -m bench.gpu_act "${args[@]}" || status=1

say "done in $(( $(date +%s) - START )) s, status $status (log: build/gpu-check.log)"
exit "$status"
