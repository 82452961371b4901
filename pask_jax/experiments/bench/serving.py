"""Serving benchmark: batch grammar-constrained generation under one KV-memory limit, Full KV vs PASK vs baselines.

    pask-jax bench serving --quick --out /tmp/serving_quick.json      # a few minutes on 2 CPU cores
    pask-jax bench serving --out results/serving.json                 # the full grid (an accelerator)

What is measured. For every workload (`bench.workloads`: `bfcl`, or long-context `<N>k` / `<N>`), every
method at every budget (Full KV once, at b = 1):

- The KV-memory limit of a workload is the cache Full KV allocates at `--memory-batch` sequences
  (`Engine.cache_bytes` of its `Engine.batch_shape`: slots per layer group x K/V + position/role/score/table words).
  Each method runs at the largest batch whose cache fits that limit, capped by `--max-batch`. The engine pads a
  batch to a power of two and allocates for the padded batch, so the fitting batch is a power of two; the JSON
  also reports `fit_batch_unpadded` (limit / bytes per sequence) and whether the cap applied.
- Per run (one `Engine.generate` call over the batch): generated tokens/s (end to end, prefill included, and decode
  only), TPOT (mean and p95 of the decode-step wall times), TTFT (prefill + first token), host-side parser time per
  step (`GrammarConstraint.mask_s + advance_s`) and its share of the step time, kept/full KV ratio. Generation has a
  fixed length (`--max-new-tokens`; after its call the grammar only allows EOS, and EOS does not stop a row unless
  `--stop-at-eos`), so every method does the same work per sequence.
- Peak memory: XLA's compiled memory analysis of the prefill and decode executables at the run's shape
  (`Engine.lower`; argument + output - alias + temp bytes), the analytic cache bytes, the weights, and the device's
  `memory_stats()` peak where the backend has one (not on CPU). `peak_memory_bytes` is the larger of the two steps
  (the weights + cache estimate when no analysis is available).
- Each (method, budget) gets one untimed warm-up call with the same compiled shapes, then `--repeats` timed calls,
  interleaved across methods (repeat r of every method, then r + 1), so noise hits all methods alike. XLA backend
  compiles during the timed calls are counted (`jax.monitoring` event `/jax/core/compile/backend_compile_duration`)
  and reported per run; they should be 0. Every figure is a median over repeats with its min / max / IQR, and every
  ratio vs Full KV is taken per repeat against Full KV's same repeat, then its median and min / max.
- Decode-step sweep (`decode_sweep` in the JSON): one method (`--sweep-method`) at budgets `--sweep-budgets` on the
  longest workload's prompts at `--sweep-batch`: median step time against the slots each layer keeps, to show that the
  step cost follows the budget.

CPU caveats. On a few CPU cores at these model sizes a decode step is bound by reading the weights (2 GB of float32
for the 0.5B model) far more than the KV cache (24.6 KB per token for it), so shrinking the cache barely changes the
step time at a fixed batch; the savings show through the larger batch that fits the same memory. Prefill (about
140 tokens/s for the 0.5B model on 2 cores) dominates the wall time of long-context workloads, which is why
`--quick` runs one short BFCL prompt and a 1k-token one, batches of at most 2 and 16 new tokens: about 10 minutes on
2 CPU cores shared with another job (model load ~25 s, each warm-up ~20-50 s, mostly compiling). On CPU the XLA
peak is the weights plus the prefill's activations, so it hardly moves with the KV budget at these sizes. The PASK
paper's headline (GPU, budget 0.33) is up to 2.2x throughput, 3.3x lower TPOT and 0.53x peak memory vs Full KV;
expect far smaller ratios here.

`--model tiny` runs a random 2-layer model on tokenizer-free synthetic prompts (no grammar, no prompt roles, PASK
uncalibrated), for tests.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import shlex
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
from flax import nnx

from pask_jax.arguments import AUTO_POLICY, NO_POLICY, policy_spec
from pask_jax.experiments.bench.machine import code_state, compiles_so_far, device_peak_bytes, machine_info
from pask_jax.experiments.bench.stream import (
    SCHEDULERS,
    Stream,
    bench_stream,
    format_stream_table,
    plot_stream,
    stream_result,
)
from pask_jax.experiments.bench.workloads import Workload, build_workload, workload_tokens
from pask_jax.factory import make_engine
from pask_jax.memory import rows_fitting, tree_bytes
from pask_jax.models.decoder import Decoder, ModelConfig
from pask_jax.models.tokenizer import Tokenizer
from pask_jax.policy import PersistencePolicy, resolve_policy
from pask_jax.runtime.engine import Engine
from pask_jax.runtime.sampling import SamplingConfig
from pask_jax.runtime.shapes import NEW_TOKEN_BUCKET, BatchShape, new_token_bucket, pool_sizes
from pask_jax.structure import GrammarConstraint

DEFAULT_MODEL = "qwen2.5-coder-0.5b"
DEFAULT_POLICY = AUTO_POLICY  # the shipped policy that fits the model
TINY = "tiny"
MEMORY_FIELDS = ("argument_size_in_bytes", "output_size_in_bytes", "alias_size_in_bytes", "temp_size_in_bytes")
QUICK = dict(
    methods="full,pask,snapkv",
    budgets="0.33",
    workloads="bfcl,1k",
    max_new_tokens=16,
    memory_batch=1,
    max_batch=2,
    pool=1,
    sweep_budgets="1.0,0.2",
    sweep_workload="bfcl",
)


@dataclasses.dataclass(frozen=True)
class BenchConfig:
    model: str = DEFAULT_MODEL
    methods: tuple[str, ...] = ("full", "pask", "snapkv", "streamingllm")
    budgets: tuple[float, ...] = (0.2, 0.33, 0.5)
    workloads: tuple[str, ...] = ("bfcl", "2k", "4k", "8k")
    repeats: int = 3
    max_new_tokens: int = 64
    memory_batch: int = 8
    max_batch: int = 64
    pool: int = 8  # distinct prompts per workload; a batch cycles through them
    num_groups: int = 4
    policy: str | None = DEFAULT_POLICY  # "auto", a policy directory, or None (PASK uncalibrated)
    stop_at_eos: bool = False
    memory_analysis: bool = True
    sweep_method: str = "snapkv"
    sweep_budgets: tuple[float, ...] = (1.0, 0.5, 0.33, 0.2, 0.1)
    sweep_workload: str | None = None  # None: the longest workload; "none": no sweep
    sweep_batch: int = 1
    seed: int = 0
    prefill_rows: int | None = None  # continuous batching: rows prefilled together at most (None: all admitted)


# ---- model and engines ----------------------------------------------------------------------------------------------


@dataclasses.dataclass
class Setup:
    """The model and what generation needs around it (tokenizer, PASK policy)."""

    name: str
    model: Decoder
    tokenizer: Tokenizer | None  # None: the tiny model's synthetic prompts
    policy: PersistencePolicy | None


def load_setup(cfg: BenchConfig) -> Setup:
    if cfg.model == TINY:
        return Setup(TINY, Decoder(ModelConfig.tiny("qwen2", vocab_size=256), rngs=nnx.Rngs(cfg.seed)), None, None)
    from pask_jax.checkpoint import Checkpoint

    checkpoint = Checkpoint.open(cfg.model)
    policy = resolve_policy(cfg.policy or None, checkpoint.fingerprint) if "pask" in cfg.methods else None
    return Setup(cfg.model, checkpoint.weights("float32"), checkpoint.tokenizer, policy)


def bench_engine(setup: Setup, method: str, budget: float, cfg: BenchConfig) -> Engine:
    policy = setup.policy if method == "pask" else None
    return make_engine(
        setup.model,
        method,
        budget,
        policy=policy,
        num_groups=None if policy is not None else cfg.num_groups,
        stop_token_ids=setup.tokenizer.eos_token_ids if cfg.stop_at_eos and setup.tokenizer else (),
    )


def workload_of(setup: Setup, name: str, cfg: BenchConfig) -> Workload:
    return build_workload(name, setup.tokenizer, setup.model.config.vocab_size, cfg.pool, cfg.seed)


# ---- cache bytes, batch under the limit -----------------------------------------------------------------------------


def rows_shape(engine: Engine, prompt_bucket: int, max_new_tokens: int, rows: int) -> BatchShape:
    """The engine's shape for `rows` prompts that fill `prompt_bucket`."""
    return engine.batch_shape([prompt_bucket] * rows, max_new_tokens)


