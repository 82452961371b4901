"""The experiments' subcommands, registered on the command line by `pask_jax.cli`: `bfcl`, `niah`, `records`, `bench`,
and BFCL's calibration part as a source for `calibrate` (its `--per-category`, `--split-rule` and `--target`).

Each subcommand's `check` is its front door (`pask_jax.arguments`): bad arguments end there, before anything loads.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

from pask_jax.arguments import (
    METHOD_NAMES,
    PLAIN_PASK,
    PROTOCOL_GRAMMAR_BACKEND,
    UsageError,
    budget_list,
    grammar_backend,
    input_file,
    int_at_least,
    int_list,
    labelled_policies,
    method_specs,
    output_file,
    parse_number,
)
from pask_jax.experiments.bfcl import CATEGORIES, SPLIT_RULE, SPLIT_RULES, SPLITS, split_items
from pask_jax.experiments.bfcl.long_context import LAYOUTS
from pask_jax.experiments.bfcl.prompt import PROMPTS
from pask_jax.models.fetch import enable_compile_cache

POLICY_HELP = (
    "plain pask's policy, as `pask-jax run` takes it: auto (default: the shipped one that fits the model), a directory "
    "from `pask-jax calibrate`, or none (PASK uncalibrated); LABEL=PATH (or LABEL=auto): the policy of pask:LABEL "
    "(repeatable)"
)


def sweep_policies(values: dict[str, str], checkpoint) -> dict:
    """A sweep's `--policy` values by label (`labelled_policies`: plain pask's is auto unless --policy names it) ->
    its PASK policies by label, resolved as `pask-jax run` resolves one (`sweep.resolve_policies`) for the model of
    `checkpoint` (a `Checkpoint`; None where there is nothing to resolve)."""
    if not values:
        return {}
    from pask_jax.experiments.sweep import resolve_policies
    from pask_jax.policy_compiler import PolicyError

    try:
        return resolve_policies(values, checkpoint.fingerprint)
    except PolicyError as exc:
        raise UsageError(f"--policy: {exc} (here: --policy DIR, or --policy none)") from None


def check_bfcl(args: argparse.Namespace) -> None:
    method_specs(args.methods, "--methods")
    if args.categories != "all":
        unknown = [c for c in args.categories.split(",") if c not in CATEGORIES]
        if unknown:
            raise UsageError(f"--categories: unknown {', '.join(map(repr, unknown))}; known: {', '.join(CATEGORIES)}")
    labelled_policies(args.policy or [])
    if args.method_config:
        input_file(args.method_config, "--method-config")
    if args.out:
        output_file(args.out, "--out")
    categories = CATEGORIES if args.categories == "all" else args.categories.split(",")
    sizes = {c: len(getattr(split_items(c, args.split_rule), args.split)) for c in categories}
    past_end = [f"{c} ({n})" for c, n in sizes.items() if n <= args.offset]
    if past_end:  # an empty sample would write a results file of zeros
        raise UsageError(
            f"--offset {args.offset}: past the end of the {args.split} part of {', '.join(past_end)}; "
            "leave those categories out"
        )


def check_niah(args: argparse.Namespace) -> None:
    labelled_policies(args.policy or [])
    if args.method_config:
        input_file(args.method_config, "--method-config")
    output_file(args.out, "--out")


def check_records(args: argparse.Namespace) -> None:
    labelled_policies(args.policy or [])
    if args.method_config:
        input_file(args.method_config, "--method-config")
    output_file(args.out, "--out")


def cmd_bfcl(args: argparse.Namespace) -> None:
    """Grammar-constrained BFCL evaluation; prints a table and writes the full JSON."""
    from pask_jax.checkpoint import Checkpoint
    from pask_jax.experiments.bfcl.evaluate import EvalConfig, format_table, read_results, run_bfcl, run_config
    from pask_jax.factory import resolve_spec

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
        grammar_backend=args.grammar_backend,
        prompt=args.prompt,
        split=args.split,
        split_rule=args.split_rule,
        context=args.context,
        layout=args.layout,
        **({"length_buckets": tuple(int(n) for n in args.length_buckets.split(","))} if args.length_buckets else {}),
    )
    from pask_jax.methods import load_method_config

    method_config = load_method_config(args.method_config)
    values = labelled_policies(args.policy or [], cfg.methods)
    checkpoint = Checkpoint.open(args.model) if values else None  # config and tokenizer for the policies' fit
    policies = sweep_policies(values, checkpoint)
    for spec in cfg.methods:  # an unknown NAME:LABEL: before the model loads
        resolve_spec(spec, method_config, policies)
    out = Path(args.out) if args.out else None
    try:  # a results file to resume must have been made with these settings: before the model loads
        read_results(out, args.model, run_config(cfg, method_config, policies))
    except ValueError as exc:
        raise UsageError(f"--out: {exc}") from None
    enable_compile_cache()
    checkpoint = checkpoint or Checkpoint.open(args.model)
    result = run_bfcl(
        checkpoint.weights(),
        checkpoint.tokenizer,
        args.model,
        cfg,
        method_config=method_config,
        policies=policies,
        out=out,
        chat_template=checkpoint.chat_template,
    )
    print(format_table(result, categories))
    if out:
        print(f"wrote {out}", file=sys.stderr)


def cmd_bench(args: argparse.Namespace) -> None:
    """`pask-jax bench BENCHMARK ...`: the benchmarks in `experiments.bench` (`BENCHMARKS`), each with its own flags."""
    from pask_jax.experiments.bench import main as bench_main

    bench_main(args.args)


def _workload_methods(args: argparse.Namespace) -> tuple[str, ...]:
    """--methods, and `pask:LABEL` for every labelled --policy not among them (a labelled policy adds its run)."""
    from pask_jax.experiments.niah import parse_names

    labels = [entry.rpartition("=")[0] for entry in args.policy or []]
    methods = parse_names(args.methods, "methods")
    extra = (f"pask:{label}" for label in labels if label not in ("", PLAIN_PASK))
    return methods + tuple(spec for spec in extra if spec not in methods)


def _run_workload(args: argparse.Namespace, cfg, workload, run: Callable, error: type[ValueError], kind: str) -> None:
    """A synthetic workload's run (`workload`: the niah or records module, `run` its run function) under `cfg`,
    whose settings were checked: the method configs, checkpoint and labelled policies checked against the methods
    and the results file's settings before the model loads; a table, and the resumable results JSON."""
    from pask_jax.checkpoint import Checkpoint
    from pask_jax.experiments import niah
    from pask_jax.methods import load_method_config
    from pask_jax.requests import RequestBuilder

    method_config = load_method_config(args.method_config)
    checkpoint = Checkpoint.open(args.model)
    policies = sweep_policies(labelled_policies(args.policy or [], cfg.methods), checkpoint)
    niah.check_methods(cfg, method_config, policies, checkpoint.fingerprint)
    template = checkpoint.chat_template
    if template is None:
        raise error(f"{args.model} ships no chat template, which the prompts are rendered with")
    out = Path(args.out)
    niah.read_results(out, workload.run_config(cfg, args.model, template.name, method_config, policies), kind)
    builder = RequestBuilder(checkpoint.tokenizer, template, grammar_backend=PROTOCOL_GRAMMAR_BACKEND)
    prompts = workload.build_prompts(builder, cfg)  # tokens only: no model yet
    enable_compile_cache()
    result = run(
        checkpoint.weights(),
        checkpoint.tokenizer,
        prompts,
        cfg,
        model_name=args.model,
        template_name=template.name,
        method_config=method_config,
        policies=policies,
        out=out,
    )
    print(workload.format_table(result))
    print(f"wrote {out}", file=sys.stderr)


