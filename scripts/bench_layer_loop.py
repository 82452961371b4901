"""Layers unrolled or under `lax.scan` on XLA:CPU: compile seconds and decode-step time, side by side in one run.

    python scripts/bench_layer_loop.py [--layers 24] [--repeats 15] [--out results/bench_layer_loop.json]

A decode-shaped stack at the 0.5B model's sizes (D 896, F 4864, 14 / 2 heads of 64, batch 4, 512 cache slots):
q/k/o projections, attention over the layer's cache (its keys serve as values), SwiGLU MLP, one cache write per
layer. Two ways to run it:
- `unrolled`: one array per layer and parameter (the engine's layout), a Python loop over the layers;
- `scan`: every parameter stacked [L, ...] and the layers under `jax.lax.scan` (one layer body compiled once).
Each is lowered and compiled once (timed apart), then the two steps run interleaved `--repeats` times with the cache
donated; the medians are reported. Random weights: only the shapes matter.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import jax
import jax.numpy as jnp

D, F, N, K, H, C, B = 896, 4864, 14, 2, 64, 512, 4


def layer(x, p, cache):  # x f[B, D], cache f[B, K, C, H] -> (x, cache)
    q, k = x @ p["q"], x @ p["k"]
    logits = jnp.einsum("BKGH,BKCH->BKGC", q.reshape(B, K, N // K, H), cache)
    out = jnp.einsum("BKGC,BKCH->BKGH", jax.nn.softmax(logits, -1), cache).reshape(B, N * H)
    x = x + out @ p["o"]
    x = x + (jax.nn.silu(x @ p["g"]) * (x @ p["u"])) @ p["d"]
    return x, cache.at[:, :, 0].set(k.reshape(B, K, H))


def unrolled(params, caches, x):
    out = []
    for p, cache in zip(params, caches, strict=True):
        x, cache = layer(x, p, cache)
        out.append(cache)
    return x, out


def scanned(params, cache, x):
    return jax.lax.scan(lambda x, xs: layer(x, *xs), x, (params, cache))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--out", help="results JSON")
    args = ap.parse_args()
    keys = iter(jax.random.split(jax.random.key(0), 16))
    shapes = dict(q=(D, N * H), k=(D, K * H), o=(N * H, D), g=(D, F), u=(D, F), d=(F, D))
    stacked = {n: 0.02 * jax.random.normal(next(keys), (args.layers, *s)) for n, s in shapes.items()}
    per_layer = [{n: a[i] + 0 for n, a in stacked.items()} for i in range(args.layers)]  # own buffers
    cache = 0.02 * jax.random.normal(next(keys), (args.layers, B, K, C, H))
    x0 = 0.02 * jax.random.normal(next(keys), (B, D))
    sides = {
        "unrolled": (unrolled, per_layer, [cache[i] + 0 for i in range(args.layers)]),
        "scan": (scanned, stacked, cache),
    }
    result, compiled, state = {}, {}, {}
    for name, (fn, params, c) in sides.items():
        start = time.perf_counter()
        lowered = jax.jit(fn, donate_argnums=(1,)).lower(params, c, x0)
        middle = time.perf_counter()
        compiled[name] = lowered.compile()
        result[name] = {"lower_s": round(middle - start, 3), "compile_s": round(time.perf_counter() - middle, 3)}
        _, state[name] = compiled[name](params, c, x0)  # warm
    times = {name: [] for name in sides}
    for _ in range(args.repeats):
        for name, (_, params, _) in sides.items():
            start = time.perf_counter()
            y, state[name] = compiled[name](params, state[name], x0)
            y.block_until_ready()
            times[name].append(time.perf_counter() - start)
    for name in sides:
        result[name]["step_ms_median"] = round(1e3 * statistics.median(times[name]), 2)
    result["scan_over_unrolled_step"] = round(
        result["scan"]["step_ms_median"] / result["unrolled"]["step_ms_median"], 3
    )
    result |= {"layers": args.layers, "repeats": args.repeats, "jax": jax.__version__, "backend": jax.default_backend()}
    print(json.dumps(result, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