def largest_batch(bytes_at: Callable[[int], int], limit: int, ceiling: int = 1 << 16) -> int:
    """Largest power-of-two batch whose cache fits `limit` bytes (0: not even one row)."""
    batch = 0
    while batch < ceiling and bytes_at(max(2 * batch, 1)) <= limit:
        batch = max(2 * batch, 1)
    return batch


def memory_analysis(engine: Engine, shape: BatchShape, sampling: SamplingConfig) -> dict[str, dict]:
    """Per step: XLA's compiled memory analysis (bytes) and `peak` = argument + output - alias + temp."""
    lowered = engine.lower(shape, sampling)
    out = {}
    for name, step in (("prefill", lowered.prefill), ("decode", lowered.decode)):
        try:
            stats = step.compile().memory_analysis()
            fields = {f: int(getattr(stats, f)) for f in MEMORY_FIELDS}
        except Exception as exc:  # no analysis on this backend / jax version: report why
            out[name] = {"error": f"{type(exc).__name__}: {exc}"[:300]}
            continue
        live = fields["argument_size_in_bytes"] + fields["output_size_in_bytes"] + fields["temp_size_in_bytes"]
        out[name] = fields | {"peak": live - fields["alias_size_in_bytes"]}  # donated caches: counted once
    return out


# ---- one timed call -------------------------------------------------------------------------------------------------


