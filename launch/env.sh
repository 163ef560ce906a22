#!/usr/bin/env bash
# Idempotent set-up for a fresh machine (run as root) or an existing one: OpenMPI when mpirun is
# missing, a virtual environment at .venv/, torch==2.13.0 there only when no torch is importable
# (pip takes the CPU build where a CPU wheel is provided locally, as on these machines; on a GPU
# machine it is the regular build), then this package with its test, plot and bench extras, and
# its mpi extra (mpi4py) where an MPI library is installed, then its laboratory (lab/: the reference
# task, `ds-lowcomm compare`, the benchmarks), editable, which spawned workers, the DeepSpeed launcher
# and mpirun then import with no PYTHONPATH.
# Re-running skips every step that is already done.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

if ! command -v mpirun >/dev/null 2>&1; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
        echo "[env] installing OpenMPI (mpirun missing)"
        apt-get update -qq
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends openmpi-bin libopenmpi-dev >/dev/null
    else
        echo "[env] note: mpirun not found and cannot apt-get install it; MPI launches will be unavailable" >&2
    fi
fi

PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
    echo "[env] creating .venv"
    "$PY" -m venv .venv
fi
VPY=.venv/bin/python
# pip, without its lines about configured package folders this machine lacks (a hundred of them on a
# machine without the local mirrors: they buried the test run's own output in CI's log)
pip_install() {
    "$VPY" -m pip install "$@" 2>&1 | { grep -v "^WARNING: Location '.*' is ignored" || true; }
}

if ! "$VPY" -c "import torch" >/dev/null 2>&1; then
    echo "[env] installing torch==2.13.0"
    pip_install -q torch==2.13.0
fi

# Reinstall the package (editable) only when its declared dependencies changed.
stamp=.venv/.ds_lowcomm-installed
extras="test,plot,bench,megatron,hf"
if command -v mpirun >/dev/null 2>&1; then
    extras="$extras,mpi"
fi
want="$(sha256sum pyproject.toml | cut -d' ' -f1) $extras"
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ] || ! "$VPY" -c "import ds_lowcomm, deepspeed, pytest" >/dev/null 2>&1; then
    echo "[env] installing ds_lowcomm and its dependencies ($extras) into .venv"
    pip_install -q -e ".[$extras]"
    echo "$want" > "$stamp"
fi

# The laboratory (lab/pyproject.toml, ds-lowcomm-lab: never published), editable, after the library
# whose extras carry its dependencies; again whenever its distribution is missing from the venv (one
# made before the laboratory left the package) or its pyproject changed (its entry points).
lab_stamp=.venv/.ds_lowcomm_lab-installed
lab_want="$(sha256sum lab/pyproject.toml | cut -d' ' -f1)"
if [ ! -f "$lab_stamp" ] || [ "$(cat "$lab_stamp")" != "$lab_want" ] \
    || ! "$VPY" -c "import importlib.metadata as m; m.distribution('ds-lowcomm-lab'); import lowcomm_task, lowcomm_bench" >/dev/null 2>&1; then
    echo "[env] installing the laboratory (lab/: the reference task, compare, the benchmarks) into .venv"
    pip_install -q --no-deps -e lab
    echo "$lab_want" > "$lab_stamp"
fi
