"""Compile time: seconds per step executable (lowering and XLA compile apart), cold and warm XLA cache, and the time
to the first answer from a loaded model.

    pask-jax bench compile [--model qwen2.5-coder-0.5b] [--methods full,snapkv,h2o,dapq,pask] [--budget 0.33]
                           [--prompt-tokens 512,2048] [--batch 1] [--new-tokens 64] [--out results/bench_compile.json]

Everything runs in one process with a fresh, empty persistent XLA cache (a temporary `jax_compilation_cache_dir`,
every executable cached whatever its compile time):

1. First answer, cold: `LLM.chat` on the first request of --requests (the path `pask-jax run` takes: prompt, grammar,
   prefill, decode) with the model already in memory, nothing compiled yet; then, warm: `jax.clear_caches()` (the
   in-memory executables go) and the same call again, so every executable comes from the persistent cache. The
   grammar index is cached by the process and is not part of the warm figure.
2. Per (method, prompt length): the engine's prefill and decode step lowered for the shape `generate` uses
   (`Engine.lower`: tracing and lowering to StableHLO, timed apart) and compiled (`Lowered.compile()`: the XLA
   compile, cold); then, after `jax.clear_caches()`, lowered and compiled again (warm: the compile loads the
   executable from the persistent cache). `cache_hits` counts the persistent-cache hits JAX reports for that step;
   each executable's XLA memory analysis (temp, argument and output MiB) is recorded beside its times.

`--model tiny` runs a random 2-layer model (no tokenizer: no first-answer figure), for tests.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

import jax

from pask_jax.experiments.bench.machine import code_state, machine_info

TINY = "tiny"
CACHE_HIT_EVENT = "/jax/compilation_cache/cache_hits"
DEFAULT_METHODS = ("full", "snapkv", "h2o", "dapq", "pask")

_cache_hits = [0]


def _count_cache_hits(event: str, **kwargs) -> None:
    if event == CACHE_HIT_EVENT:
        _cache_hits[0] += 1


def use_fresh_cache(directory: Path) -> None:
    """Point JAX's persistent compilation cache at `directory`, caching every executable."""
    jax.config.update("jax_compilation_cache_dir", str(directory))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    jax.monitoring.register_event_listener(_count_cache_hits)


def _timed(fn):
    start = time.perf_counter()
    out = fn()
    return out, round(time.perf_counter() - start, 3)


def step_times(engine, prompt_tokens: int, batch: int, new_tokens: int) -> dict:
    """Lowering and compile seconds of the prefill and decode executables for one shape (the cache state as it is)."""
    shape = engine.batch_shape([prompt_tokens] * batch, new_tokens)
    hits = _cache_hits[0]
    prefill, prefill_lower_s = _timed(lambda: engine.lower_prefill(shape))
    decode, decode_lower_s = _timed(lambda: engine.lower_decode(shape))
    prefill_exe, prefill_compile_s = _timed(prefill.compile)
    decode_exe, decode_compile_s = _timed(decode.compile)
    return {
        "prefill": {"lower_s": prefill_lower_s, "compile_s": prefill_compile_s, **memory_mib(prefill_exe)},
        "decode": {"lower_s": decode_lower_s, "compile_s": decode_compile_s, **memory_mib(decode_exe)},
        "cache_hits": _cache_hits[0] - hits,
        "shape": {"rows": shape.padded_rows, "prompt_bucket": shape.prompt_bucket, "capacities": shape.capacities},
    }


def memory_mib(compiled: jax.stages.Compiled) -> dict:
    """XLA's buffer sizes of an executable in MiB: its scratch (temp: what the step needs beyond its inputs and
    outputs, e.g. a prefill's activations), arguments (weights, caches) and outputs."""
    analysis = compiled.memory_analysis()
    sizes = {
        "temp_mib": analysis.temp_size_in_bytes,
        "argument_mib": analysis.argument_size_in_bytes,
        "output_mib": analysis.output_size_in_bytes,
    }
    return {name: round(size / 2**20, 1) for name, size in sizes.items()}


