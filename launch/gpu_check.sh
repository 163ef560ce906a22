#!/usr/bin/env bash
# The first run on a lent GPU, in one command (lab/lowcomm_bench/gpu_check.py says what it runs):
#   bash launch/gpu_check.sh                 # on the GPU machine: dated CSVs in $OUT, else docs/bench/gpu
#   bash launch/gpu_check.sh --dry-run       # the same parts on the CPU at tiny sizes (the test suite runs it),
#                                            # into a new temporary folder unless $OUT or --out names one
# A GPU machine here has torch but not DeepSpeed: wheels carried in .whl/ (see docs/gpus.md) are
# installed under /tmp/site first. Extra arguments go to `python -m lowcomm_bench gpu_check`.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PY=${PYTHON:-python3}
if compgen -G ".whl/*.whl" >/dev/null && ! "$PY" -c "import deepspeed" >/dev/null 2>&1; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        || echo "[gpu_check] installing the carried wheels failed; going on without them" >&2
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
# the library and its laboratory (lab/: the benchmarks, the reference task) from this checkout
export PYTHONPATH=$PWD:$PWD/lab${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
# $OUT (the lent machine's folder that comes back) when set; else gpu_check's default
exec "$PY" -m lowcomm_bench gpu_check ${OUT:+--out "$OUT"} "$@"
