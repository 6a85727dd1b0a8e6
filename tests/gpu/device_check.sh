#!/usr/bin/env bash
# The GPU path in one command, on a single-GPU machine with Python 3.12 and a CUDA build of
# torch (transformers, safetensors, tensorboard, tqdm installed; no internet, no vLLM).
# Packages it lacks (megatron-core, omegaconf, antlr4-python3-runtime) are installed from the
# wheels in $MEGARL_WHEELS (default .whl; `make gpu-wheels` fills it, about 10 MiB).
# Prints one PASS/FAIL line per check and a summary; exits 0 only if every check passed.
#   bash tests/gpu/device_check.sh [--out DIR] [--only logprobs_fp32,updates,...] [--device cpu]
set -euo pipefail
cd "$(dirname "$0")/../.."

PYTHON="${PYTHON:-python3}"
MEGARL_WHEELS="${MEGARL_WHEELS:-.whl}"
SITE="${MEGARL_SITE:-/tmp/megarl-site}"
TIME_LIMIT_S="${TIME_LIMIT_S:-480}"

if ! "$PYTHON" -c "import megatron.core, omegaconf" 2>/dev/null; then
    if ! compgen -G "$MEGARL_WHEELS/*.whl" >/dev/null; then
        echo "FAIL setup: megatron-core/omegaconf not importable and no wheels in $MEGARL_WHEELS (run 'make gpu-wheels' where pip works)"
        exit 1
    fi
    "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target "$SITE" "$MEGARL_WHEELS"/*.whl
    export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export CUDA_DEVICE_MAX_CONNECTIONS=1   # megatron overlaps TP comms with compute in issue order
exec timeout "$TIME_LIMIT_S" "$PYTHON" tests/gpu/device_check.py "$@"