def first_answer(llm, request: dict) -> dict:
    """Seconds of one `LLM.chat` call (the model already loaded) and what it answered."""
    answer, seconds = _timed(lambda: llm.chat(request)[0])
    message = answer["choices"][0]["message"]
    return {"seconds": seconds, "tool_calls": len(message.get("tool_calls") or []), "ttft_s": answer["pask"]["ttft_s"]}


def load(model: str, methods: tuple[str, ...], budget: float):
    """model -> ({method: engine}, LLM or None); the engines share the LLM's loaded weights."""
    from pask_jax.factory import make_engine

    def budget_of(method: str) -> float:  # full KV keeps everything: its budget is 1
        return 1.0 if method == "full" else budget

    if model == TINY:
        from flax import nnx

        from pask_jax.models.qwen3 import ModelConfig, Qwen3

        qwen = Qwen3(ModelConfig.tiny("qwen2", vocab_size=256), rngs=nnx.Rngs(0))
        return {m: make_engine(qwen, m, budget_of(m)) for m in methods}, None
    from pask_jax.llm import LLM

    llm = LLM(model, method="pask", budget=budget)
    engines = {m: make_engine(llm.model, m, budget_of(m), policy=llm.policy if m == "pask" else None) for m in methods}
    return engines, llm


def run(args: argparse.Namespace) -> dict:
    cache = Path(tempfile.mkdtemp(prefix="pask-jax-xla-"))
    use_fresh_cache(cache)
    engines, llm = load(args.model, args.methods, args.budget)
    result: dict = {
        "benchmark": "compile",
        "model": args.model,
        "budget": args.budget,
        "batch": args.batch,
        "new_tokens": args.new_tokens,
        "machine": machine_info(),
        "code": code_state(),
        "xla_cache_dir": str(cache),
    }
    if llm is not None:
        lines = Path(args.requests).read_text().splitlines()
        request = json.loads(next(line for line in lines if line.strip()))["body"]
        result["first_answer"] = {"request": args.requests, "method": "pask", "budget": args.budget}
        result["first_answer"]["cold"] = first_answer(llm, request)
        jax.clear_caches()
        result["first_answer"]["warm"] = first_answer(llm, request)
    rows = []
    for prompt_tokens in args.prompt_tokens:
        for method, engine in engines.items():
            cold = step_times(engine, prompt_tokens, args.batch, args.new_tokens)
            jax.clear_caches()
            warm = step_times(engine, prompt_tokens, args.batch, args.new_tokens)
            rows.append({"method": method, "prompt_tokens": prompt_tokens, "cold": cold, "warm": warm})
            print(
                f"{method:>10} P={prompt_tokens:<6} prefill lower {cold['prefill']['lower_s']:6.2f}s compile "
                f"{cold['prefill']['compile_s']:6.2f}s (warm {warm['prefill']['compile_s']:.2f}s) | decode lower "
                f"{cold['decode']['lower_s']:6.2f}s compile {cold['decode']['compile_s']:6.2f}s (warm "
                f"{warm['decode']['compile_s']:.2f}s)",
                flush=True,
            )
    result["steps"] = rows
    result["loadavg_end"] = list(os.getloadavg())
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    return result


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(","))


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pask-jax bench compile", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="qwen2.5-coder-0.5b", help="registered name, checkpoint path, or 'tiny'")
    p.add_argument("--methods", default=",".join(DEFAULT_METHODS), help="comma-separated methods")
    p.add_argument("--budget", type=float, default=0.33, help="KV budget of the compressed methods")
    p.add_argument("--prompt-tokens", type=_ints, default=(512, 2048), help="prompt lengths (comma-separated)")
    p.add_argument("--batch", type=int, default=1, help="prompts per batch")
    p.add_argument("--new-tokens", type=int, default=64, help="new tokens the caches are sized for")
    p.add_argument("--requests", default="examples/requests.jsonl", help="OpenAI Batch lines: the first is answered")
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
    if args.model != TINY and not Path(args.requests).is_file():
        parser.error(f"--requests {args.requests}: no such file")
    return run(args)