def warmup_tokens(max_new_tokens: int) -> int:
    """Fewest new tokens with the same compiled shapes (same capacity bucket) that still run a decode step."""
    lowest = new_token_bucket(max_new_tokens) - NEW_TOKEN_BUCKET + 1
    return min(max_new_tokens, max(lowest, 2))


def generate_once(engine: Engine, workload: Workload, batch: int, max_new_tokens: int) -> dict:
    """One `generate` over `batch` rows of the workload -> its timings, parser time and kept ratios."""
    prompts, roles, grammars = workload.take(batch)
    constraint = None if grammars is None else GrammarConstraint(grammars, engine.cfg.vocab_size)
    compiles = compiles_so_far()
    start = time.perf_counter()
    gens = engine.generate(
        prompts, SamplingConfig(max_new_tokens=max_new_tokens), prompt_roles=roles, constraint=constraint
    )
    wall = time.perf_counter() - start
    steps = np.asarray(max((g.stats.token_times_s for g in gens), key=len), np.float64)
    tokens = sum(g.stats.generated_tokens for g in gens)
    parser_s = 0.0 if constraint is None else constraint.mask_s + constraint.advance_s
    return {
        "wall_s": wall,
        "generated_tokens": tokens,
        "tokens_per_s": tokens / wall,
        "decode_tokens_per_s": (tokens - batch) / steps.sum() if steps.size else 0.0,
        "ttft_ms": 1e3 * gens[0].stats.ttft_s,
        "tpot_ms": 1e3 * float(steps.mean()) if steps.size else 0.0,
        "tpot_p95_ms": 1e3 * float(np.percentile(steps, 95)) if steps.size else 0.0,
        "parser_ms_per_step": None if constraint is None else 1e3 * parser_s / max(constraint.steps, 1),
        "parser_fraction": None if constraint is None else parser_s / max(float(steps.sum()), 1e-12),
        "kept_ratio_mean": float(np.mean([g.stats.kept_ratio_mean for g in gens])),
        "kept_ratio_max": float(np.max([g.stats.kept_ratio_max for g in gens])),
        "kv_bytes_ratio_max": float(np.max([g.stats.kv_bytes_ratio_max for g in gens])),
        "recompiles": compiles_so_far() - compiles,
    }


def spread(values: Sequence[float]) -> dict[str, float]:
    """Median, min, max and quartiles of repeated measurements."""
    v = np.asarray(values, np.float64)
    q1, median, q3 = np.percentile(v, [25, 50, 75])
    return {"median": float(median), "min": float(v.min()), "max": float(v.max()), "q1": float(q1), "q3": float(q3)}


TIMED = ("tokens_per_s", "decode_tokens_per_s", "ttft_ms", "tpot_ms", "tpot_p95_ms", "parser_ms_per_step")
RATIOS = {"throughput": "tokens_per_s", "tpot": "tpot_ms", "tpot_p95": "tpot_p95_ms", "ttft": "ttft_ms"}


# ---- one workload: every method under the limit ---------------------------------------------------------------------


@dataclasses.dataclass
class Contender:
    method: str
    budget: float
    engine: Engine
    fit_batch: int
    fit_batch_unpadded: int
    batch: int
    memory: dict
    repeats: list[dict] = dataclasses.field(default_factory=list)


def engine_grid(cfg: BenchConfig) -> list[tuple[str, float]]:
    """(method, budget) pairs: Full KV once at b = 1 and first (every ratio needs it), the rest at every budget."""
    others = [(m, b) for m in cfg.methods if m != "full" for b in cfg.budgets]
    return [("full", 1.0), *others]