def cmd_niah(args: argparse.Namespace) -> None:
    """Needle-in-a-haystack retrieval per (method, budget, length, depth, haystack, mode): a table and a resumable
    results JSON (`python -m tools.plot_niah` draws it)."""
    from pask_jax.experiments import niah

    cfg = niah.NiahConfig(
        methods=_workload_methods(args),
        budgets=niah.parse_floats(args.budgets, "budget"),
        lengths=niah.parse_lengths(args.lengths),
        depths=niah.parse_floats(args.depths, "depth"),
        haystacks=niah.parse_names(args.haystacks, "haystacks"),
        modes=niah.parse_names(args.modes, "modes"),
        seed=args.seed,
        batch_size=args.batch_size,
        max_new_tokens=args.max_new_tokens,
        num_groups=args.groups,
    )  # every list checked before anything loads
    _run_workload(args, cfg, niah, niah.run_niah, niah.NiahError, "needle-in-a-haystack")


def cmd_records(args: argparse.Namespace) -> None:
    """Long structured outputs: every record of a generated manifest, per (method, budget, item): a table and a
    resumable results JSON."""
    from pask_jax.experiments import niah, records

    cfg = records.RecordsConfig(
        methods=_workload_methods(args),
        budgets=niah.parse_floats(args.budgets, "budget"),
        split=args.split,
        items=args.items,
        offset=args.offset,
        batch_size=args.batch_size,
        max_new_tokens=args.max_new_tokens,
        num_groups=args.groups,
    )  # every setting checked before anything loads
    _run_workload(args, cfg, records, records.run_records, records.RecordsError, "records")


