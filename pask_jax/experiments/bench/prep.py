"""Host seconds per request against device seconds per request: when request preparation bounds a batch.

    pask-jax bench prep [--model qwen2.5-coder-0.5b] [--bfcl-items 4] [--backends outlines,llguidance]
                        [--max-tokens 64] [--accelerator-speedup 100] [--max-batch 8]
                        [--stream-workers 0,2] [--stream-repeats 2] [--out results/bench_prep.json]

Two request mixes: BFCL-like (the first `--bfcl-items` evaluation items of simple_python and of multiple, as a user
sends them: `bfcl_request_body`, a call required) and user-like (examples/requests.jsonl: tool calls, JSON answers,
free text). Per grammar backend, in one process (the tokenizer's grammar vocabulary built once beforehand,
`vocabulary_s`; llguidance's tokenizer too, by one preparation before the timed ones), each request is prepared
twice with each stage timed (`LLM.prepare(body, timings)`: parse_s, render_s, tokenize_s, roles_s, grammar_s):

- cold: no compiled grammar in memory (the backend's in-memory cache emptied) and no disk cache: a new tool list;
- warm: the same request again: the compiled grammar from memory.

The cold-prepared requests of each mix then run through the LLM's scheduler (full KV, greedy, `--max-tokens`;
timed the second time, the first compiling the steps): `mask_s` is the host seconds the grammar constraints took
(masks and advances, every step), `constraint_s` the seconds building each row's constraint (llguidance builds its
parser there, when the matcher is made), `device_s` the rest of the run's wall seconds (on XLA:CPU the "device"
shares the host's cores). Per request: host_s = cold preparation + constraint_s + mask_s; the ratio host_s /
device_s says how much of a pipelined server's time the host would take; preparation bounds a pipelined server once
device_s per request falls below host_s. The ratio at `--accelerator-speedup` divides this machine's device_s by that
factor: an assumption to read the table with (a TPU or GPU runs the same steps that many times faster), not a
measurement.

Stream (`--stream-workers 0,2`): both mixes together, every grammar cold, served as `LLM.chat` serves them
(continuous batching, `--max-batch` rows), once per value of `prep_workers`, `--stream-repeats` times interleaved
(after one untimed run that compiles the steps). 0: each request is compiled when it is prepared, all before the
first step; N: the grammars compile on N host threads while the rows run, each request admitted once its grammar is
done. `device_wait_s`: the seconds the device had nothing to run because of the host: the preparation before the
first step plus the batcher's waits with no row live (`Scheduler.prep_wait_s`); its share of the stream's wall
seconds is the fraction the device waits on the host.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from pask_jax.experiments.bench.machine import code_state, machine_info, write_result

if TYPE_CHECKING:
    from pask_jax.llm import LLM

STAGES = ("parse_s", "render_s", "tokenize_s", "roles_s", "grammar_s")
USER_REQUESTS = Path("examples/requests.jsonl")


def bfcl_bodies(per_category: int, max_tokens: int) -> list[dict]:
    """The first `per_category` evaluation items of simple_python and multiple as chat-completions bodies."""
    from pask_jax.experiments import bfcl
    from pask_jax.experiments.bfcl.prompt import bfcl_request_body

    items = [it for c in ("simple_python", "multiple") for it in bfcl.evaluation_sample(c, 0, per_category)]
    return [bfcl_request_body(item, max_tokens) for item in items]


def user_bodies(path: Path, max_tokens: int) -> list[dict]:
    """The bodies of a `pask-jax run` input file, each answer capped at `max_tokens`."""
    lines = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [
        line["body"] | {"max_tokens": min(line["body"].get("max_tokens", max_tokens), max_tokens)} for line in lines
    ]


def forget_compiled_grammars() -> None:
    """Empty the in-memory grammar cache (llguidance keeps none) and switch the disk cache off: the next compile is a
    new tool list's."""
    from pask_jax.structure import grammar as outlines_grammar
    from pask_jax.structure.grammar_cache import set_grammar_cache

    set_grammar_cache(None)
    outlines_grammar._GRAMMARS.clear()


def prepare_all(llm, bodies: list[dict]) -> tuple[list, list[dict], list[dict]]:
    """Each body prepared cold, then warm -> (the cold-prepared requests, cold stage seconds, warm stage seconds)."""
    prepared, cold, warm = [], [], []
    for body in bodies:
        forget_compiled_grammars()
        seconds: dict[str, float] = {}
        prepared.append(llm.prepare(body, seconds))
        cold.append(seconds)
        seconds = {}
        llm.prepare(body, seconds)
        warm.append(seconds)
    return prepared, cold, warm