def prepare(setup: Setup, workload: Workload, method: str, budget: float, cfg: BenchConfig, limit: int) -> Contender:
    """Engine, batch under the memory limit, warm-up call (same compiled shapes), memory figures."""
    engine = bench_engine(setup, method, budget, cfg)

    def bytes_at(batch: int) -> int:
        return engine.cache_bytes(rows_shape(engine, workload.prompt_bucket, cfg.max_new_tokens, batch))

    fit = largest_batch(bytes_at, limit)
    batch = min(fit, cfg.max_batch)
    if batch < 1:
        raise ValueError(f"{method} at budget {budget}: not one sequence fits the limit of {limit} cache bytes")
    generate_once(engine, workload, batch, warmup_tokens(cfg.max_new_tokens))
    sampling = SamplingConfig(max_new_tokens=cfg.max_new_tokens)
    shape = engine.batch_shape([len(p) for p in workload.take(batch)[0]], cfg.max_new_tokens)
    xla = memory_analysis(engine, shape, sampling) if cfg.memory_analysis else {}
    peaks = [step["peak"] for step in xla.values() if "peak" in step]
    memory = {
        "limit_bytes": limit,
        "cache_bytes": engine.cache_bytes(shape),
        "cache_bytes_per_sequence": bytes_at(2) - bytes_at(1),
        "weights_bytes": tree_bytes(engine.params),
        "xla": xla,
        "device_peak_bytes": device_peak_bytes(),
        "capacities": list(shape.capacities),
    }
    memory["peak_bytes"] = max(peaks) if peaks else memory["weights_bytes"] + memory["cache_bytes"]
    memory["peak_source"] = "xla_memory_analysis" if peaks else "weights_plus_cache"
    return Contender(method, budget, engine, fit, rows_fitting(bytes_at, limit), batch, memory)


def ratios_vs_full(run: Contender, full: Contender) -> tuple[dict, dict]:
    """Per-repeat ratios against Full KV's same repeat -> (medians, spreads)."""
    medians, spreads = {}, {}
    for ratio, key in RATIOS.items():
        values = [r[key] / f[key] for r, f in zip(run.repeats, full.repeats, strict=True) if f[key]]
        if values:
            spreads[ratio] = spread(values)
            medians[ratio] = spreads[ratio]["median"]
    medians["peak_memory"] = run.memory["peak_bytes"] / full.memory["peak_bytes"]
    decode_peaks = [c.memory["xla"].get("decode", {}).get("peak") for c in (run, full)]
    if None not in decode_peaks:
        medians["decode_peak_memory"] = decode_peaks[0] / decode_peaks[1]
    medians["cache_bytes"] = run.memory["cache_bytes"] / full.memory["cache_bytes"]
    medians["cache_bytes_per_sequence"] = (
        run.memory["cache_bytes_per_sequence"] / full.memory["cache_bytes_per_sequence"]
    )
    medians["batch"] = run.batch / full.batch
    return medians, spreads


def run_record(run: Contender, full: Contender, workload: Workload, cfg: BenchConfig) -> dict:
    stats = {key: spread([r[key] for r in run.repeats]) for key in TIMED if run.repeats[0][key] is not None}
    ratio, ratio_spread = ratios_vs_full(run, full)
    parser = [r["parser_fraction"] for r in run.repeats if r["parser_fraction"] is not None]
    return {
        "method": run.method,
        "budget": run.budget,
        "workload": workload.name,
        "batch": run.batch,
        "fit_batch": run.fit_batch,
        "fit_batch_unpadded": run.fit_batch_unpadded,
        "batch_capped": run.batch < run.fit_batch,
        "prompt_bucket": workload.prompt_bucket,
        "max_new_tokens": cfg.max_new_tokens,
        **{key: stats[key]["median"] for key in stats},
        "peak_memory_bytes": run.memory["peak_bytes"],
        "parser_fraction": float(np.median(parser)) if parser else None,
        "kept_ratio_max": max(r["kept_ratio_max"] for r in run.repeats),
        "kv_bytes_ratio_max": max(r["kv_bytes_ratio_max"] for r in run.repeats),
        "recompiles_after_warmup": sum(r["recompiles"] for r in run.repeats),
        "ratio_vs_full": ratio,
        "ratio_spread": ratio_spread,
        "spread": stats,
        "memory": run.memory,
        "repeats": run.repeats,
    }


