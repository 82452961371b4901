"""Command line: `pask-jax run | compare | bfcl | calibrate | bench | fetch-model` (`pask-jax CMD --help`)."""

from __future__ import annotations

import argparse
import json
import sys

from pask_jax.bfcl import SPLIT_RULE, SPLIT_RULES, SPLITS
from pask_jax.models.fetch import MODELS, FetchError, fetch_model

DEFAULT_MODEL = "qwen2.5-coder-0.5b"
METHOD_NAMES = ("full", "random", "streamingllm", "h2o", "snapkv", "pyramidkv", "dapq", "pask")  # = methods.METHODS


def cmd_fetch_model(args: argparse.Namespace) -> None:
    path = fetch_model(args.name)
    print(f"{args.name}: {path}  ({MODELS[args.name].license})")


def _llm_options(args: argparse.Namespace) -> dict:
    policy = None if args.policy in (None, "none") else args.policy
    return dict(method=args.method, budget=args.budget, policy=policy if args.method == "pask" else None)


def cmd_run(args: argparse.Namespace) -> int:
    """OpenAI Batch lines -> chat.completion lines, resumable by custom_id; exit status 1 if any line failed."""
    from pask_jax.batch import run_batch

    def build():
        from pask_jax.llm import LLM

        memory = None if args.kv_memory_mb is None else int(args.kv_memory_mb * 2**20)
        return LLM(args.model, max_batch=args.max_batch, kv_memory_bytes=memory, **_llm_options(args))

    summary = run_batch(build, args.input, args.output)
    print(summary.line(), file=sys.stderr)
    return 1 if summary.failed or summary.failed_before else 0


def cmd_compare(args: argparse.Namespace) -> None:
    """Side by side: the answers of several `pask-jax run` outputs to one input, with kept/full KV and schema checks."""
    from pask_jax.compare import compare_outputs, format_comparison

    print(format_comparison(compare_outputs(args.input, args.outputs)))


def cmd_bfcl(args: argparse.Namespace) -> None:
    """Grammar-constrained BFCL evaluation; prints a table and writes the full JSON."""
    from pathlib import Path

    from pask_jax import load_model, load_tokenizer
    from pask_jax.bfcl import CATEGORIES
    from pask_jax.evaluate import EvalConfig, format_table, run_bfcl

    categories = CATEGORIES if args.categories == "all" else tuple(args.categories.split(","))
    cfg = EvalConfig(
        methods=tuple(args.methods.split(",")),
        budgets=tuple(float(b) for b in str(args.budget).split(",")),
        categories=categories,
        offset=args.offset,
        limit=args.limit,
        batch_size=args.batch_size,
        max_new_tokens=args.max_new_tokens,
        framing=args.framing,
        split=args.split,
        split_rule=args.split_rule,
        context=args.context,
        layout=args.layout,
        **({"length_buckets": tuple(int(n) for n in args.length_buckets.split(","))} if args.length_buckets else {}),
    )
    from pask_jax.methods import load_method_config
    from pask_jax.policy import PersistencePolicy

    method_config = load_method_config(args.method_config)
    policies = {}
    for entry in args.policy or []:
        label, _, path = entry.rpartition("=")
        policies[label or "pask"] = PersistencePolicy.load(path)
    if "pask" in cfg.methods and "pask" not in policies:
        print("note: --methods pask without --policy runs PASK uncalibrated (recency + sinks)", file=sys.stderr)
    model = load_model(args.model)
    tokenizer = load_tokenizer(args.model)
    out = Path(args.out) if args.out else None

    def save(result: dict) -> None:  # after every category, so a long run keeps what it measured
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=1) + "\n")

    result = run_bfcl(
        model,
        tokenizer,
        args.model,
        cfg,
        method_config=method_config,
        policies=policies,
        on_category=save if out else None,
    )
    print(format_table(result, categories))
    if out:
        print(f"wrote {out}", file=sys.stderr)


