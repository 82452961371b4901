"""Chunked prefill against one pass over the prompt: seconds, XLA memory, process peak memory, and what is kept.

    pask-jax bench prefill [--model qwen2.5-coder-0.5b] [--methods full,snapkv,h2o] [--budget 0.33]
                           [--prompt-tokens 2048,8192,16384] [--chunk 2048] [--repeats 1]
                           [--out results/bench_prefill.json]

Per (prompt length, method), in one process, both sides on the same random prompt of exactly that many tokens
(batch 1, a seeded draw from the vocabulary; speed and memory do not depend on the content): the engine with
`prefill_chunk=--chunk` and with one pass (`prefill_chunk` = the prompt length). Each side's prefill executable is
lowered and compiled (seconds, and XLA's memory analysis: temp = the scratch beyond weights and caches), then run
--repeats times timed (the median is reported; the runs reuse the compiled executable). The process's peak
resident memory (`VmHWM`, reset before each side through /proc/self/clear_refs on Linux) is read after the side's
runs: the weights plus the prefill's peak; `peak_rss_over_start_mib` is that peak less the resident memory at the
reset (the model, and the outputs the side before still holds), what the side's compile and prefill added. Kept
entries: the share of (layer, KV head) cache entries that both sides keep, and the largest difference of the
last-token logits.

Compute: each row's `model_gflop` counts the prefill's multiply-adds (2 flops each) from the model's sizes: the
projections and MLP over every token, causal attention (each query against the keys up to its own), the last
token's logits; each side's `gflop_per_s` is that over its seconds. `matmul_gflop_per_s`, measured once per run, is
what this machine's XLA does on a dense float32 matmul of the MLP's shape (a prefill chunk of tokens times the
gate projection): about the best a compute-bound prefill, made of such matmuls, can do on it.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from pask_jax.experiments.bench.machine import code_state, int_list, machine_info, write_result

DEFAULT_METHODS = ("full", "snapkv", "h2o")


def reset_peak_rss() -> bool:
    """Reset this process's peak resident set size (Linux); False where it cannot be."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def rss_mib(field: str = "VmHWM") -> float | None:
    """This process's resident memory in MiB from /proc/self/status (Linux): `VmHWM` its peak since the last reset,
    `VmRSS` now; None elsewhere."""
    try:
        line = next(x for x in Path("/proc/self/status").read_text().splitlines() if x.startswith(field + ":"))
    except (OSError, StopIteration):
        return None
    return round(int(line.split()[1]) / 1024, 1)


def kept_positions(caches) -> list[np.ndarray]:
    """Per layer group: the prompt positions kept in each (layer, row, KV head), sorted, free slots as -1."""
    out = []
    for cache in caches:
        pos = np.asarray(cache.pos)
        live = np.arange(cache.capacity) < np.asarray(cache.length)[..., None]
        out.append(np.sort(np.where(live, np.take_along_axis(pos, np.asarray(cache.table), -1), -1), -1))
    return out


def prefill_gflop(cfg, tokens: int) -> float:
    """GFLOP of one prefill over `tokens` positions: 2 per multiply-add of the projections and MLP per token, causal
    attention's scores and weighted values (query t sees t + 1 keys), and the last token's logits."""
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    per_token = 2 * (2 * cfg.hidden_size * q + 2 * cfg.hidden_size * kv + 3 * cfg.hidden_size * cfg.intermediate_size)
    attention = 2 * 2 * q * tokens * (tokens + 1) / 2
    logits = 2 * cfg.hidden_size * cfg.vocab_size
    return (cfg.num_layers * (tokens * per_token + attention) + logits) / 1e9


def matmul_gflop_per_s(rows: int, cfg, repeats: int = 5) -> float:
    """This machine's XLA rate on a dense float32 matmul f[rows, D] @ f[D, F] (the MLP's gate projection), the
    median of `repeats` timed runs after a warm-up."""
    keys = jax.random.split(jax.random.key(0))
    a = jax.random.normal(keys[0], (rows, cfg.hidden_size), jnp.float32)
    b = jax.random.normal(keys[1], (cfg.hidden_size, cfg.intermediate_size), jnp.float32)
    matmul = jax.jit(jnp.matmul)
    matmul(a, b).block_until_ready()
    seconds = []
    for _ in range(repeats):
        start = time.perf_counter()
        matmul(a, b).block_until_ready()
        seconds.append(time.perf_counter() - start)
    return round(2 * rows * cfg.hidden_size * cfg.intermediate_size / statistics.median(seconds) / 1e9, 1)


