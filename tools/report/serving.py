"""The tables of docs/results/serving.md: serving on CPU (static batches and request streams), decode speed against
transformers, the decode attention kernel, cache bytes, and chunked prefill with its arithmetic rate."""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from pathlib import Path

from tools.report.common import _block, _ratio, _table, load_json


def _serving(root: Path, file: str) -> str:
    result = load_json(root, file)
    runs = result["runs"]
    full = next(r for r in runs if r["method"] == "full")
    rows, gains = [], []  # gains: (method, budget, batch, decode x full, end to end x full) of the compressed runs
    for r in runs:
        ratio = r["ratio_vs_full"]
        decode = r["decode_tokens_per_s"] / full["decode_tokens_per_s"]
        if r is not full:
            gains.append((r["method"], r["budget"], r["batch"], decode, ratio["throughput"]))
        rows.append(
            [
                r["method"],
                f"{r['budget']:g}",
                r["batch"],
                f"{r['decode_tokens_per_s']:.1f} ({_ratio(decode)})",
                f"{r['tokens_per_s']:.2f} ({_ratio(ratio['throughput'])})",
                f"{r['tpot_ms']:.0f} ({_ratio(ratio['tpot'])})",
                f"{r['ttft_ms'] / 1000:.1f}",
                f"{r['memory']['cache_bytes'] / 2**20:.1f} ({_ratio(ratio['cache_bytes'])})",
                f"{r['peak_memory_bytes'] / 2**20:.0f} ({_ratio(ratio['peak_memory'])})",
                f"{r['parser_ms_per_step']:.2f}",
                r["recompiles_after_warmup"],
            ]
        )
    workload = next(iter(result["workloads"].values()))
    claim = (
        f"Under full KV's cache at batch {full['batch']} ({workload['memory_limit_bytes'] / 2**20:.1f} MiB; prompts "
        f"of {min(workload['prompt_tokens'])}-{max(workload['prompt_tokens'])} tokens), decode tokens/s against full "
        f"KV's {full['decode_tokens_per_s']:.1f}: "
        + ", ".join(f"{m} b = {b:g} at batch {n} {_ratio(d)}" for m, b, n, d, _ in gains)
        + "; end to end (prefill included) "
        + " / ".join(_ratio(e) for *_, e in gains)
        + "; recompiles after warm-up: "
        + str(sum(r["recompiles_after_warmup"] for r in runs))
        + "."
    )
    head = [
        "method", "b", "batch", "decode tokens/s (x full)", "tokens/s end to end (x full)", "TPOT ms (x full)",
        "TTFT s", "KV cache MiB (x full)", "peak MiB (x full)", "parser ms/step", "recompiles",
    ]  # fmt: skip
    tables = [_table(head, rows)]
    if sweep := result.get("decode_sweep"):
        points = [
            [f"{p['budget']:g}", f"{p['capacity_slots_mean']:.0f}", f"{p['tpot_ms']['median']:.0f}",
             _ratio(p["tpot_ratio_vs_top_budget"]), p["recompiles_after_warmup"]]
            for p in sweep["points"]
        ]  # fmt: skip
        tables.append(
            f"Decode-step sweep ({sweep['method']}, batch {sweep['batch']}, {sweep['workload']} prompts):\n\n"
            + _table(["b", "slots per layer", "TPOT ms", "TPOT x b = 1", "recompiles"], points)
        )
    return _block(claim, *tables)


def _run_label(run: dict) -> str:
    return run["method"] if run["method"] == "full" else f"{run['method']} b = {run['budget']:g}"