def bench_workload(
    setup: Setup,
    workload: Workload,
    cfg: BenchConfig,
    progress: Callable[[str], None],
    checkpoint: Callable[[list[dict]], None] = lambda runs: None,
) -> list[dict]:
    """Every (method, budget) on one workload under Full KV's memory at `memory_batch`; repeats interleaved.

    `checkpoint` gets the records after every round of repeats (a run cut short keeps its finished rounds).
    """
    full_engine = bench_engine(setup, "full", 1.0, cfg)
    limit = full_engine.cache_bytes(
        rows_shape(full_engine, workload.prompt_bucket, cfg.max_new_tokens, cfg.memory_batch)
    )
    contenders = []
    for method, budget in engine_grid(cfg):
        progress(f"{workload.name}: warm-up {method} b={budget:g}")
        contenders.append(prepare(setup, workload, method, budget, cfg, limit))
    for r in range(cfg.repeats):
        for c in contenders:
            progress(f"{workload.name}: repeat {r + 1}/{cfg.repeats} {c.method} b={c.budget:g} batch {c.batch}")
            c.repeats.append(generate_once(c.engine, workload, c.batch, cfg.max_new_tokens))
        checkpoint([run_record(c, contenders[0], workload, cfg) for c in contenders])
    return [run_record(c, contenders[0], workload, cfg) for c in contenders]


def decode_sweep(setup: Setup, workload: Workload, cfg: BenchConfig, progress: Callable[[str], None]) -> dict:
    """Median decode-step time vs the slots each layer keeps, one method over `sweep_budgets`, repeats interleaved."""
    engines = {b: bench_engine(setup, cfg.sweep_method, b, cfg) for b in cfg.sweep_budgets}
    times: dict[float, list[dict]] = {b: [] for b in engines}
    for budget, engine in engines.items():
        progress(f"sweep: warm-up {cfg.sweep_method} b={budget:g}")
        generate_once(engine, workload, cfg.sweep_batch, warmup_tokens(cfg.max_new_tokens))
    for r in range(cfg.repeats):
        for budget, engine in engines.items():
            progress(f"sweep: repeat {r + 1}/{cfg.repeats} b={budget:g}")
            times[budget].append(generate_once(engine, workload, cfg.sweep_batch, cfg.max_new_tokens))
    points = []
    for budget, engine in engines.items():
        capacities = rows_shape(engine, workload.prompt_bucket, cfg.max_new_tokens, 1).capacities
        slots = [pool_sizes(capacities[g])[0] for g, (a, b) in enumerate(engine.plan.groups) for _ in range(a, b)]
        runs = times[budget]
        points.append(
            {
                "budget": budget,
                "tpot_ms": spread([r["tpot_ms"] for r in runs]),
                "capacity_slots_per_layer": slots,
                "capacity_slots_mean": float(np.mean(slots)),
                "kept_ratio_mean": float(np.mean([r["kept_ratio_mean"] for r in runs])),
                "kept_ratio_max": max(r["kept_ratio_max"] for r in runs),
                "layer_fractions": list(engine.fractions),
                "recompiles_after_warmup": sum(r["recompiles"] for r in runs),
            }
        )
    top = max(points, key=lambda p: p["budget"])
    for p in points:
        p["tpot_ratio_vs_top_budget"] = p["tpot_ms"]["median"] / top["tpot_ms"]["median"]
        p["slots_ratio_vs_top_budget"] = p["capacity_slots_mean"] / top["capacity_slots_mean"]
    return {
        "method": cfg.sweep_method,
        "workload": workload.name,
        "batch": cfg.sweep_batch,
        "prompt_bucket": workload.prompt_bucket,
        "prompt_tokens": [len(p) for p in workload.take(cfg.sweep_batch)[0]],
        "points": points,
    }


# ---- driver, table, plot --------------------------------------------------------------------------------------------


def workload_info(workload: Workload, runs: list[dict]) -> dict:
    return {
        "description": workload.description,
        "prompt_bucket": workload.prompt_bucket,
        "prompt_tokens": [len(p) for p in workload.prompts],
        "items": workload.item_ids,
        "memory_limit_bytes": runs[0]["memory"]["limit_bytes"] if runs else None,
    }


def run_benchmark(
    cfg: BenchConfig,
    out: Path | None = None,
    setup: Setup | None = None,
    progress: Callable[[str], None] = lambda msg: None,
    command: str = "",
) -> dict:
    """The whole benchmark -> result dict (written to `out` after every workload, so a cut-off run keeps its part)."""
    compiles_so_far()  # start listening before anything compiles
    setup = setup or load_setup(cfg)
    result = {
        "model": setup.name,
        "config": dataclasses.asdict(cfg),
        "command": command,
        "machine": machine_info(),
        "code": code_state(),
        "workloads": {},
        "runs": [],
        "decode_sweep": None,
        "complete": False,
    }
    workloads = {}
    for name in cfg.workloads:
        progress(f"{name}: building prompts")
        workloads[name] = workload = workload_of(setup, name, cfg)
        checkpoint = functools.partial(_save_runs, result, out, workload, list(result["runs"]))
        checkpoint(bench_workload(setup, workload, cfg, progress, checkpoint))
    sweep_name = cfg.sweep_workload or max(workloads, key=lambda w: workloads[w].prompt_bucket, default=None)
    if sweep_name and sweep_name != "none":
        sweep_workload = workloads.get(sweep_name) or workload_of(setup, sweep_name, cfg)
        result["decode_sweep"] = decode_sweep(setup, sweep_workload, cfg, progress)
    result["complete"] = True
    _write(result, out)
    return result


