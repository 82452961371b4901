"""Host seconds to prepare a tool list's grammar: compiled cold, loaded from the disk cache, taken from memory.

    pask-jax bench grammars [--tokenizer qwen2.5-coder-0.5b] [--tool-lists 5] [--repeats 2]
                            [--out results/bench_grammar_cache.json]

The tool lists are the first evaluation item of each BFCL category, in order, compiled as `pask-jax run` compiles a
BFCL request (`bfcl_request_body`: tool_choice "required", `compile_grammar` over the checkpoint's tokenizer). The
vocabulary is built once beforehand (`vocabulary_s`: once per process and tokenizer, whichever path follows). Each
repeat of each tool list, in one process, times `compile_grammar`:

- `cold_s`: no disk cache, the in-memory cache empty: regex, Index construction and role walk;
- `cold_store_s`: the same with the disk cache on and its directory empty (a new one per repeat): the first request
  of a tool list with the cache on, the write included;
- `disk_s`: the in-memory cache emptied again (a new process's state; the vocabulary kept, the file just written and
  so in the OS page cache): the grammar loaded from that file;
- `memory_s`: the same call again: the in-memory LRU.

Each loaded grammar is checked against the cold one (same transitions, final states and role tables). Background
load moves the absolute figures: compare the ratios, measured side by side in one run.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from pask_jax.experiments.bench.machine import code_state, machine_info, write_result

PATHS = ("cold_s", "cold_store_s", "disk_s", "memory_s")


def tool_lists(count: int) -> list[tuple[str, list[dict]]]:
    """(item id, function dicts) of the first evaluation item of each BFCL category, the first ``count`` of them."""
    from pask_jax.experiments import bfcl
    from pask_jax.experiments.bfcl.dialect import bfcl_function
    from pask_jax.experiments.bfcl.prompt import bfcl_python_functions

    items = [bfcl.evaluation_sample(category, 0, 1)[0] for category in bfcl.CATEGORIES[:count]]
    return [(item["id"], [bfcl_function(f) for f in bfcl_python_functions(item["function"])]) for item in items]


def _timed(compile_once) -> tuple[object, float]:
    start = time.perf_counter()
    grammar = compile_once()
    return grammar, time.perf_counter() - start


def _same(loaded, compiled) -> bool:
    tables = ("edge_roles", "token_roles", "state_roles", "witnesses", "final_states")
    return loaded.index.get_transitions() == compiled.index.get_transitions() and all(
        getattr(loaded, t) == getattr(compiled, t) for t in tables
    )


def prepare_times(functions: list[dict], tokenizer, directory: Path) -> dict:
    """One repeat's seconds for each path (``PATHS``), the entry's size, and whether the loaded grammar is the cold
    one."""
    from pask_jax.structure import compile_grammar
    from pask_jax.structure import grammar as G
    from pask_jax.structure.grammar_cache import set_grammar_cache

    def compile_once():
        return compile_grammar(functions, tokenizer, tool_choice="required")

    set_grammar_cache(None)
    G._GRAMMARS.clear()
    cold, cold_s = _timed(compile_once)
    set_grammar_cache(directory)
    G._GRAMMARS.clear()
    _, cold_store_s = _timed(compile_once)
    G._GRAMMARS.clear()
    loaded, disk_s = _timed(compile_once)
    again, memory_s = _timed(compile_once)
    return {
        "cold_s": cold_s,
        "cold_store_s": cold_store_s,
        "disk_s": disk_s,
        "memory_s": memory_s,
        "entry_bytes": sum(p.stat().st_size for p in directory.glob("*.npz")),
        "loaded_same": loaded is not cold and loaded.roles_s == 0.0 and _same(loaded, cold) and again is loaded,
    }


def run(args: argparse.Namespace) -> dict:
    from pask_jax.checkpoint import Checkpoint
    from pask_jax.structure import grammar_vocabulary
    from pask_jax.structure.grammar_cache import AUTO, set_grammar_cache

    machine = machine_info()  # the load at the start
    tokenizer = Checkpoint.open(args.tokenizer).tokenizer
    start = time.perf_counter()
    grammar_vocabulary(tokenizer)
    vocabulary_s = time.perf_counter() - start
    rows = []
    with tempfile.TemporaryDirectory(prefix="pask-jax-grammars-") as scratch:
        for item_id, functions in tool_lists(args.tool_lists):
            repeats = [
                prepare_times(functions, tokenizer, Path(scratch) / f"{item_id}-{r}") for r in range(args.repeats)
            ]
            row = {
                "item": item_id,
                "functions": [f["name"] for f in functions],
                "entry_bytes": repeats[0]["entry_bytes"],
                "loaded_same": all(r["loaded_same"] for r in repeats),
                **{path: [round(r[path], 6) for r in repeats] for path in PATHS},
            }
            rows.append(row)
            medians = {path: statistics.median(row[path]) for path in PATHS}
            print(
                f"{item_id:<32} cold {medians['cold_s']:6.3f}s  cold+store {medians['cold_store_s']:6.3f}s  disk "
                f"{medians['disk_s']:6.3f}s  memory {medians['memory_s'] * 1e6:5.0f}us  "
                f"({row['entry_bytes'] / 2**20:.1f} MiB)",
                flush=True,
            )
    set_grammar_cache(AUTO)
    totals = {path: sum(statistics.median(row[path]) for row in rows) for path in PATHS}
    summary = {
        "total_median_s": {path: round(seconds, 6) for path, seconds in totals.items()},
        "cold_over_disk": round(totals["cold_s"] / totals["disk_s"], 1),
        "cold_over_memory": round(totals["cold_s"] / totals["memory_s"], 1),
        "store_overhead": round(totals["cold_store_s"] / totals["cold_s"] - 1, 3),
        "loaded_same": all(row["loaded_same"] for row in rows),
    }
    print(
        f"total (median per list): cold {totals['cold_s']:.2f}s, disk {totals['disk_s']:.3f}s "
        f"({summary['cold_over_disk']}x faster), memory {totals['memory_s'] * 1e3:.3f}ms; the write adds "
        f"{summary['store_overhead']:.1%} to a cold compile"
    )
    result = {
        "benchmark": "grammars",
        "tokenizer": args.tokenizer,
        "tool_choice": "required",
        "repeats": args.repeats,
        "vocabulary_s": round(vocabulary_s, 3),
        "tool_lists": rows,
        "summary": summary,
        "machine": machine,
        "code": code_state(),
    }
    if args.out:
        write_result(args.out, result)
    return result


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pask-jax bench grammars", description=__doc__.split("\n\n")[0])
    p.add_argument("--tokenizer", default="qwen2.5-coder-0.5b", help="registered model or checkpoint whose tokenizer")
    p.add_argument("--tool-lists", type=int, default=5, help="BFCL tool lists (one item per category, at most 8)")
    p.add_argument("--repeats", type=int, default=2, help="repeats per tool list (a new disk cache each)")
    p.add_argument("--out", default="results/bench_grammar_cache.json", help="results JSON")
    return p


def main(argv: list[str] | None = None) -> dict:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not 1 <= args.tool_lists <= 8 or args.repeats < 1:
        parser.error("--tool-lists must be in [1, 8] and --repeats at least 1")
    return run(args)