def context_list(text: str) -> str:
    """Calibration prompt lengths: comma-separated token counts >= 0 (0: BFCL's own prompt); returned as given."""
    for item in text.split(","):
        if parse_number(item.strip(), int) < 0:
            raise argparse.ArgumentTypeError(f"{text!r}: every context must be a token count >= 0")
    return text


def layout_list(text: str) -> str:
    """Comma-separated prompt layouts, each one of `LAYOUTS`; returned as given."""
    for item in text.split(","):
        if item.strip() not in LAYOUTS:
            raise argparse.ArgumentTypeError(f"layout {item.strip()!r}; choose from {', '.join(LAYOUTS)}")
    return text


def check_calibration_suite(args: argparse.Namespace) -> None:
    """`calibrate`'s BFCL flags: only without --data, and --dev-fraction only with it."""
    suite_flags = (args.per_category, args.split_rule, args.contexts, args.layouts)
    if args.data and (any(f is not None for f in suite_flags) or args.target == "canonical"):
        raise UsageError(
            "--per-category, --split-rule, --contexts, --layouts and --target canonical are for BFCL calibration; "
            "--data calibrates on your requests against the model's own answers"
        )
    if args.dev_fraction is not None and not args.data:
        raise UsageError("--dev-fraction splits --data; BFCL has its own split (--split-rule)")


def add_calibration_suite_options(p: argparse.ArgumentParser) -> None:
    """`calibrate` without --data or --stats calibrates on BFCL's calibration part: its flags."""
    p.add_argument("--per-category", type=int_at_least(1), help="(BFCL) calibration items per category (default 8)")
    p.add_argument("--split-rule", choices=SPLIT_RULES, help=f"(BFCL) which calibration part (default {SPLIT_RULE})")
    p.add_argument(
        "--contexts",
        type=context_list,
        help="(BFCL) prompt lengths to calibrate each item at, comma-separated tokens: 0 = BFCL's own prompt, N = a "
        "long prompt of at most N tokens among calibration-part distractor tools (default 0)",
    )
    p.add_argument(
        "--layouts",
        type=layout_list,
        help="(BFCL) where each prompt puts the question: question_last (default), question_first, or both "
        "comma-separated",
    )
    p.add_argument(
        "--target",
        choices=("own", "canonical"),
        help="(BFCL) teacher-forced call: the model's own full-KV call (default; always for --data), or the rendered "
        "ground truth",
    )


def calibrate_on_suite(args: argparse.Namespace, checkpoint, options: dict):
    """Calibration statistics on BFCL's calibration part, as `calibrate`'s flags ask, for a `Checkpoint`."""
    from pask_jax.experiments.bfcl.calibration import calibrate, calibration_items

    rule = args.split_rule or SPLIT_RULE
    items = calibration_items(8 if args.per_category is None else args.per_category, rule=rule)
    contexts = tuple(int(c) for c in (args.contexts or "0").split(","))
    layouts = tuple(x.strip() for x in (args.layouts or "question_last").split(","))
    return calibrate(
        checkpoint.weights(),
        checkpoint.tokenizer,
        items,
        target=args.target or "own",
        rule=rule,
        contexts=contexts,
        layouts=layouts,
        **options,
    )


