#!/usr/bin/env bash
# On a machine with a CUDA GPU, as it is: the tests that need CUDA (float8 and MoE parity
# rows among them), the throughput benchmark beside torchtitan, bf16 and float8, with the
# dry run's predictions of the same steps, then the mixture of experts beside torchtitan's.
# Results go to OUT (default runs/gpu-bench): cuda-tests.log, compiled/ and moe/ (each
# throughput.json and .md).
#
#   bench/gpu.sh [OUT]
#
# The environment (.venv-gpu) sees the interpreter's own packages, its CUDA build of torch
# among them, and installs only what is missing (TORCHTITAN_SPEC, default torchtitan==0.2.2,
# the newest release that imports on torch 2.11; torchao for float8): from PyPI, or on a
# machine without a network from the wheels in WHEELS (default .whl, where present). Set
# PYTHON to choose the interpreter; STAGES to run a subset of "tests throughput moe eager"
# (default "tests throughput moe"); TESTS to pass the tests stage a pytest -k expression;
# SHAPES, VARIANTS and ROUNDS for the throughput stage (bench/gpu_throughput.py --shapes,
# --variants, --rounds), MOE_SHAPES and MOE_VARIANTS for the moe stage.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-runs/gpu-bench}
PYTHON=${PYTHON:-python3}
TORCHTITAN_SPEC=${TORCHTITAN_SPEC:-torchtitan==0.2.2}
STAGES=${STAGES:-tests throughput moe}
TESTS=${TESTS:-}
WHEELS=${WHEELS:-.whl}
SHAPES=${SHAPES:-8B:4:8192:1}
VARIANTS=${VARIANTS:-torchtitan,engine+keep,engine+float8-tensorwise+keep,torchtitan+float8-tensorwise,engine+float8-rowwise+keep,torchtitan+float8-rowwise}
ROUNDS=${ROUNDS:-1}
MOE_SHAPES=${MOE_SHAPES:-mixtral-8x7B:2:8192:1}
MOE_VARIANTS=${MOE_VARIANTS:-engine+keep,torchtitan}
ENV=.venv-gpu
PY=$ENV/bin/python
mkdir -p "$OUT"
stage() { echo "== $(date -u +%H:%M:%S) $*"; }

if ! "$PYTHON" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
    echo "error: $PYTHON has no torch that sees a CUDA GPU. Run this on a GPU machine whose python3 has a CUDA" \
         "build of torch, or point PYTHON at one." >&2
    exit 2
fi

stage "environment $ENV over $PYTHON's packages"
if [ ! -x "$PY" ]; then
    "$PYTHON" -m venv --system-site-packages --without-pip "$ENV" || exit 1
    # A venv made from another venv sees only the base interpreter's packages: name the
    # creating interpreter's own site-packages too, so its torch stays the one in use.
    "$PYTHON" -c "import site, sysconfig; print('\n'.join(dict.fromkeys(
        [sysconfig.get_paths()['purelib'], sysconfig.get_paths()['platlib'], *site.getsitepackages()])))" \
        > "$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/host-packages.pth"
fi
missing=()
for pair in einops:einops yaml:pyyaml tensorboard:tensorboard numpy:numpy pytest:pytest hypothesis:hypothesis \
            transformers:transformers tokenizers:tokenizers safetensors:safetensors "torchao:torchao>=0.18" \
            "torchtitan:$TORCHTITAN_SPEC"; do
    "$PY" -c "import ${pair%%:*}" 2>/dev/null || missing+=("${pair#*:}")
done
if [ ${#missing[@]} -gt 0 ]; then
    stage "installing ${missing[*]}"
    if [ -d "$WHEELS" ]; then  # no network: every wheel in WHEELS, their dependencies among them
        "$PY" -m pip install -q --no-index --no-deps "$WHEELS"/*.whl || exit 1
    else
        "$PY" -m pip install -q "${missing[@]}" || exit 1
    fi
fi
"$PY" - <<'EOF' | tee "$OUT/environment.txt"
import torch
print(f"torch {torch.__version__} (CUDA {torch.version.cuda}) on {torch.cuda.get_device_name(0)}, "
      f"{torch.cuda.device_count()} GPU(s), {torch.cuda.get_device_properties(0).total_memory / 2**30:.0f} GiB")
EOF

status=0
if [[ " $STAGES " == *" tests "* ]]; then
    stage "the CUDA tests (pytest -m cuda)"
    workers=$("$PY" -c "import xdist" 2>/dev/null && echo "-n 4")
    "$PY" -m pytest -q -m cuda tests/test_cuda.py $workers ${TESTS:+-k "$TESTS"} 2>&1 | tee "$OUT/cuda-tests.log"
    [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
fi
if [[ " $STAGES " == *" throughput "* ]]; then
    stage "throughput with torch.compile, engine beside torchtitan, and the dry run's predictions"
    "$PY" bench/gpu_throughput.py --out "$OUT/compiled" --predict --shapes "$SHAPES" --variants "$VARIANTS" \
        --rounds "$ROUNDS" || status=1
fi
if [[ " $STAGES " == *" moe "* ]]; then
    stage "the mixture of experts with torch.compile, engine beside torchtitan (the dry run does not plan MoE yet)"
    "$PY" bench/gpu_throughput.py --out "$OUT/moe" --shapes "$MOE_SHAPES" --variants "$MOE_VARIANTS" \
        --rounds "$ROUNDS" || status=1
fi
if [[ " $STAGES " == *" eager "* ]]; then
    stage "throughput without compile (the dry run simulates eager blocks)"
    "$PY" bench/gpu_throughput.py --out "$OUT/eager" --eager --predict --rounds 1 || status=1
fi
stage "done: results in $OUT"
exit $status
