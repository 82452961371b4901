"""Request-stream serving: a workload's requests through one engine under a KV memory limit, static batching vs
continuous batching, natural output lengths.

    pask-jax bench serving --scheduler static,continuous --workloads bfcl --pool 64 --methods full,pask,snapkv \\
        --budgets 0.2,0.33 --max-new-tokens 128 --out results/serving_stream.json

Every request of the workload (`--pool` of them, shuffled by `--seed`: an arrival order, not length-sorted) is
waiting at time 0. Each row stops at EOS or at `--max-new-tokens`, so answers have their natural lengths.
- Memory: the limit is Full KV's cache at `--memory-batch` rows of the workload's shape (its longest prompt's bucket
  and the new-token bucket). A method runs with as many rows as fit it (at most `--max-batch`): static batches are
  powers of two (the engine pads a batch to one), continuous rows any count (`scheduler.rows_for_memory`).
- static: the requests in arrival order, `rows` at a time, each batch decoding until its longest answer ends.
  continuous: `ContinuousBatcher` with `rows` rows; a row that ends takes the next request (at most `--prefill-rows`
  prefilled together); the next token masks are built on the host while the step runs. continuous-sync: the same,
  masks built before the step (the grammar on the critical path, as in static batching).
- Measured per run: requests/s and output tokens/s (wall clock of the whole stream), TTFT p50 / p95 (from time 0 to
  the request's first token: waiting included), end-to-end latency p50 / p95, TPOT (mean over requests of their
  decode-step times), KV cache bytes and weights. Ratios: against Full KV under the same scheduler, and continuous
  against static for the same method, per repeat, then the median.
- Each (method, budget, scheduler) first compiles every step the stream can take, ahead of time and without running
  a prompt (`precompile`), then `--repeats` timed runs, interleaved across all of them; XLA compiles during timed runs
  are counted (`recompiles`).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

from pask_jax.experiments.bench.machine import code_state, compiles_so_far, machine_info
from pask_jax.experiments.bench.workloads import Workload
from pask_jax.memory import tree_bytes
from pask_jax.runtime.engine import Engine
from pask_jax.runtime.sampling import SamplingConfig
from pask_jax.runtime.scheduler import ContinuousBatcher, SequenceRequest, row_shape, rows_for_memory
from pask_jax.structure import GrammarConstraint

# continuous-sync: continuous batching with the token masks built before each step instead of while it runs
SCHEDULERS = ("static", "continuous", "continuous-sync")


@dataclasses.dataclass(frozen=True)
class Stream:
    """A workload's requests in arrival order, each with its own grammar (if the workload has grammars)."""

    workload: Workload
    order: tuple[int, ...]  # indices into the workload's prompts
    max_new_tokens: int

    @classmethod
    def of(cls, workload: Workload, max_new_tokens: int, seed: int) -> Stream:
        order = np.random.default_rng(seed).permutation(len(workload.prompts))
        return cls(workload, tuple(int(i) for i in order), max_new_tokens)

    def requests(self, vocab_size: int) -> list[SequenceRequest]:
        w = self.workload
        return [
            SequenceRequest(
                w.prompts[i],
                self.max_new_tokens,
                None if w.roles is None else w.roles[i],
                None if w.grammars is None else GrammarConstraint([w.grammars[i]], vocab_size),
            )
            for i in self.order
        ]


def stream_rows(engine: Engine, stream: Stream, scheduler: str, limit: int, max_rows: int) -> int:
    """Rows a scheduler runs `engine` with under `limit` cache bytes: continuous, any count that fits; static, the
    largest power of two (a static batch is padded to one)."""
    rows = rows_for_memory(engine, row_shape(engine, _sized(stream), 1), limit, max_rows)
    return rows if scheduler != "static" else 1 << (rows.bit_length() - 1) if rows else 0


def _sized(stream: Stream) -> list[SequenceRequest]:
    """Token-id-only requests of the stream (for shapes: no grammar compiled)."""
    return [SequenceRequest(stream.workload.prompts[i], stream.max_new_tokens) for i in stream.order]


def precompile(engine: Engine, stream: Stream, scheduler: str, rows: int, prefill_rows: int | None = None) -> None:
    """Compile every step that serving `stream` takes, without running its prompts (`Engine.precompile`,
    `ContinuousBatcher.precompile`): the timed passes then run on warm executables."""
    requests = stream.requests(engine.cfg.vocab_size)  # with roles and constraints: a method may need them
    if scheduler == "static":
        for first in range(0, len(requests), rows):
            lengths = [len(r.ids) for r in requests[first : first + rows]]
            engine.precompile(engine.batch_shape(lengths, stream.max_new_tokens))
    else:
        _batcher(engine, scheduler, rows, prefill_rows).precompile(requests)