def _serving_stream(root: Path, file: str) -> str:
    """A request-stream result (`bench serving --scheduler`): per workload, every (method, budget, scheduler)."""
    result = load_json(root, file)
    blocks = []
    for name, part in result["workloads"].items():
        runs = part["runs"]
        rows = [
            [
                r["method"], f"{r['budget']:g}", r["scheduler"], r["rows"], f"{r['requests_per_s']:.3f}",
                _ratio(r["ratio_vs_full"]["requests_per_s"]),
                "-" if r["requests_per_s_vs_static"] is None else _ratio(r["requests_per_s_vs_static"]),
                f"{r['output_tokens_per_s']:.2f}", f"{r['ttft_p50_ms'] / 1000:.1f} / {r['ttft_p95_ms'] / 1000:.1f}",
                f"{r['latency_p50_ms'] / 1000:.1f} / {r['latency_p95_ms'] / 1000:.1f}", f"{r['tpot_ms']:.0f}",
                f"{r['cache_bytes'] / 2**20:.1f}", r["recompiles_after_warmup"],
            ]
            for r in runs
        ]  # fmt: skip
        tokens, memory_rows = part["prompt_tokens"], result["config"]["memory_batch"]
        continuous = [r for r in runs if r["scheduler"].startswith("continuous") and r["method"] != "full"]
        over_static = [
            f"{_run_label(r)} {_ratio(r['requests_per_s_vs_static'])}"
            for r in runs
            if r["scheduler"].startswith("continuous") and r["requests_per_s_vs_static"] is not None
        ]
        claim = (
            f"{name}: {len(tokens)} requests (prompts of {min(tokens)}-{max(tokens)} tokens, answers to EOS or "
            f"{result['config']['max_new_tokens']} tokens) under full KV's cache at {memory_rows} "
            f"row{'' if memory_rows == 1 else 's'} ({part['memory_limit_bytes'] / 2**20:.1f} MiB). "
            "Continuous batching, requests/s against full KV's: "
            + ", ".join(
                f"{_run_label(r)} ({r['rows']} rows) {_ratio(r['ratio_vs_full']['requests_per_s'])}" for r in continuous
            )
            + ("; against static batching of the same method: " + ", ".join(over_static) if over_static else "")
            + "."
        )
        head = [
            "method", "b", "scheduler", "rows", "requests/s", "x full", "x static", "output tokens/s",
            "TTFT p50 / p95 s", "latency p50 / p95 s", "TPOT ms", "KV MiB", "recompiles",
        ]  # fmt: skip
        blocks.append(_block(claim, _table(head, rows)))
    return "\n\n".join(blocks)


def serving_stream_cpu_bfcl64(root: Path) -> str:
    return _serving_stream(root, "results/serving_stream_cpu_bfcl64.json")


def serving_stream_cpu_2k(root: Path) -> str:
    return _serving_stream(root, "results/serving_stream_cpu_2k.json")


def serving_stream_cpu_bfcl64_b02(root: Path) -> str:
    return _serving_stream(root, "results/serving_stream_cpu_bfcl64_b02.json")


def serving_grammar_overlap(root: Path) -> str:
    """Continuous batching with the next token masks built while the step runs against before it (continuous-sync)."""
    result = load_json(root, "results/serving_stream_grammar_overlap.json")
    ((name, part),) = result["workloads"].items()  # one workload
    runs = {(r["method"], r["budget"], r["scheduler"]): r for r in part["runs"]}
    rows, found = [], []
    for r in (r for r in part["runs"] if r["scheduler"] == "continuous"):
        sync, ratio = runs[r["method"], r["budget"], "continuous-sync"], r["vs_sync"]
        rows.append(
            [
                r["method"], f"{r['budget']:g}", r["rows"],
                f"{r['requests_per_s']:.3f} / {sync['requests_per_s']:.3f}", _ratio(ratio["requests_per_s"]),
                f"{r['tpot_ms']:.0f} / {sync['tpot_ms']:.0f}", _ratio(ratio["tpot_ms"]),
            ]
        )  # fmt: skip
        found.append(
            f"{r['method']} b = {r['budget']:g} requests/s {_ratio(ratio['requests_per_s'])}, "
            f"TPOT {_ratio(ratio['tpot_ms'])}"
        )
    claim = (
        f"{name}: {len(part['prompt_tokens'])} requests, continuous batching with the next token masks built on the "
        "host while the step runs, against built before it (medians of per-repeat ratios): " + ", ".join(found) + "."
    )
    head = ["method", "b", "rows", "requests/s, overlapped / masks first", "x", "TPOT ms, overlapped / first", "x"]
    return _block(claim, _table(head, rows))


def serving_cpu_2k(root: Path) -> str:
    return _serving(root, "results/serving_cpu_2k.json")


def serving_cpu_bfcl(root: Path) -> str:
    return _serving(root, "results/serving_cpu_bfcl.json")