def run_side(engine, tokens: np.ndarray, capacities, repeats: int) -> tuple[dict, tuple]:
    """Compile, warm up and time one engine's prefill of `tokens` -> (figures, (logits, caches) of the last run)."""
    lengths = np.full(tokens.shape[0], tokens.shape[1], np.int32)
    roles = np.zeros_like(tokens)
    shape = engine.batch_shape([tokens.shape[1]] * tokens.shape[0], 64)
    reset_peak_rss()
    rss_start = rss_mib("VmRSS")  # the model, and what the side before still holds
    start = time.perf_counter()
    lowered = engine.lower_prefill(shape)
    lower_s = time.perf_counter() - start
    start = time.perf_counter()
    analysis = lowered.compile().memory_analysis()
    compile_s = time.perf_counter() - start
    seconds = []
    for _ in range(repeats):
        start = time.perf_counter()
        out = engine.prefill(tokens, lengths, roles, capacities)
        jax.block_until_ready(out)
        seconds.append(time.perf_counter() - start)
    prefill_s = statistics.median(seconds)
    figures = {
        "lower_s": round(lower_s, 3),
        "compile_s": round(compile_s, 3),
        "prefill_s": round(prefill_s, 3),
        "prefill_s_all": [round(s, 3) for s in seconds],
        "tokens_per_s": round(tokens.size / prefill_s, 1),
        "gflop_per_s": round(tokens.shape[0] * prefill_gflop(engine.cfg, tokens.shape[1]) / prefill_s, 1),
        "xla_temp_mib": round(analysis.temp_size_in_bytes / 2**20, 1),
        "xla_argument_mib": round(analysis.argument_size_in_bytes / 2**20, 1),
        "peak_rss_mib": (peak := rss_mib()),
        "rss_start_mib": rss_start,
        "peak_rss_over_start_mib": None if peak is None or rss_start is None else round(peak - rss_start, 1),
    }
    return figures, (out[0], out[1])


def run(args: argparse.Namespace) -> dict:
    from pask_jax.factory import make_engine
    from pask_jax.llm import LLM

    model = LLM(args.model, method="full").model
    rng = np.random.default_rng(0)
    result: dict = {
        "benchmark": "prefill",
        "model": args.model,
        "budget": args.budget,
        "chunk": args.chunk,
        "repeats": args.repeats,
        "machine": machine_info(),
        "code": code_state(),
        "matmul_gflop_per_s": matmul_gflop_per_s(args.chunk, model.config),
        "rows": [],
    }
    for prompt_tokens in args.prompt_tokens:
        tokens = rng.integers(0, model.config.vocab_size, (1, prompt_tokens), dtype=np.int32)
        for method in args.methods:
            budget = 1.0 if method == "full" else args.budget
            row: dict = {
                "method": method,
                "prompt_tokens": prompt_tokens,
                "model_gflop": round(prefill_gflop(model.config, prompt_tokens), 1),
            }
            outputs = {}
            for side, chunk in (("chunked", args.chunk), ("one_pass", prompt_tokens)):
                engine = make_engine(model, method, budget, prefill_chunk=chunk)
                capacities = engine.capacities(engine.batch_shape([prompt_tokens], 64).prompt_bucket, 64)
                row[side], outputs[side] = run_side(engine, tokens, capacities, args.repeats)
                jax.clear_caches()
            (logits_a, caches_a), (logits_b, caches_b) = outputs["chunked"], outputs["one_pass"]
            same = [
                (a == b) & (a >= 0) for a, b in zip(kept_positions(caches_a), kept_positions(caches_b), strict=True)
            ]
            live = sum(int((a >= 0).sum()) for a in kept_positions(caches_b))
            row["kept_agreement"] = round(sum(int(s.sum()) for s in same) / max(live, 1), 6)
            row["logits_max_abs_diff"] = float(np.abs(np.asarray(logits_a) - np.asarray(logits_b)).max())
            result["rows"].append(row)
            c, o = row["chunked"], row["one_pass"]
            print(
                f"{method:>8} P={prompt_tokens:<6} chunked {c['prefill_s']:7.2f}s temp {c['xla_temp_mib']:7.1f} MiB "
                f"rss +{c['peak_rss_over_start_mib']} | one pass {o['prefill_s']:7.2f}s temp "
                f"{o['xla_temp_mib']:7.1f} MiB rss +{o['peak_rss_over_start_mib']} | kept agree "
                f"{row['kept_agreement']:.4f}",
                flush=True,
            )
            if args.out:  # written after every row: an interrupted run keeps what it measured
                write_result(args.out, result)
    return result


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pask-jax bench prefill", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="qwen2.5-coder-0.5b", help="registered name or checkpoint path")
    p.add_argument("--methods", default=",".join(DEFAULT_METHODS), help="comma-separated methods")
    p.add_argument("--budget", type=float, default=0.33, help="KV budget of the compressed methods")
    p.add_argument(
        "--prompt-tokens", type=int_list, default=(2048, 8192, 16384), help="prompt lengths (comma-separated)"
    )
    p.add_argument("--chunk", type=int, default=2048, help="prefill chunk of the chunked side")
    p.add_argument("--repeats", type=int, default=1, help="timed prefills per side")
    p.add_argument("--out", help="results JSON")
    return p


def main(argv: list[str] | None = None) -> dict:
    parser = build_parser()
    args = parser.parse_args(argv)
    from pask_jax.methods import METHODS

    args.methods = tuple(args.methods.split(","))
    unknown = [m for m in args.methods if m not in METHODS]
    if unknown:
        parser.error(f"unknown methods {unknown}; known: {', '.join(METHODS)}")
    if not 0.0 < args.budget <= 1.0:
        parser.error(f"--budget {args.budget} must be in (0, 1]")
    if args.chunk < 1 or args.repeats < 1 or min(args.prompt_tokens) < 1:
        parser.error("--chunk, --repeats and every --prompt-tokens must be >= 1")
    return run(args)