def _batcher(engine: Engine, scheduler: str, rows: int, prefill_rows: int | None) -> ContinuousBatcher:
    return ContinuousBatcher(engine, rows, overlap_grammar=scheduler == "continuous", max_prefill_rows=prefill_rows)


def serve(engine: Engine, stream: Stream, scheduler: str, rows: int, prefill_rows: int | None = None) -> dict:
    """The whole stream once -> its timings. Each request's TTFT and latency count from the stream's start."""
    requests = stream.requests(engine.cfg.vocab_size)
    ttft, done, tokens, tpot = {}, {}, {}, {}
    compiles = compiles_so_far()
    start = time.perf_counter()

    def record(index: int, gen, first_s: float) -> None:
        ttft[index], done[index] = first_s, time.perf_counter() - start
        tokens[index] = gen.stats.generated_tokens
        steps = gen.stats.token_times_s
        tpot[index] = float(np.mean(steps)) if steps else None

    if scheduler in ("continuous", "continuous-sync"):
        for index, gen in _batcher(engine, scheduler, rows, prefill_rows).run(requests):
            record(index, gen, gen.stats.ttft_s)
    elif scheduler == "static":
        for first in range(0, len(requests), rows):
            batch = requests[first : first + rows]
            batch_start = time.perf_counter() - start
            constraints = [r.constraint for r in batch]
            constraint = None if constraints[0] is None else _joined(constraints)
            gens = engine.generate(
                [r.ids for r in batch],
                SamplingConfig(max_new_tokens=stream.max_new_tokens),
                prompt_roles=None if batch[0].roles is None else [r.roles for r in batch],
                constraint=constraint,
            )
            for k, gen in enumerate(gens):
                record(first + k, gen, batch_start + gen.stats.ttft_s)
    else:
        raise ValueError(f"unknown scheduler {scheduler!r}; choose from {', '.join(SCHEDULERS)}")
    wall = time.perf_counter() - start
    n = len(requests)
    steps = [t for t in tpot.values() if t is not None]
    return {
        "wall_s": wall,
        "requests": n,
        "output_tokens": int(sum(tokens.values())),
        "requests_per_s": n / wall,
        "output_tokens_per_s": sum(tokens.values()) / wall,
        "ttft_p50_ms": 1e3 * float(np.percentile(list(ttft.values()), 50)),
        "ttft_p95_ms": 1e3 * float(np.percentile(list(ttft.values()), 95)),
        "latency_p50_ms": 1e3 * float(np.percentile(list(done.values()), 50)),
        "latency_p95_ms": 1e3 * float(np.percentile(list(done.values()), 95)),
        "tpot_ms": 1e3 * float(np.mean(steps)) if steps else 0.0,
        "recompiles": compiles_so_far() - compiles,
    }


def _joined(constraints: Sequence[GrammarConstraint]) -> GrammarConstraint:
    """One batch constraint from per-request ones (fresh: static batching consumes it)."""
    return GrammarConstraint([g for c in constraints for g in c.grammars], constraints[0].vocab_size)


TIMED = (
    "requests_per_s",
    "output_tokens_per_s",
    "ttft_p50_ms",
    "ttft_p95_ms",
    "latency_p50_ms",
    "latency_p95_ms",
    "tpot_ms",
)


@dataclasses.dataclass
class StreamContender:
    method: str
    budget: float
    scheduler: str
    engine: Engine
    rows: int
    cache_bytes: int
    repeats: list[dict] = dataclasses.field(default_factory=list)


def bench_stream(
    engines: Sequence[tuple[str, float, Engine]],
    stream: Stream,
    schedulers: Sequence[str],
    memory_batch: int,
    max_rows: int,
    repeats: int,
    progress: Callable[[str], None] = lambda msg: None,
    prefill_rows: int | None = None,
) -> dict:
    """Every (method, budget) engine under every scheduler at Full KV's cache bytes for `memory_batch` rows.

    `engines` starts with Full KV. Returns {"memory_limit_bytes", "runs": [record per contender]}.
    """
    full = engines[0][2]
    limit = full.cache_bytes(row_shape(full, _sized(stream), memory_batch))
    contenders = []
    for method, budget, engine in engines:
        shape = row_shape(engine, _sized(stream), 1)
        for scheduler in schedulers:
            rows = stream_rows(engine, stream, scheduler, limit, max_rows)
            if rows < 1:
                raise ValueError(f"{method} at budget {budget}: not one row fits the limit of {limit} cache bytes")
            nbytes = engine.cache_bytes(dataclasses.replace(shape, rows=rows, padded_rows=rows))
            contenders.append(StreamContender(method, budget, scheduler, engine, rows, nbytes))
            progress(f"{stream.workload.name}: compiling {method} b={budget:g} {scheduler} rows {rows}")
            precompile(engine, stream, scheduler, rows, prefill_rows)
    for r in range(repeats):
        for c in contenders:
            progress(f"{stream.workload.name}: repeat {r + 1}/{repeats} {c.method} b={c.budget:g} {c.scheduler}")
            c.repeats.append(serve(c.engine, stream, c.scheduler, c.rows, prefill_rows))
    return {"memory_limit_bytes": limit, "runs": [_record(c, contenders) for c in contenders]}