def bench_decode(root: Path, file: str = "results/bench_decode.json") -> str:
    """Ours against transformers per batch and torch thread count, with each side's share of the memory roofline."""
    result = load_json(root, file)
    rows, identical_rows, compared_rows = [], 0, 0
    for entry in result["results"]:
        ours, roof = entry["ours"], entry["roofline"]
        for side, ratios in (
            ("transformers", "ours_over_transformers"),
            ("transformers_1_thread", "ours_over_transformers_1_thread"),
        ):
            if side not in entry:
                continue
            theirs, ratio = entry[side], entry[ratios]
            same = entry["same_greedy_tokens"]
            identical = same["rows_identical"] if side == "transformers" else same[f"{side}_rows_identical"]
            threads = 1 if side.endswith("1_thread") else result["machine"]["torch_threads"]
            identical_rows, compared_rows = identical_rows + identical, compared_rows + same["rows"]
            rows.append(
                [
                    entry["batch"],
                    f"{entry['prompt_lengths']['mean']:.0f}",
                    threads,
                    f"{ours['prefill_tok_s']:.1f} / {theirs['prefill_tok_s']:.1f}",
                    _ratio(ratio["prefill_speedup"]),
                    f"{ours['decode_tok_s']:.2f} / {theirs['decode_tok_s']:.2f}",
                    _ratio(ratio["decode_speedup"]),
                    f"{roof['roofline_step_ms']:.0f}",
                    f"{roof['fraction']['ours']:.2f} / {roof['fraction'][side]:.2f}",
                    f"{identical}/{same['rows']}",
                ]
            )
    recompiled = [e["batch"] for e in result["results"] if e["ours"]["backend_compiles"]["timed"]]
    bandwidth = result["roofline"]["bandwidth"]["gb_s"]
    claim = (
        f"Greedy {result['new_tokens']} tokens of {result['model']} ({result['dtype']}, "
        f"{result['machine']['jax_backend']}): the same tokens as transformers in {identical_rows} of "
        f"{compared_rows} sequences compared; prefill / decode speed over transformers' "
        + ", ".join(f"{r[4]} / {r[6]} (batch {r[0]}, {r[2]} torch thread{'s' * (r[2] > 1)})" for r in rows)
        + f"; measured copy bandwidth {bandwidth:.1f} GB/s; compiles during the timed runs: "
        + ("none" if not recompiled else f"at batch {recompiled}")
        + "."
    )
    head = [
        "batch",
        "prompt tokens",
        "torch threads",
        "prefill tokens/s, ours / transformers",
        "prefill x",
        "decode tokens/s, ours / transformers",
        "decode x",
        "roofline step ms",
        "share of roofline, ours / transformers",
        "same greedy tokens",
    ]
    return _block(claim, _table(head, rows))


def bench_prefill(
    root: Path, files: Sequence[str] = ("results/bench_prefill.json", "results/bench_prefill_16k.json")
) -> str:
    """Chunked prefill against one pass, per (prompt length, method), from `pask-jax bench prefill` files."""
    rows, chunk = [], None
    for file in files:
        result = load_json(root, file)
        chunk = result["chunk"]
        for r in result["rows"]:
            c, o = r["chunked"], r["one_pass"]
            rows.append(
                [
                    r["prompt_tokens"],
                    r["method"],
                    f"{c['prefill_s']:.1f} / {o['prefill_s']:.1f}",
                    f"{c['tokens_per_s']:.0f} / {o['tokens_per_s']:.0f}",
                    f"{c['compile_s']:.1f} / {o['compile_s']:.1f}",
                    f"{c['xla_temp_mib']:.0f} / {o['xla_temp_mib']:.0f}",
                    f"{c['peak_rss_over_start_mib']:.0f} / {o['peak_rss_over_start_mib']:.0f}",
                    f"{c['peak_rss_mib']:.0f} / {o['peak_rss_mib']:.0f}",
                    f"{r['kept_agreement']:.4f}",
                    f"{r['logits_max_abs_diff']:.1e}",
                ]
            )
    longest = max(row[0] for row in rows)
    at_longest = [row for row in rows if row[0] == longest]

    def at(column: int) -> str:
        return "; ".join(f"{row[1]} {row[column]}" for row in at_longest)

    claim = (
        f"Prefill in chunks of {chunk} positions against one pass over the prompt (0.5B model, batch 1), at {longest} "
        f"tokens, chunked / one pass: seconds {at(2)}; XLA scratch MiB {at(5)}; peak resident memory over the "
        f"loaded model MiB {at(6)}. Kept entries agreeing between the two: at least "
        f"{min(float(row[8]) for row in rows):.4f} in every row."
    )
    head = [
        "prompt tokens",
        "method",
        "prefill s, chunked / one pass",
        "tokens/s",
        "compile s",
        "XLA temp MiB",
        "peak RSS over start MiB",
        "peak RSS MiB",
        "kept entries agreeing",
        "logits max abs diff",
    ]
    return _block(claim, _table(head, rows))