def run_batch(llm, prepared: list) -> dict:
    """The prepared requests through the scheduler once -> wall, host constraint (building each row's matcher or
    guide), host mask and device seconds, tokens."""
    constraints, constraint_s = [], [0.0]

    def constraint(indices: list[int]):
        start = time.perf_counter()
        made = llm.batch_constraint([prepared[i] for i in indices])
        constraint_s[0] += time.perf_counter() - start
        constraints.append(made)
        return made

    start = time.perf_counter()
    results = [r for _, batch, _ in llm.make_scheduler().run(llm.jobs(prepared), constraint) for r in batch]
    wall_s = time.perf_counter() - start
    mask_s = sum(getattr(c, "mask_s", 0.0) + getattr(c, "advance_s", 0.0) for c in constraints)
    return {
        "wall_s": wall_s,
        "constraint_s": constraint_s[0],
        "mask_s": mask_s,
        "device_s": wall_s - mask_s - constraint_s[0],
        "tokens": sum(len(r.tokens) for r in results),
    }


def serve_stream(llm, bodies: list[dict]) -> dict:
    """Every body prepared cold (ahead on the LLM's `prep_workers`, if any) and served through its scheduler ->
    wall seconds, the seconds the device waited on the host, output tokens."""
    forget_compiled_grammars()
    start = time.perf_counter()
    prepared = [llm.prepare(body, ahead=True) for body in bodies]
    before_first_step_s = time.perf_counter() - start
    scheduler = llm.make_scheduler()
    tokens = 0
    for _, completions in llm.generate(prepared, scheduler):
        tokens += sum(c["usage"]["completion_tokens"] for c in completions)
    wall_s = time.perf_counter() - start
    wait_s = before_first_step_s + scheduler.prep_wait_s
    return {
        "wall_s": round(wall_s, 3),
        "device_wait_s": round(wait_s, 3),
        "device_wait_fraction": round(wait_s / wall_s, 4),
        "tokens": tokens,
    }


def measure_stream(llm, bodies: list[dict], workers: Sequence[int], repeats: int) -> dict:
    """The stream once untimed, then per `prep_workers` value `repeats` timed runs, interleaved -> per value the
    runs and their medians."""
    llm.prep_workers = max(workers)
    serve_stream(llm, bodies)  # compiles every step shape the stream takes
    runs: dict[int, list[dict]] = {w: [] for w in workers}
    for _ in range(repeats):
        for w in workers:
            llm.prep_workers = w
            runs[w].append(serve_stream(llm, bodies))
            print(f"  prep_workers={w}: {runs[w][-1]}", flush=True)
    forget_compiled_grammars()
    return {
        str(w): {
            "runs": rows,
            "median": {
                k: statistics.median(r[k] for r in rows) for k in ("wall_s", "device_wait_s", "device_wait_fraction")
            },
        }
        for w, rows in runs.items()
    }


def _mean(rows: list[dict], key: str) -> float:
    return statistics.fmean(row.get(key, 0.0) for row in rows)


def summarize(cold: list[dict], warm: list[dict], batch: dict, speedup: float) -> dict:
    n = len(cold)
    prep_cold = _mean(cold, "total_s")
    host_s = prep_cold + (batch["constraint_s"] + batch["mask_s"]) / n
    device_s = batch["device_s"] / n
    return {
        "requests": n,
        "cold": {stage: round(_mean(cold, stage), 5) for stage in (*STAGES, "total_s")},
        "warm": {stage: round(_mean(warm, stage), 5) for stage in (*STAGES, "total_s")},
        "cold_over_warm": round(prep_cold / max(_mean(warm, "total_s"), 1e-9), 1),
        "constraint_s_per_request": round(batch["constraint_s"] / n, 5),
        "mask_s_per_request": round(batch["mask_s"] / n, 5),
        "device_s_per_request": round(device_s, 5),
        "host_s_per_request": round(host_s, 5),
        "host_over_device": round(host_s / device_s, 3),
        "host_over_device_at_speedup": round(host_s / (device_s / speedup), 3),
        "tokens": batch["tokens"],
        "wall_s": round(batch["wall_s"], 3),
    }