def _median_ratio(run: StreamContender, other: StreamContender, key: str) -> float | None:
    values = [a[key] / b[key] for a, b in zip(run.repeats, other.repeats, strict=True) if b[key]]
    return float(np.median(values)) if values else None


def _record(c: StreamContender, contenders: Sequence[StreamContender]) -> dict:
    full = next(x for x in contenders if x.method == "full" and x.scheduler == c.scheduler)
    static = next((x for x in contenders if x.engine is c.engine and x.scheduler == "static"), None)
    sync = next((x for x in contenders if x.engine is c.engine and x.scheduler == "continuous-sync"), None)
    medians = {key: float(np.median([r[key] for r in c.repeats])) for key in TIMED}
    ratios = {key: _median_ratio(c, full, key) for key in ("requests_per_s", "output_tokens_per_s", "ttft_p95_ms")}
    return {
        "method": c.method,
        "budget": c.budget,
        "scheduler": c.scheduler,
        "rows": c.rows,
        "cache_bytes": c.cache_bytes,
        "weights_bytes": tree_bytes(c.engine.params),
        **medians,
        "ratio_vs_full": ratios,
        "requests_per_s_vs_static": None if static is None else _median_ratio(c, static, "requests_per_s"),
        # continuous (masks built while the step runs) against continuous-sync (masks first), same engine
        "vs_sync": None
        if sync is None or c.scheduler != "continuous"
        else {key: _median_ratio(c, sync, key) for key in ("requests_per_s", "tpot_ms")},
        "recompiles_after_warmup": sum(r["recompiles"] for r in c.repeats),
        "repeats": c.repeats,
    }


def format_stream_table(result: dict) -> str:
    head = ["workload", "method", "budget", "scheduler", "rows", "req/s", "tok/s", "TTFT p50 / p95 ms", "TPOT ms"]
    head += ["KV MB", "req/s vs full", "vs static", "recompiles"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name, part in result["workloads"].items():
        for r in part["runs"]:
            vs_full, vs_static = r["ratio_vs_full"]["requests_per_s"], r["requests_per_s_vs_static"]
            cells = [
                name,
                r["method"],
                f"{r['budget']:g}",
                r["scheduler"],
                str(r["rows"]),
                f"{r['requests_per_s']:.3f}",
                f"{r['output_tokens_per_s']:.2f}",
                f"{r['ttft_p50_ms']:.0f} / {r['ttft_p95_ms']:.0f}",
                f"{r['tpot_ms']:.0f}",
                f"{r['cache_bytes'] / 2**20:.1f}",
                "-" if vs_full is None else f"{vs_full:.2f}x",
                "-" if vs_static is None else f"{vs_static:.2f}x",
                str(r["recompiles_after_warmup"]),
            ]
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def stream_result(model: str, config: dict, command: str) -> dict:
    return {
        "model": model,
        "config": config,
        "command": command,
        "machine": machine_info(),
        "code": code_state(),
        "workloads": {},
        "complete": False,
    }


def plot_stream(result: dict, path: Path) -> Path:
    """Requests/s per (method, budget), static and continuous side by side, one panel per workload."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(result["workloads"])
    fig, axes = plt.subplots(1, len(names), figsize=(5 * len(names), 3.6), squeeze=False)
    for ax, name in zip(axes[0], names, strict=True):
        runs = result["workloads"][name]["runs"]
        labels = list(dict.fromkeys(f"{r['method']} {r['budget']:g}" for r in runs))
        schedulers = list(dict.fromkeys(r["scheduler"] for r in runs))
        width = 0.8 / len(schedulers)
        for k, scheduler in enumerate(schedulers):
            rate = {f"{r['method']} {r['budget']:g}": r for r in runs if r["scheduler"] == scheduler}
            xs = [i + k * width for i in range(len(labels))]
            bars = ax.bar(xs, [rate[label]["requests_per_s"] for label in labels], width, label=scheduler)
            for bar, label in zip(bars, labels, strict=True):
                ax.annotate(f"{rate[label]['rows']} rows", (bar.get_x(), bar.get_height()), fontsize=6)
        ax.set_xticks([i + 0.4 - width / 2 for i in range(len(labels))], labels, rotation=30, fontsize=7)
        ax.set_ylabel("requests / s")
        ax.set_title(f"{name}: KV limit {result['workloads'][name]['memory_limit_bytes'] / 2**20:.0f} MiB", fontsize=9)
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3, axis="y")
    fig.suptitle(f"{result['model']}: request stream, static vs continuous batching at the same KV memory")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