def bench_kernel(root: Path) -> str:
    result = load_json(root, "results/bench_kernel.json")
    rows = []
    for r in result["rows"]:
        interpret = r.get("kernel_interpret_over_dense")
        rows.append(
            [
                r["T"],
                f"{r['kept_fraction']:g}",
                r["kept_slots"],
                r["capacity"],
                f"{r['dense_ms']:.2f}",
                f"{r['compacted_over_dense']:.2f}",
                f"{r['ref_over_dense']:.2f}",
                f"{r['ref_ordered_over_dense']:.2f}",
                "-" if interpret is None else f"{interpret:.2f}",
            ]
        )
    by_t = {}
    for r in result["rows"]:
        by_t.setdefault(r["T"], []).append(f"{r['compacted_over_dense']:.2f}")
    fractions = " / ".join(f"{r['kept_fraction']:g}" for r in result["rows"] if r["T"] == result["rows"][0]["T"])
    shape = result["shape"]
    claim = (
        f"One decode step's attention (B = {shape['B']}, {shape['K_kv_heads']} KV heads x {shape['G_q_per_kv']} "
        f"query heads, head dim {shape['H_head_dim']}, {shape['dtype']}, {result['machine']['backend']}) over the "
        "budget-sized pool costs, "
        f"relative to dense attention over all T positions, at kept fractions {fractions}: "
        + "; ".join(f"{' / '.join(v)} at T = {t}" for t, v in by_t.items())
        + "."
    )
    head = [
        "T",
        "kept fraction",
        "kept slots",
        "capacity",
        "dense ms",
        "compacted pool x dense",
        "XLA gather, permuted table x dense",
        "XLA gather, ordered table x dense",
        "interpreted Pallas kernel x dense",
    ]
    return _block(claim, _table(head, rows))


def cache_bytes(root: Path) -> str:
    result = load_json(root, "results/cache_bytes.json")
    args = result["args"]
    rows = [[f"{r['budget']:g}", f"{r['bytes'] / 2**20:.1f}", f"{r['ratio_vs_full']:.4f}"] for r in result["rows"]]
    claim = (
        f"The KV cache the engine allocates for {args['batch']} prompts of {args['prompt_len']} tokens plus "
        f"{args['new_tokens']} new ones ({args['model']}) is "
        + " / ".join(r[2] for r in rows)
        + " of full KV's bytes at b = "
        + " / ".join(r[0] for r in rows)
        + "."
    )
    return _block(claim, _table(["b", "MiB", "x full KV"], rows))


def prefill_compute(root: Path, file: str = "results/bench_prefill_flops.json") -> str:
    """A prefill's arithmetic rate against this machine's dense float32 matmul, from `pask-jax bench prefill`."""
    result = load_json(root, file)
    matmul = result["matmul_gflop_per_s"]
    rows = [
        [
            r["prompt_tokens"],
            r["method"],
            f"{r['model_gflop']:,.0f}",
            f"{r['chunked']['prefill_s']:.1f} / {r['one_pass']['prefill_s']:.1f}",
            f"{r['chunked']['gflop_per_s']:.0f} / {r['one_pass']['gflop_per_s']:.0f}",
            f"{r['chunked']['gflop_per_s'] / matmul:.2f} / {r['one_pass']['gflop_per_s'] / matmul:.2f}",
        ]
        for r in result["rows"]
    ]
    longest = max(result["rows"], key=lambda r: r["prompt_tokens"])
    best = max(longest["chunked"]["gflop_per_s"], longest["one_pass"]["gflop_per_s"])
    claim = (
        f"At {longest['prompt_tokens']} tokens {longest['method']}'s prefill computes {longest['model_gflop']:,.0f} "
        f"GFLOP at {best:.0f} GFLOP/s, {best / matmul:.2f} of this machine's float32 matmul rate ({matmul:.0f} "
        f"GFLOP/s on the MLP's shape): the same arithmetic at that rate would take {best / matmul:.2f} of its time."
    )
    head = ["prompt tokens", "method", "GFLOP", "seconds, chunked / one pass", "GFLOP/s", "of the matmul rate"]
    return _block(claim, _table(head, rows))


TABLES: dict[str, Callable[[Path], str]] = {
    "serving_cpu_2k": serving_cpu_2k,
    "serving_cpu_bfcl": serving_cpu_bfcl,
    "serving_stream_cpu_bfcl64": serving_stream_cpu_bfcl64,
    "serving_stream_cpu_2k": serving_stream_cpu_2k,
    "serving_stream_cpu_bfcl64_b02": serving_stream_cpu_bfcl64_b02,
    "serving_grammar_overlap": serving_grammar_overlap,
    "bench_decode": bench_decode,
    "bench_decode_2k": functools.partial(bench_decode, file="results/bench_decode_2k.json"),
    "bench_kernel": bench_kernel,
    "bench_prefill": bench_prefill,
    "prefill_compute": prefill_compute,
    "cache_bytes": cache_bytes,
}