def run_stream_benchmark(
    cfg: BenchConfig,
    schedulers: Sequence[str],
    out: Path | None = None,
    progress: Callable[[str], None] = lambda msg: None,
    command: str = "",
) -> dict:
    """`--scheduler`: every workload as a request stream (`pask_jax.experiments.bench.stream`), rows stopping at EOS."""
    cfg = dataclasses.replace(cfg, stop_at_eos=True)  # natural answer lengths
    compiles_so_far()
    setup = load_setup(cfg)
    result = stream_result(setup.name, dataclasses.asdict(cfg) | {"schedulers": list(schedulers)}, command)
    for name in cfg.workloads:
        progress(f"{name}: building prompts")
        workload = workload_of(setup, name, cfg)
        stream = Stream.of(workload, cfg.max_new_tokens, cfg.seed)
        engines = [(m, b, bench_engine(setup, m, b, cfg)) for m, b in engine_grid(cfg)]
        part = bench_stream(
            engines, stream, schedulers, cfg.memory_batch, cfg.max_batch, cfg.repeats, progress, cfg.prefill_rows
        )
        result["workloads"][name] = {
            "description": workload.description,
            "prompt_tokens": [len(workload.prompts[i]) for i in stream.order],
            "items": [workload.item_ids[i] for i in stream.order],
            **part,
        }
        _write(result, out)
    result["complete"] = True
    _write(result, out)
    return result


def _save_runs(result: dict, out: Path | None, workload: Workload, earlier: list[dict], runs: list[dict]) -> None:
    """Put one workload's (possibly partial) records after the earlier workloads' and write the JSON."""
    result["runs"] = earlier + runs
    result["workloads"][workload.name] = workload_info(workload, runs)
    _write(result, out)


def _write(result: dict, out: Path | None) -> None:
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=1) + "\n")


def _cell(value: float, ratio: float | None) -> str:
    number = f"{value:.0f}" if abs(value) >= 100 else f"{value:.3g}"
    return number + (f" ({ratio:.2f}x)" if ratio is not None else "")