def measure(
    make_llm: Callable[[str], LLM], backends: Sequence[str], mixes: dict[str, list[dict]], speedup: float
) -> tuple[dict, float]:
    """Per grammar backend (`make_llm(backend)` builds its LLM) and request mix: the summary and the per-request
    seconds -> (results, seconds to build the tokenizer's grammar vocabulary)."""
    from pask_jax.structure import grammar_vocabulary

    results: dict[str, dict] = {}
    vocabulary_s = 0.0
    for backend in backends:
        llm = make_llm(backend)
        if not results:
            start = time.perf_counter()
            grammar_vocabulary(llm.tokenizer)
            vocabulary_s = time.perf_counter() - start
        llm.prepare(next(iter(mixes.values()))[0])  # once per process and tokenizer, not per request (llguidance's)
        results[backend] = {}
        for mix, bodies in mixes.items():
            prepared, cold, warm = prepare_all(llm, bodies)
            for rows in (cold, warm):
                for row in rows:
                    row["total_s"] = sum(row.get(stage, 0.0) for stage in STAGES)
            run_batch(llm, prepared)  # compiles this mix's step shapes: the timed run below compiles nothing
            batch = run_batch(llm, prepared)
            summary = summarize(cold, warm, batch, speedup)
            results[backend][mix] = summary | {"per_request": {"cold": cold, "warm": warm}}
            print(
                f"{backend:<11}{mix:<5} {summary['requests']:3d} requests: prep cold {summary['cold']['total_s']:.4f}s "
                f"(grammar {summary['cold']['grammar_s']:.4f}s), warm {summary['warm']['total_s']:.4f}s, constraint "
                f"{summary['constraint_s_per_request']:.4f}s, masks "
                f"{summary['mask_s_per_request']:.4f}s, device {summary['device_s_per_request']:.3f}s per request; "
                f"host / device {summary['host_over_device']:.3f} here, "
                f"{summary['host_over_device_at_speedup']:.2f} at {speedup:g}x",
                flush=True,
            )
    forget_compiled_grammars()
    return results, vocabulary_s


def run(args: argparse.Namespace) -> dict:
    from pask_jax.llm import LLM

    machine = machine_info()
    mixes = {"bfcl": bfcl_bodies(args.bfcl_items, args.max_tokens), "user": user_bodies(args.requests, args.max_tokens)}
    llms: dict[str, LLM] = {}

    def make_llm(backend: str) -> LLM:
        llms[backend] = LLM(args.model, method="full", grammar_backend=backend, max_batch=args.max_batch)
        return llms[backend]

    results, vocabulary_s = measure(make_llm, args.backends, mixes, args.accelerator_speedup)
    stream = {}
    for backend, llm in llms.items() if args.stream_workers else ():
        print(f"{backend} stream of {sum(map(len, mixes.values()))} requests, cold grammars:", flush=True)
        stream[backend] = measure_stream(
            llm, [b for bodies in mixes.values() for b in bodies], args.stream_workers, args.stream_repeats
        )
    result = {
        "benchmark": "prep",
        "model": args.model,
        "max_tokens": args.max_tokens,
        "accelerator_speedup": args.accelerator_speedup,
        "vocabulary_s": round(vocabulary_s, 3),
        "backends": results,
        "max_batch": args.max_batch,
        "stream": stream,
        "machine": machine,
        "code": code_state(),
    }
    if args.out:
        write_result(args.out, result)
    return result


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pask-jax bench prep", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="qwen2.5-coder-0.5b", help="registered name, .gguf file or checkpoint directory")
    p.add_argument("--bfcl-items", type=int, default=4, help="BFCL-like mix: items of simple_python and of multiple")
    p.add_argument("--requests", type=Path, default=USER_REQUESTS, help="user-like mix: a `pask-jax run` input file")
    p.add_argument("--backends", default="outlines,llguidance", help="comma-separated grammar backends")
    p.add_argument("--max-tokens", type=int, default=64, help="tokens per answer at most")
    p.add_argument(
        "--accelerator-speedup",
        type=float,
        default=100.0,
        help="the assumed device speed-up over this machine for the projected host / device ratio",
    )
    p.add_argument("--max-batch", type=int, default=8, help="rows of the batch and of the stream")
    p.add_argument(
        "--stream-workers", default="0,2", help="comma-separated prep_workers values for the stream ('': no stream)"
    )
    p.add_argument("--stream-repeats", type=int, default=2, help="timed runs of the stream per prep_workers value")
    p.add_argument("--out", type=Path, help="results JSON")
    return p


def main(argv: list[str] | None = None) -> dict:
    parser = build_parser()
    args = parser.parse_args(argv)
    args.backends = tuple(args.backends.split(","))
    from pask_jax.arguments import grammar_backend

    for backend in args.backends:
        try:
            grammar_backend(backend)
        except argparse.ArgumentTypeError as exc:
            parser.error(f"--backends: {exc}")
    if args.bfcl_items < 1 or args.max_tokens < 1 or args.max_batch < 1 or args.accelerator_speedup <= 0:
        parser.error("--bfcl-items, --max-tokens and --max-batch must be at least 1, --accelerator-speedup positive")
    try:
        args.stream_workers = tuple(int(w) for w in args.stream_workers.split(",") if w.strip())
    except ValueError:
        parser.error(f"--stream-workers {args.stream_workers!r}: comma-separated integers")
    if any(w < 0 for w in args.stream_workers) or args.stream_repeats < 1:
        parser.error("--stream-workers must be >= 0 and --stream-repeats at least 1")
    if not args.requests.is_file():
        parser.error(f"--requests {args.requests}: no such file")
    return run(args)