def cmd_calibrate(args: argparse.Namespace) -> None:
    """Calibration statistics on the BFCL calibration split (or `--stats` from an earlier run) -> compiled policy."""
    from pask_jax import load_model, load_tokenizer
    from pask_jax.calibration.compiler import compile_policy
    from pask_jax.calibration.run import (
        DEFAULT_LEVELS,
        CalibrationStats,
        calibrate,
        calibration_items,
        init_distributed,
    )
    from pask_jax.models.loading import load_config
    from pask_jax.policy import ModelFingerprint

    init_distributed()  # multi-host pods: env-driven, a no-op on one machine
    budgets = [float(b) for b in args.budgets.split(",")]
    tokenizer = load_tokenizer(args.model)
    fits = ModelFingerprint.of(load_config(args.model), tokenizer)
    if args.stats:
        stats = CalibrationStats.load(args.stats)
    else:
        model = load_model(args.model)
        stats = calibrate(
            model,
            tokenizer,
            calibration_items(args.per_category, rule=args.split_rule),
            groups=args.groups,
            levels=[float(x) for x in args.levels.split(",")] if args.levels else DEFAULT_LEVELS,
            target=args.target,
            rule=args.split_rule,
            checkpoint_dir=args.checkpoint,
        )
        stats.save(f"{args.out}.stats.json")
    policy = compile_policy(
        stats,
        budgets,
        tolerance=args.tolerance,
        floor_share=args.floor_share,
        ablation=args.ablation,
        fits=fits,
        notes=f"pask-jax calibrate {' '.join(sys.argv[2:])}",
    )
    path = policy.save(args.out)
    print(f"policy for {stats.model} ({stats.n_items} items, budgets {budgets}) -> {path}")


def cmd_bench(args: argparse.Namespace) -> None:
    """`pask-jax bench serving|decode|kernel ...`: the benchmarks in `pask_jax.bench`, each with its own flags."""
    from pask_jax.bench import main as bench_main

    bench_main(args.args)


def enable_compile_cache() -> None:
    """Keep XLA executables in `$PASK_JAX_CACHE/xla`: later runs (a sweep in chunks, ablations) skip the compiles
    of shapes an earlier run already built. A 24-layer decode step takes ~7 s to compile on 2 CPU cores."""
    import jax

    from pask_jax.models.fetch import cache_dir

    jax.config.update("jax_compilation_cache_dir", str(cache_dir() / "xla"))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 1.0)