def format_table(result: dict) -> str:
    """Markdown: one row per (workload, method, budget), medians with their ratio vs Full KV."""
    head = [
        "workload",
        "method",
        "budget",
        "batch (fits)",
        "tokens/s",
        "TPOT ms",
        "TPOT p95 ms",
        "TTFT ms",
        "peak MB",
        "KV MB",
        "parser ms/step",
        "recompiles",
    ]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in result["runs"]:
        ratio = r["ratio_vs_full"]
        parser = r.get("parser_ms_per_step")
        cells = [
            r["workload"],
            r["method"],
            f"{r['budget']:g}",
            f"{r['batch']} ({r['fit_batch']})",
            _cell(r["tokens_per_s"], ratio.get("throughput")),
            _cell(r["tpot_ms"], ratio.get("tpot")),
            _cell(r["tpot_p95_ms"], ratio.get("tpot_p95")),
            _cell(r["ttft_ms"], ratio.get("ttft")),
            _cell(r["peak_memory_bytes"] / 2**20, ratio.get("peak_memory")),
            _cell(r["memory"]["cache_bytes"] / 2**20, ratio.get("cache_bytes")),
            "-" if parser is None else f"{parser:.3f}",
            str(r["recompiles_after_warmup"]),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(result: dict, path: Path) -> list[Path]:
    """Throughput and TPOT ratio vs budget per method, one column per workload (+ the decode-step sweep)."""
    try:
        import matplotlib
    except ImportError as exc:
        raise ImportError("plots need matplotlib: pip install 'pask-jax[plots]', or pass --no-plot") from exc

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(result["workloads"])
    sweep = result.get("decode_sweep")
    cols = len(names) + (1 if sweep else 0)
    fig, axes = plt.subplots(2, cols, figsize=(3.6 * cols, 6.4), squeeze=False)
    for col, workload in enumerate(names):
        runs = [r for r in result["runs"] if r["workload"] == workload]
        for row, (ratio, label) in enumerate((("throughput", "throughput / Full KV"), ("tpot", "TPOT / Full KV"))):
            ax = axes[row, col]
            ax.axhline(1.0, color="black", linestyle="--", linewidth=1, label="full")
            for method in dict.fromkeys(r["method"] for r in runs if r["method"] != "full"):
                points = sorted((r["budget"], r) for r in runs if r["method"] == method and ratio in r["ratio_spread"])
                if not points:
                    continue
                x = [b for b, _ in points]
                y = [r["ratio_vs_full"][ratio] for _, r in points]
                lo = [r["ratio_vs_full"][ratio] - r["ratio_spread"][ratio]["min"] for _, r in points]
                hi = [r["ratio_spread"][ratio]["max"] - r["ratio_vs_full"][ratio] for _, r in points]
                ax.errorbar(x, y, yerr=[lo, hi], marker="o", capsize=3, label=method)
                for b, r in points:
                    ax.annotate(f"B={r['batch']}", (b, r["ratio_vs_full"][ratio]), fontsize=6, alpha=0.7)
            ax.set_xlabel("KV budget b")
            ax.set_ylabel(label)
            ax.set_title(f"{workload} (prompt bucket {result['workloads'][workload]['prompt_bucket']})", fontsize=9)
            ax.grid(alpha=0.3)
        axes[0, col].legend(fontsize=7)
    if sweep:
        points = sorted(sweep["points"], key=lambda p: p["budget"])
        ax = axes[0, -1]
        x = [p["capacity_slots_mean"] for p in points]
        ax.plot(x, [p["tpot_ms"]["median"] for p in points], marker="o")
        for p, xi in zip(points, x, strict=True):
            ax.annotate(f"b={p['budget']:g}", (xi, p["tpot_ms"]["median"]), fontsize=7)
        ax.set_xlabel("KV slots per layer and head")
        ax.set_ylabel("decode step ms (median)")
        ax.set_title(f"sweep: {sweep['method']}, {sweep['workload']}, batch {sweep['batch']}", fontsize=9)
        ax.grid(alpha=0.3)
        ax = axes[1, -1]
        budgets = [p["budget"] for p in points]
        ax.plot(budgets, [p["tpot_ratio_vs_top_budget"] for p in points], marker="o", label="step time")
        ax.plot(budgets, [p["slots_ratio_vs_top_budget"] for p in points], marker="s", label="KV slots")
        ax.set_xlabel("KV budget b")
        ax.set_ylabel("ratio vs the largest budget")
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
    fig.suptitle(f"{result['model']}: serving under Full KV's memory at batch {result['config']['memory_batch']}")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return [path]


# ---- command line ---------------------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="pask-jax bench serving", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--model", default=DEFAULT_MODEL, help=f"registered name, .gguf, HF dir, or '{TINY}' (random)")
    p.add_argument("--methods", help="comma-separated (default full,pask,snapkv,streamingllm); full is always run")
    p.add_argument("--budgets", help="comma-separated total KV budgets (default 0.2,0.33,0.5)")
    p.add_argument("--workloads", help="comma-separated: bfcl, <N>k or <N> prompt tokens (default bfcl,2k,4k,8k)")
    p.add_argument("--repeats", type=int, default=3, help="timed calls per (method, budget, workload)")
    p.add_argument("--max-new-tokens", type=int, help="generated tokens per sequence (default 64)")
    p.add_argument("--memory-batch", type=int, help="Full-KV batch whose cache bytes are the memory limit (default 8)")
    p.add_argument("--max-batch", type=int, help="cap on the batch actually run (default 64)")
    p.add_argument("--pool", type=int, help="distinct prompts per workload (default 8)")
    p.add_argument(
        "--policy",
        default=DEFAULT_POLICY,
        help="PASK policy, as `pask-jax run` takes it: auto (the shipped one that fits the model), a directory, or "
        "none (PASK uncalibrated)",
    )
    p.add_argument("--stop-at-eos", action="store_true", help="stop a row at EOS (default: fixed-length generation)")
    p.add_argument("--no-memory-analysis", action="store_true", help="skip XLA's compiled memory analysis")
    p.add_argument("--sweep-method", default="snapkv", help="method of the decode-step sweep")
    p.add_argument("--sweep-budgets", help="budgets of the decode-step sweep (default 1.0,0.5,0.33,0.2,0.1)")
    p.add_argument("--sweep-workload", help="workload of the sweep (default: the longest; 'none' to skip)")
    p.add_argument("--sweep-batch", type=int, default=1)
    p.add_argument(
        "--scheduler",
        help="comma-separated static,continuous: serve each workload as a request stream with natural answer "
        "lengths under each scheduler (pask_jax.experiments.bench.stream) instead of fixed-length batches",
    )
    p.add_argument(
        "--prefill-rows",
        type=int,
        help="continuous batching: rows prefilled together at most (default: every request admitted at once)",
    )
    p.add_argument("--seed", type=int, default=0, help="prompt pool draw and the stream's arrival order")
    p.add_argument("--quick", action="store_true", help="small CPU setting: " + json.dumps(QUICK))
    p.add_argument("--out", type=Path, default=Path("results/serving.json"))
    p.add_argument("--plot", type=Path, help="plot path (default: --out with .png)")
    p.add_argument("--no-plot", action="store_true", help="write no plot (no matplotlib needed)")
    return p


def _floats(text: str) -> tuple[float, ...]:
    return tuple(float(x) for x in text.split(","))


def config_from_args(args: argparse.Namespace) -> BenchConfig:
    """Flags -> config; with --quick, unset flags take the QUICK values, otherwise BenchConfig's defaults."""
    base = BenchConfig()
    quick = QUICK if args.quick else {}

    def pick(name: str):
        value = getattr(args, name, None)
        return quick.get(name) if value is None else value

    def listed(name: str, convert: Callable[[str], tuple]) -> tuple:
        value = pick(name)
        return getattr(base, name) if value is None else convert(value)

    def number(name: str):
        value = pick(name)
        return getattr(base, name) if value is None else value

    methods = listed("methods", lambda s: tuple(m for m in s.split(",") if m))
    return BenchConfig(
        model=args.model,
        methods=methods if "full" in methods else ("full", *methods),
        budgets=listed("budgets", _floats),
        workloads=listed("workloads", lambda s: tuple(w for w in s.split(",") if w)),
        repeats=args.repeats,
        max_new_tokens=number("max_new_tokens"),
        memory_batch=number("memory_batch"),
        max_batch=number("max_batch"),
        pool=number("pool"),
        policy=policy_spec(args.policy or NO_POLICY),  # '' as none, as before
        stop_at_eos=args.stop_at_eos,
        memory_analysis=not args.no_memory_analysis,
        sweep_method=args.sweep_method,
        sweep_budgets=listed("sweep_budgets", _floats),
        sweep_workload=pick("sweep_workload"),
        sweep_batch=args.sweep_batch,
        seed=args.seed,
        prefill_rows=args.prefill_rows,
    )


def main(argv: list[str] | None = None) -> dict:
    """`pask-jax bench serving ARGS` -> the result dict (also written to --out, its table to --out with .md)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser()
    args = parser.parse_args(argv)
    cfg = config_from_args(args)
    if min(cfg.repeats, cfg.memory_batch, cfg.max_batch, 1 if cfg.prefill_rows is None else cfg.prefill_rows) < 1:
        parser.error("--repeats, --memory-batch, --max-batch and --prefill-rows must be >= 1")
    for name in cfg.workloads:
        try:
            workload_tokens(name)  # fail on a bad name before loading anything
        except ValueError as exc:
            parser.error(str(exc))
    start = time.perf_counter()

    def progress(msg: str) -> None:
        print(f"[{time.perf_counter() - start:7.1f}s] {msg}", file=sys.stderr, flush=True)

    command = shlex.join(["pask-jax", "bench", "serving", *argv])
    if args.scheduler:
        schedulers = [s for s in args.scheduler.split(",") if s]
        if unknown := set(schedulers) - set(SCHEDULERS):
            parser.error(f"unknown scheduler(s) {', '.join(sorted(unknown))}; choose from {', '.join(SCHEDULERS)}")
        result = run_stream_benchmark(cfg, schedulers, args.out, progress, command)
        table = format_stream_table(result)
        print(table)
        args.out.with_suffix(".md").write_text(f"`{command}`\n\n{table}\n")
        if not args.no_plot:
            progress(f"wrote {plot_stream(result, args.plot or args.out.with_suffix('.png'))}")
        return result
    result = run_benchmark(cfg, args.out, progress=progress, command=command)
    table = format_table(result)
    print(table)
    args.out.with_suffix(".md").write_text(f"`{result['command']}`\n\n{table}\n")
    if not args.no_plot:
        for path in plot(result, args.plot or args.out.with_suffix(".png")):
            progress(f"wrote {path}")
    progress(f"wrote {args.out} and {args.out.with_suffix('.md')}")
    return result
