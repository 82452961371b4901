"""Decode-step attention time vs KV capacity: does the step cost follow the kept slots rather than the full length?

For a Qwen2.5-Coder-0.5B-like decode shape (B=8 sequences, K=2 KV heads, G=7 query heads per KV head, H=64) and full
length T, times one decode step of

  (a) ``dense``:     softmax attention of the new token over all T cached positions (an uncompressed cache),
  (b) ``ref``:       the XLA reference ``ref_gather_attention`` over a slot pool sized to the kept fraction
                     (capacity C = kept slots, rounded up to the block size), through a random permuted slot table;
                     ``ref_ordered``: the same through the identity table (the gather streams),
  (c) ``compacted``: dense attention over the capacity-sized pool itself, no gather -- the floor a cache stored
                     compacted in position order could reach (what the kept slots alone cost),
  (d) ``kernel``:    the Pallas kernel in *interpret* mode (CPU emulation of the TPU kernel; only for small T, and its
                     times say nothing about TPU speed -- they are reported for completeness),
  or, with ``--kernel gpu`` on a GPU backend:
  (e) ``kernel_gpu``: the Pallas/Triton GPU kernel compiled, at every T, interleaved with (a)-(c); ``kernel_gpu_split``:
                     the same with the slot axis split over more programs (``num_splits``); each row also records the
                     kernel's max abs error vs the reference (computed at ``highest`` matmul precision).

Each is jitted, warmed up, and timed as the median of N runs. Writes JSON with machine info and ratios vs dense.

    pask-jax bench kernel [--quick] [--out results/bench_kernel.json]
    pask-jax bench kernel --kernel gpu [--quick] [--dtype bfloat16] [--out results/bench_kernel_gpu.json]

(or ``python -m pask_jax.experiments.bench.kernel ...``).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from pask_jax.kernels.gpu import DEFAULT_GPU_BLOCK_SIZE, gather_attention_gpu_kernel
from pask_jax.kernels.reference import ref_gather_attention
from pask_jax.kernels.tpu import gather_attention_kernel

B, K, G, H = 8, 2, 7, 64
BLOCK = 128


@jax.jit
def dense_attention(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
    """q f[B, K, G, H], k/v f[B, K, T, H] -> f[B, K, G, H]: the last token attends to all T positions."""
    logits = jnp.einsum("bkgh,bkth->bkgt", q.astype(jnp.float32), k.astype(jnp.float32)) / math.sqrt(q.shape[-1])
    return jnp.einsum("bkgt,bkth->bkgh", jax.nn.softmax(logits, axis=-1), v.astype(jnp.float32)).astype(q.dtype)


def time_ms(thunks: dict[str, Callable[[], jax.Array]], reps: int, warmup: int = 2) -> dict[str, float]:
    """Median wall time (ms) of each thunk; runs are interleaved round-robin so background load hits all alike."""
    for fn in thunks.values():
        for _ in range(warmup):
            jax.block_until_ready(fn())
    samples: dict[str, list[float]] = {name: [] for name in thunks}
    for _ in range(reps):
        for name, fn in thunks.items():
            t0 = time.perf_counter()
            jax.block_until_ready(fn())
            samples[name].append((time.perf_counter() - t0) * 1e3)
    return {name: statistics.median(x) for name, x in samples.items()}


def main(argv: list[str] | None = None) -> dict:
    """`pask-jax bench kernel ARGS` -> the result dict (also written to --out)."""
    ap = argparse.ArgumentParser(
        prog="pask-jax bench kernel", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--out", type=Path, default=Path("results/bench_kernel.json"))
    ap.add_argument("--quick", action="store_true", help="T in {1024, 4096}, fewer repetitions")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--reps", type=int, default=None, help="timed runs per point (default 20, quick 7)")
    ap.add_argument("--kernel-max-t", type=int, default=1024, help="largest T timed for the interpreted kernel")
    ap.add_argument(
        "--kernel",
        default="interpret",
        choices=["interpret", "gpu"],
        help="interpret: the TPU kernel interpreted on the host (small T); gpu: the Triton kernel, compiled",
    )
    ap.add_argument("--gpu-block", type=int, default=DEFAULT_GPU_BLOCK_SIZE, help="block_size of the GPU kernel")
    args = ap.parse_args(argv)  # None: sys.argv[1:]
    gpu = args.kernel == "gpu"
    if gpu and jax.default_backend() != "gpu":
        ap.error(f"--kernel gpu needs a GPU backend, jax has {jax.default_backend()!r}")
    if BLOCK % args.gpu_block:
        ap.error(f"--gpu-block must divide the capacity granule {BLOCK}")

    lengths_t = [1024, 4096] if args.quick else [1024, 4096, 16384]
    fractions = [1.0, 0.5, 0.33, 0.2]
    reps = args.reps or (7 if args.quick else 20)
    kernel_reps = max(3, reps // 4)
    dtype = jnp.dtype(args.dtype)
    rng = np.random.default_rng(0)
    ref = jax.jit(ref_gather_attention)
    kernel = jax.jit(lambda *a: gather_attention_kernel(*a, block_size=BLOCK, interpret=True))
    kernel_gpu = partial(gather_attention_gpu_kernel, block_size=args.gpu_block)  # jitted; num_splits is static

    rows = []
    load_before = os.getloadavg()
    for t in lengths_t:
        q = jnp.asarray(rng.standard_normal((B, K, G, H)), dtype)
        k_full = jnp.asarray(rng.standard_normal((B, K, t, H)), dtype)
        v_full = jnp.asarray(rng.standard_normal((B, K, t, H)), dtype)
        for frac in fractions:
            kept = max(1, round(frac * t))
            cap = -(-kept // BLOCK) * BLOCK  # capacity sized from the budget, a multiple of the block size
            k_slots, v_slots = k_full[:, :, :cap], v_full[:, :, :cap]
            perm = np.stack([rng.permutation(cap) for _ in range(B * K)]).reshape(B, K, cap)
            table = jnp.asarray(perm, jnp.int32)  # kept entries scattered over the pool
            ordered = jnp.asarray(np.broadcast_to(np.arange(cap), (B, K, cap)), jnp.int32)  # slot order = position
            lengths = jnp.full((B, K), kept, jnp.int32)
            thunks = {
                "dense": partial(dense_attention, q, k_full, v_full),
                "ref": partial(ref, q, k_slots, v_slots, table, lengths),
                "ref_ordered": partial(ref, q, k_slots, v_slots, ordered, lengths),
                "compacted": partial(dense_attention, q, k_slots, v_slots),
            }
            row = {"T": t, "kept_fraction": frac, "kept_slots": kept, "capacity": cap}
            if gpu:
                splits = math.gcd(8, cap // args.gpu_block)  # up to 8x the B*K programs
                thunks["kernel_gpu"] = partial(kernel_gpu, q, k_slots, v_slots, table, lengths)
                thunks["kernel_gpu_split"] = partial(kernel_gpu, q, k_slots, v_slots, table, lengths, num_splits=splits)
                with jax.default_matmul_precision("highest"):
                    want = np.asarray(ref_gather_attention(q, k_slots, v_slots, table, lengths), np.float32)
                row |= {"gpu_block": args.gpu_block, "gpu_num_splits": splits}
                for name in ("kernel_gpu", "kernel_gpu_split"):
                    err = np.abs(np.asarray(thunks[name](), np.float32) - want).max()
                    row[f"{name}_max_abs_err"] = float(f"{err:.3g}")
            ms = time_ms(thunks, reps=reps)
            row |= {f"{name}_ms": round(v, 4) for name, v in ms.items()}
            row |= {f"{name}_over_dense": round(ms[name] / ms["dense"], 3) for name in ms if name != "dense"}
            if not gpu and t <= args.kernel_max_t:
                run_kernel = partial(kernel, q, k_slots, v_slots, table, lengths)
                kms = time_ms({"k": run_kernel}, reps=kernel_reps, warmup=1)
                row["kernel_interpret_ms"] = round(kms["k"], 3)
                row["kernel_interpret_over_dense"] = round(kms["k"] / ms["dense"], 2)
            rows.append(row)
            print(json.dumps(row), flush=True)

    interpret_note = (
        f"kernel_interpret: the Pallas TPU kernel run with interpret=True on CPU, only for T <= "
        f"{args.kernel_max_t}; interpret mode emulates the grid and every DMA serially, so its time measures the "
        "emulator, not the kernel"
    )
    gpu_notes = [
        f"kernel_gpu: the Pallas Triton kernel compiled (block_size {args.gpu_block}, one program per (sequence, KV "
        "head)); kernel_gpu_split: gpu_num_splits programs per (sequence, KV head), merged by XLA; *_max_abs_err: vs "
        "ref_gather_attention at highest matmul precision",
        "dense/ref/compacted use XLA's default matmul precision (TF32 for float32 on recent NVIDIA GPUs)",
    ]
    result = {
        "benchmark": "decode-step gather attention vs dense attention",
        "shape": {"B": B, "K_kv_heads": K, "G_q_per_kv": G, "H_head_dim": H, "block_size": BLOCK, "dtype": str(dtype)},
        "timing": f"jitted, warmed up, median of {reps} interleaved runs"
        + ("" if gpu else f" (kernel: {kernel_reps})")
        + ", milliseconds",
        "notes": [
            "dense: attention over all T positions; ref: XLA gather + masked softmax over a slot pool of capacity "
            "ceil(kept / block) * block, through a random permuted slot table; ref_ordered: same with the identity "
            "table (kept entries stored in position order, so the gather streams)",
            "compacted: dense attention over the capacity-sized pool, no gather (the floor for the kept slots)",
            "dense is re-timed beside each fraction (interleaved), so dense_ms varies a little within one T",
        ]
        + (gpu_notes if gpu else [interpret_note]),
        "machine": {
            "jax": jax.__version__,
            "backend": jax.default_backend(),
            "device": str(jax.devices()[0].device_kind),
            "cpu_count": os.cpu_count(),
            "platform": platform.platform(),
            "python": platform.python_version(),
            "loadavg_before_after": [round(load_before[0], 2), round(os.getloadavg()[0], 2)],
        },
        "quick": args.quick,
        "kernel_mode": args.kernel,
        "rows": rows,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")
    return result


if __name__ == "__main__":
    main()