def add_commands(sub: argparse._SubParsersAction, default_model: str) -> None:
    """Register `bfcl`, `niah`, `records` and `bench` on the command line's subparsers."""
    p = sub.add_parser("bfcl", help="score methods on BFCL (evaluation split) with grammar-constrained decoding")
    p.add_argument("--model", default=default_model)
    p.add_argument(
        "--methods",
        default="full",
        help=f"comma-separated: {','.join(METHOD_NAMES)}; pask runs under --policy; pask:LABEL = PASK under the "
        "policy given as --policy LABEL=PATH; NAME@int8 / @fp8 / @int4: an eviction method's entries stored quantized",
    )
    p.add_argument("--budget", default="1.0", type=budget_list, help="total KV budget(s) in (0, 1], comma-separated")
    p.add_argument("--categories", default="all", help="'all' or comma-separated BFCL categories")
    p.add_argument("--offset", type=int_at_least(0), default=0, help="first item of each category (of the split)")
    p.add_argument("--limit", type=int_at_least(1), default=25, help="items per category")
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
    p.add_argument("--batch-size", type=int_at_least(1), default=8)
    p.add_argument("--max-new-tokens", type=int_at_least(1), default=256)
    p.add_argument("--framing", default="tool_call", choices=["tool_call", "json_fence"])
    p.add_argument(
        "--grammar-backend",
        type=grammar_backend,
        default=PROTOCOL_GRAMMAR_BACKEND,
        help="the grammar the calls are decoded under (default: the protocol's, ours, as every committed number)",
    )
    p.add_argument(
        "--prompt",
        default="bfcl",
        choices=PROMPTS,
        help="bfcl: BFCL's Qwen FC prompt; bfcl_parallel: with an instruction to write one call per thing asked; "
        "template: the checkpoint's chat template with OpenAI tools (as `pask-jax run`)",
    )
    p.add_argument(
        "--context",
        type=int_at_least(0),
        default=0,
        help="> 0: long prompts of at most this many tokens, each item's tools among distractor tools, every tool "
        "in the grammar",
    )
    p.add_argument("--layout", default="question_last", choices=["question_last", "question_first"])
    p.add_argument(
        "--length-buckets",
        type=int_list,
        help="comma-separated prompt lengths prefill pads to (default: the engine's, 1.5x apart); fewer buckets, "
        "fewer compiles per method",
    )
    p.add_argument("--policy", action="append", help=POLICY_HELP)
    p.add_argument("--method-config", help="TOML of method variants and overrides, on top of configs/methods.toml")
    p.add_argument("--out", help="write the full results JSON here")
    p.set_defaults(func=cmd_bfcl, check=check_bfcl)
    p = sub.add_parser("niah", help="needle-in-a-haystack retrieval for every method at the same KV budgets")
    p.add_argument("--model", default=default_model)
    p.add_argument(
        "--methods",
        default="full,dapq,snapkv,pyramidkv,h2o,streamingllm,pask",
        help="comma-separated method specs (pask runs under --policy); each --policy LABEL=PATH adds pask:LABEL",
    )
    p.add_argument("--budgets", default="0.03,0.1,0.2", help="total KV budgets in (0, 1], comma-separated")
    p.add_argument("--lengths", default="2k,4k,8k", help="prompt lengths in tokens (k = 1024), comma-separated")
    p.add_argument(
        "--depths", default="0,10,20,30,40,50,60,70,80,90,100", help="needle depths, percent of the haystack"
    )
    p.add_argument("--haystacks", default="noise,prose", help="noise (repeated filler) and/or prose (Python's docs)")
    p.add_argument("--modes", default="free,json", help="free (text) and/or json (grammar-constrained) answers")
    p.add_argument("--seed", type=int, default=0, help="draws every needle's key and number")
    p.add_argument("--batch-size", type=int, default=4, help="prompts per shared prefill")
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--groups", type=int, default=4, help="layer groups (a policy's own groups win)")
    p.add_argument("--policy", action="append", help=POLICY_HELP)
    p.add_argument("--method-config", help="TOML of method variants and overrides, on top of configs/methods.toml")
    p.add_argument("--out", required=True, help="results JSON; an existing one is resumed (only missing cells run)")
    p.set_defaults(func=cmd_niah, check=check_niah)
    p = sub.add_parser(
        "records", help="long JSON answers: extract every record of a generated manifest, every method and budget"
    )
    p.add_argument("--model", default=default_model)
    p.add_argument(
        "--methods",
        default="full,snapkv,h2o,streamingllm,kivi,pask",
        help="comma-separated method specs (pask runs under --policy; NAME@int8 / @fp8 / @int4 stores an eviction "
        "method's entries quantized); each --policy LABEL=PATH adds pask:LABEL",
    )
    p.add_argument("--budgets", default="0.1,0.33", help="total KV budgets in (0, 1], comma-separated")
    p.add_argument(
        "--split",
        default="dev",
        choices=("dev", "evaluation"),
        help="dev items (seeds 0..) for choosing settings, or evaluation items (seeds 1000000..) for reported results",
    )
    p.add_argument("--items", type=int, default=20, help="how many items of the split")
    p.add_argument("--offset", type=int, default=0, help="the first item of the split")
    p.add_argument("--batch-size", type=int, default=4, help="items per shared prefill")
    p.add_argument("--max-new-tokens", type=int, default=2304, help="the longest gold answer is ~2,000 tokens")
    p.add_argument("--groups", type=int, default=4, help="layer groups (a policy's own groups win)")
    p.add_argument("--policy", action="append", help=POLICY_HELP)
    p.add_argument("--method-config", help="TOML of method variants and overrides, on top of configs/methods.toml")
    p.add_argument("--out", required=True, help="results JSON; an existing one is resumed (only missing cells run)")
    p.set_defaults(func=cmd_records, check=check_records)
    from pask_jax.experiments.bench import BENCHMARKS  # names and one line each; no benchmark module is imported

    # prefix "+": every "--flag" after `bench` is passed through to the benchmark's own parser; `pask-jax bench --help`
    # lists the benchmarks, `pask-jax bench NAME --help` one benchmark's flags
    p = sub.add_parser("bench", help=f"benchmarks: {' | '.join(BENCHMARKS)}", prefix_chars="+", add_help=False)
    p.add_argument("args", nargs=argparse.REMAINDER, help="a benchmark and its flags (`pask-jax bench serving --help`)")
    p.set_defaults(func=cmd_bench)
