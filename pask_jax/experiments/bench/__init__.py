"""Benchmarks, the CLI's `pask-jax bench BENCHMARK [ARGS]`: each module is imported only when it runs.

- `serving`: batch grammar-constrained generation under one KV-memory limit, Full KV vs PASK vs baselines.
- `decode`: prefill and decode throughput of the engine vs transformers' `generate` (needs torch, transformers).
- `kernel`: decode-step attention time vs KV capacity (XLA reference, compacted pool, Pallas kernels).
- `cache`: KV-cache bytes vs budget for a model preset, from shapes alone.
- `prefill`: chunked prefill against one pass: seconds, XLA and process peak memory, the kept entries.
- `compile`: lowering and compile seconds per step executable, cold and warm XLA cache; time to the first answer.
- `entrypoints`: `pask-jax run` against `pask-jax bfcl` on the same BFCL items (tokens/s, same calls).
- `schemas`: JSON Schema coverage on pinned external suites, our grammar next to xgrammar and llguidance.
- `grammars`: seconds to prepare a tool list's grammar: compiled cold, loaded from the disk cache, from memory.
- `prep`: host seconds per request (each preparation stage, cold and warm, and the grammar masks) against device
  seconds per request, per grammar backend.

Benchmarks time grammar compiles as a new user meets them: no compiled grammar persists from an earlier run
(`PASK_JAX_GRAMMAR_CACHE=off`, inherited by their worker processes; `grammars` names its own directories).

`pask-jax bench BENCHMARK --help` lists a benchmark's own arguments.
"""

from __future__ import annotations

import importlib
import os
import sys

BENCHMARKS = {
    "serving": "batch generation under one KV-memory limit, Full KV vs PASK vs baselines",
    "decode": "prefill / decode throughput vs transformers' generate",
    "kernel": "decode-step attention time vs KV capacity",
    "cache": "KV-cache bytes vs budget, from shapes alone",
    "prefill": "chunked prefill vs one pass: seconds, peak memory, kept entries",
    "compile": "compile seconds per step executable, cold and warm XLA cache; time to first answer",
    "entrypoints": "`run` vs `bfcl` tokens/s on the same items",
    "schemas": "JSON Schema coverage on external suites, vs xgrammar and llguidance",
    "grammars": "grammar preparation seconds: compiled cold, loaded from the disk cache, from memory",
    "prep": "host seconds per request (preparation stages, masks) vs device seconds, per grammar backend",
}
USAGE = (
    "usage: pask-jax bench {"
    + ",".join(BENCHMARKS)
    + "} [ARGS]\n\n"
    + "\n".join(f"  {name:<11} {about}" for name, about in BENCHMARKS.items())
    + "\n\n`pask-jax bench BENCHMARK --help` lists a benchmark's own arguments."
)


def main(argv: list[str] | None = None):
    """Run the benchmark named by argv[0] with the rest of argv; returns what its `main` returns (its result)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] in (["-h"], ["--help"]):
        print(USAGE)
        raise SystemExit(0)
    if not argv or argv[0] not in BENCHMARKS:
        given = f"unknown benchmark {argv[0]!r}" if argv else "no benchmark named"
        print(f"{USAGE}\n\npask-jax bench: error: {given}", file=sys.stderr)
        raise SystemExit(2)
    os.environ["PASK_JAX_GRAMMAR_CACHE"] = "off"  # = structure.grammar_cache.ENV (not imported: this loads no JAX)
    return importlib.import_module(f"pask_jax.experiments.bench.{argv[0]}").main(argv[1:])