def main(argv: list[str] | None = None) -> None:
    from pask_jax.calibration.compiler import ABLATIONS

    parser = argparse.ArgumentParser(prog="pask-jax", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("fetch-model", help="download, verify and assemble a registered checkpoint")
    p.add_argument("name", nargs="?", default=DEFAULT_MODEL, choices=sorted(MODELS))
    p.set_defaults(func=cmd_fetch_model)
    p = sub.add_parser("run", help="OpenAI Batch requests (JSONL) -> chat.completion results (JSONL), resumable")
    p.add_argument("-i", "--input", required=True, help="OpenAI Batch input lines (custom_id, method, url, body)")
    p.add_argument("-o", "--output", required=True, help="results, appended; a rerun skips answered custom_ids")
    p.add_argument("--model", default=DEFAULT_MODEL, help="registered name, .gguf file or HF checkpoint directory")
    p.add_argument("--method", default="pask", choices=sorted(METHOD_NAMES))
    p.add_argument("--budget", type=float, default=0.33, help="total KV budget in (0, 1] (full KV: 1)")
    p.add_argument(
        "--policy", default="auto", help="PASK policy: auto (the shipped one that fits the model), a directory, none"
    )
    p.add_argument("--max-batch", type=int, default=8, help="rows per micro-batch")
    p.add_argument(
        "--kv-memory-mb", type=float, help="KV-cache memory per micro-batch: rows are admitted while it fits"
    )
    p.set_defaults(func=cmd_run)
    p = sub.add_parser("compare", help="print the answers of several `run` outputs side by side")
    p.add_argument("input", help="the input JSONL the outputs answer")
    p.add_argument("outputs", nargs="+", help="`pask-jax run` output files")
    p.set_defaults(func=cmd_compare)
    p = sub.add_parser("bfcl", help="score methods on BFCL (evaluation split) with grammar-constrained decoding")
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument(
        "--methods",
        default="full",
        help="comma-separated: full,random,streamingllm,h2o,snapkv,pyramidkv,dapq,pask; pask:LABEL = PASK under "
        "the policy given as --policy LABEL=PATH",
    )
    p.add_argument("--budget", default="1.0", help="total KV budget(s) in (0, 1], comma-separated")
    p.add_argument("--categories", default="all", help="'all' or comma-separated BFCL categories")
    p.add_argument("--offset", type=int, default=0, help="first item of each category (of the split)")
    p.add_argument("--limit", type=int, default=25, help="items per category")
    p.add_argument(
        "--split",
        default="evaluation",
        choices=SPLITS,
        help="evaluation items (reported results), or dev items (for choosing hyper-parameters)",
    )
    p.add_argument(
        "--split-rule",
        default=SPLIT_RULE,
        choices=SPLIT_RULES,
        help="schema: parts share no tool set or live group (default); item-hash: the earlier per-item split, to "
        "reproduce results scored under it",
    )
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--framing", default="tool_call", choices=["tool_call", "json_fence"])
    p.add_argument(
        "--context",
        type=int,
        default=0,
        help="> 0: long prompts of at most this many tokens, each item's tools among distractor tools, every tool "
        "in the grammar",
    )
    p.add_argument("--layout", default="question_last", choices=["question_last", "question_first"])
    p.add_argument(
        "--length-buckets",
        help="comma-separated prompt lengths prefill pads to (default: the engine's, 1.5x apart); fewer buckets, "
        "fewer compiles per method",
    )
    p.add_argument(
        "--policy",
        action="append",
        help="compiled PASK policy directory (from `pask-jax calibrate`), for method pask; LABEL=PATH for pask:LABEL "
        "(repeatable)",
    )
    p.add_argument("--method-config", help="TOML of method hyper-parameters (default: configs/methods.toml)")
    p.add_argument("--out", help="write the full results JSON here")
    p.set_defaults(func=cmd_bfcl)
    p = sub.add_parser("calibrate", help="calibrate PASK on the BFCL calibration split and compile a policy")
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--budgets", default="0.2,0.33,0.5")
    p.add_argument("--per-category", type=int, default=8, help="calibration items per BFCL category")
    p.add_argument("--split-rule", default=SPLIT_RULE, choices=SPLIT_RULES, help="which calibration part to use")
    p.add_argument("--groups", type=int, default=4, help="layer groups")
    p.add_argument("--levels", help="comma-separated keep levels per bucket, 0 included (default: DEFAULT_LEVELS)")
    p.add_argument(
        "--target",
        default="own",
        choices=("own", "canonical"),
        help="teacher-forced call: the model's own full-KV call, or the rendered ground truth",
    )
    p.add_argument("--tolerance", type=float, default=0.02, help="task-error increase a floor may allow")
    p.add_argument("--checkpoint", help="orbax progress directory (rerun to resume)")
    p.add_argument(
        "--floor-share", type=float, default=1.0, help="fraction of a layer group's share its floors may take"
    )
    p.add_argument("--stats", help="compile from saved calibration statistics instead of calibrating")
    p.add_argument("--ablation", default="none", choices=ABLATIONS, help="compile an ablated policy")
    p.add_argument("--out", required=True, help="policy directory, e.g. policies/qwen2.5-coder-0.5b")
    p.set_defaults(func=cmd_calibrate)
    # prefix "+": every "--flag" after `bench` is passed through to the script's own parser (`pask-jax bench --help`)
    p = sub.add_parser("bench", help="benchmarks: serving | decode | kernel", prefix_chars="+", add_help=False)
    p.add_argument("args", nargs=argparse.REMAINDER, help="a benchmark and its flags (`pask-jax bench serving --help`)")
    p.set_defaults(func=cmd_bench)
    args = parser.parse_args(argv)
    if args.command in ("run", "bfcl", "calibrate"):
        enable_compile_cache()
    try:
        status = args.func(args)
    except (FetchError, ValueError, ModuleNotFoundError) as e:
        parser.exit(2, f"pask-jax {args.command}: error: {e}\n")
    sys.exit(status or 0)


if __name__ == "__main__":
    main()
