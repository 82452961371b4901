"""Command line: `pask-jax run | compare | calibrate | fetch-model`, and the experiments' subcommands
(`pask_jax.experiments.commands`); `pask-jax --help`, `pask-jax CMD --help`."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from pask_jax.arguments import (
    AUTO_POLICY,
    DEFAULT_GRAMMAR_BACKEND,
    DEFAULT_PREP_WORKERS,
    GRAMMAR_CACHE_OFF,
    LOW_STORAGE_NAMES,
    METHOD_NAMES,
    STATS_FILE,
    OneLineParser,
    UsageError,
    budget_list,
    budget_value,
    check_policy,
    float_in,
    grammar_backend,
    input_file,
    int_at_least,
    level_list,
    method_spec,
    output_dir,
    output_file,
    policy_spec,
    positive,
)
from pask_jax.models.fetch import MODELS, FetchError, enable_compile_cache, fetch_model

DEFAULT_MODEL = "qwen2.5-coder-0.5b"


def cmd_fetch_model(args: argparse.Namespace) -> None:
    path = fetch_model(args.name)
    print(f"{args.name}: {path}  ({MODELS[args.name].license})")


def _check_run(args: argparse.Namespace) -> None:
    input_file(args.input, "-i/--input")
    output_file(args.output, "-o/--output")
    if Path(args.output).resolve() == Path(args.input).resolve():
        raise UsageError(f"-o/--output {args.output}: the output file must not be the input file")
    check_policy(args.policy, "--policy")  # checked for every method: a mistyped path is a mistake either way
    if args.grammar_cache and args.grammar_cache.lower() not in GRAMMAR_CACHE_OFF:
        output_dir(args.grammar_cache, "--grammar-cache")
    if args.method_config:
        input_file(args.method_config, "--method-config")


def _check_compare(args: argparse.Namespace) -> None:
    input_file(args.input, "input")
    for output in args.outputs:
        input_file(output, "output")


def _check_calibrate(args: argparse.Namespace) -> None:
    if args.data and args.stats:
        raise UsageError("--data calibrates, --stats compiles earlier statistics: give one of them")
    from pask_jax.experiments.commands import check_calibration_suite

    check_calibration_suite(args)  # the suite's own flags, and none of them beside --data
    if args.data:
        input_file(args.data, "--data")
    for flag, given in (("--stats", args.stats), ("--high-stats", args.high_stats)):
        if not given:
            continue
        stats = Path(given)
        if stats.is_dir():
            if not (stats / STATS_FILE).is_file():
                raise UsageError(
                    f"{flag} {given}: the directory holds no {STATS_FILE} (give a statistics file, or a policy "
                    "directory calibrated with statistics)"
                )
        else:
            input_file(given, flag)
    if args.window is not None and not args.high_stats:
        raise UsageError("--window sets the full-precision window of a two-pool policy: give --high-stats too")
    if args.high_stats:  # statistics that cannot pair are refused before any calibration runs
        from pask_jax.policy_compiler import CalibrationStats

        if CalibrationStats.load(_stats_file(Path(args.high_stats))).low_storage is None:
            raise UsageError(f"--high-stats {args.high_stats}: calibrated without --low-storage, nothing to pair")
    if args.value != "distortion" and not (args.low_storage or args.stats):
        raise UsageError(
            f"--value {args.value} ranks precision actions: calibrate with --low-storage (or compile --stats measured "
            "with one)"
        )
    output_dir(args.out, "--out")
    if args.checkpoint:
        output_dir(args.checkpoint, "--checkpoint")


def check_args(args: argparse.Namespace) -> None:
    """The front door: UsageError for an argument a subcommand cannot run with, before anything loads (`bench`
    passes its flags through to each benchmark's own parser)."""
    check = getattr(args, "check", None)
    if check is not None:
        check(args)


def _llm_options(args: argparse.Namespace) -> dict:
    """LLM's method, budget, policy and hyper-parameters; a labelled variant takes its method config section."""
    from pask_jax.factory import resolve_spec
    from pask_jax.methods import load_method_config

    base, _, storage = args.method.partition("@")
    name, overrides = base.partition(":")[0], None
    method = f"{name}@{storage}" if storage else name
    if ":" in args.method or args.method_config:
        # a ValueError (an unknown label, a bad config file): main reports it, `pask-jax run: error: ...`, status 2
        overrides = resolve_spec(args.method, load_method_config(args.method_config)).overrides
    policy = policy_spec(args.policy)
    return dict(
        method=method, budget=args.budget, policy=policy if name == "pask" else None, method_overrides=overrides
    )


def cmd_run(args: argparse.Namespace) -> int:
    """OpenAI Batch lines -> chat.completion lines, resumable by custom_id; exit status 1 if any line failed.

    Several processes (`jax.distributed.initialize()` from the environment: JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES,
    JAX_PROCESS_ID, or PASK_DISTRIBUTED=1 on a Cloud TPU slice): process p of n answers the input lines whose 0-based
    index mod n is p, into its own file `<output>.<p>-of-<n>` (see `pask_jax.batch_file`), each on a `--mesh` of its own
    devices."""
    import jax

    from pask_jax.batch_file import run_batch
    from pask_jax.models.sharding import init_distributed, make_mesh, parse_mesh

    init_distributed()  # before any JAX computation; a no-op unless the environment asks for it
    mesh = None if args.mesh is None else make_mesh(*parse_mesh(args.mesh))
    options = _llm_options(args)  # a bad variant is an error before the model loads

    def build():
        from pask_jax.llm import LLM

        memory = None if args.kv_memory_mb is None else int(args.kv_memory_mb * 2**20)
        return LLM(
            args.model,
            max_batch=args.max_batch,
            kv_memory_bytes=memory,
            dtype=args.dtype,
            mesh=mesh,
            scheduler=args.scheduler,
            max_prefill_rows=args.prefill_rows,
            grammar_backend=args.grammar_backend,
            prep_workers=args.prep_workers,
            **({"prefill_chunk": args.prefill_chunk} if args.prefill_chunk else {}),
            **({"grammar_cache_dir": args.grammar_cache} if args.grammar_cache else {}),
            **options,
        )

    summary = run_batch(build, args.input, args.output, process=jax.process_index(), processes=jax.process_count())
    print(summary.line(), file=sys.stderr)
    return 1 if summary.failed or summary.failed_before else 0


def cmd_compare(args: argparse.Namespace) -> None:
    """Side by side: the answers of several `pask-jax run` outputs to one input, with kept/full KV and schema checks."""
    from pask_jax.compare import compare_outputs, format_comparison

    print(format_comparison(compare_outputs(args.input, args.outputs)))


def cmd_calibrate(args: argparse.Namespace) -> None:
    """Calibration statistics (on a user's requests `--data`, an evaluation suite's calibration part (the
    experiments), or `--stats` from an earlier run) -> a compiled policy carrying them (`stats.json`), so it answers
    any budget; for `--data`, the dev part's requests beside it (`dev.jsonl`, `split.json`)."""
    import jax

    from pask_jax.calibration.compiler import compile_policy
    from pask_jax.calibration.data import (
        DEFAULT_DEV_FRACTION,
        data_digest,
        prepare_requests,
        read_requests,
        split_requests,
        write_split,
    )
    from pask_jax.calibration.run import DEFAULT_LEVELS, CalibrationStats, calibrate_requests
    from pask_jax.checkpoint import Checkpoint
    from pask_jax.llm import DEFAULT_MAX_CONTEXT
    from pask_jax.models.sharding import init_distributed
    from pask_jax.policy_compiler import with_high_precision
    from pask_jax.requests import RequestBuilder
    from pask_jax.storage import Storage

    budgets = [float(b) for b in args.budgets.split(",")]  # flags checked by the front door (`_check_calibrate`)
    fraction = DEFAULT_DEV_FRACTION if args.dev_fraction is None else args.dev_fraction
    split = split_requests(read_requests(args.data), fraction) if args.data else None  # bad lines: before any loading
    init_distributed()  # multi-host pods: env-driven, a no-op on one machine
    checkpoint = Checkpoint.open(args.model)  # config, tokenizer, chat template, fingerprint; weights when needed
    builder = RequestBuilder(checkpoint.tokenizer, checkpoint.chat_template, max_context=DEFAULT_MAX_CONTEXT)
    options = dict(
        groups=args.groups,
        levels=[float(x) for x in args.levels.split(",")] if args.levels else DEFAULT_LEVELS,
        checkpoint_dir=args.checkpoint,
        max_items=args.max_items,
        low_storage=args.low_storage,
    )
    if args.stats:
        stats = CalibrationStats.load(_stats_file(Path(args.stats)))
    elif split is not None:
        prepared = prepare_requests(builder, split.calibration, args.data)  # bad requests: before the weights
        stats = calibrate_requests(
            checkpoint.weights(), checkpoint.tokenizer, prepared, data=data_digest(split.calibration), **options
        )
    else:
        from pask_jax.experiments.commands import calibrate_on_suite

        stats = calibrate_on_suite(args, checkpoint, options)
    if args.high_stats:  # HIGH: the second calibration's LOW precision instead of full precision
        stats = with_high_precision(stats, CalibrationStats.load(_stats_file(Path(args.high_stats))))
    if stats.n_items == 0:
        reasons = sorted(set(stats.skipped.values()))[:3]
        raise ValueError(f"no item was calibrated ({len(stats.skipped)} skipped: {reasons}); no policy written")
    # the record of the run: every flag given, without argparse's own entries
    ran_with = {k: v for k, v in vars(args).items() if k not in ("command", "func", "check") and v is not None}
    head_dim = checkpoint.fingerprint.head_dim
    storage = None  # precision actions: the cache the policy is compiled for
    if stats.low_storage is not None:
        window = TWO_POOL_WINDOW if args.window is None else args.window
        storage = Storage.for_actions(stats.low_storage, stats.high_storage or "bf16", head_dim, window=window)
    policy = compile_policy(
        stats,
        budgets,
        entry_bytes=None if storage is None else storage.action_bytes(head_dim),
        window_bytes=0.0 if storage is None or not stats.high_storage else storage.window_bytes(head_dim),
        value=args.value,
        tolerance=args.tolerance,
        floor_share=args.floor_share,
        ablation=args.ablation,
        fits=checkpoint.fingerprint,
        notes="pask-jax calibrate " + " ".join(f"--{k.replace('_', '-')} {v}" for k, v in ran_with.items()),
    )
    path = policy.save(args.out)  # on a pod: every host takes part in orbax's save, the first one writes the files
    if jax.process_index() > 0:
        return
    print(
        f"policy for {stats.model} ({stats.n_items} items calibrated, {len(stats.skipped)} skipped; tables for "
        f"{budgets}, any other budget compiled on load) -> {path}"
    )
    if split is not None:
        dev_path, _ = write_split(path, split, args.data)
        if not split.dev:
            print("no dev part (--dev-fraction 0): check the policy on requests with other tool sets before use")
            return
        print(
            f"dev part: {len(split.dev)} requests over {split.tool_sets('dev')} tool sets not calibrated on, in "
            f"{dev_path}; check the policy on them before use:\n"
            f"  pask-jax run -i {dev_path} -o dev_full.jsonl --model {args.model} --method full\n"
            f"  pask-jax run -i {dev_path} -o dev_pask.jsonl --model {args.model} --policy {path} --budget "
            f"{budgets[0]}\n"
            f"  pask-jax compare {dev_path} dev_full.jsonl dev_pask.jsonl"
        )


TWO_POOL_WINDOW = 32  # `calibrate --window`'s default: KIVI's window at its smallest, one block


def _stats_file(source: Path) -> Path:
    """A statistics file, or the one a policy directory holds."""
    return source / STATS_FILE if source.is_dir() else source


def cmd_triaxial_table(args: argparse.Namespace) -> None:
    """Statistics calibrated at INT2 and at INT4 (`calibrate --low-storage kivi2`, `kivi4`) -> TriAxialKV's tag table
    at a budget, written as a method config section (`run --method triaxialkv[:LABEL] --method-config OUT`)."""
    from pask_jax.policy_compiler import CalibrationStats
    from pask_jax.triaxial_table import compile_triaxial_bits, triaxial_config

    stats = [CalibrationStats.load(path) for path in (args.int2, args.int4)]
    int4 = compile_triaxial_bits(*stats, args.budget, args.head_dim, args.group, args.residual)
    note = f"TriAxialKV at budget {args.budget:g}, head_dim {args.head_dim}, from {args.int2} and {args.int4}"
    Path(args.out).write_text(triaxial_config(int4, args.label, note, args.group, args.residual))
    method = f"triaxialkv:{args.label}" if args.label else "triaxialkv"
    print(
        f"{args.out}: INT4 for {', '.join(int4) or 'no tag (INT2 everywhere)'}; run it with --method {method} "
        f"--method-config {args.out} --budget {args.budget:g}"
    )


def _check_triaxial_table(args: argparse.Namespace) -> None:
    input_file(args.int2, "--int2")
    input_file(args.int4, "--int4")
    output_file(args.out, "--out")


def main(argv: list[str] | None = None) -> None:
    from pask_jax.calibration.compiler import ABLATIONS, ACTION_VALUES
    from pask_jax.experiments.commands import add_calibration_suite_options, add_commands

    parser = OneLineParser(prog="pask-jax", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("fetch-model", help="download, verify and assemble a registered checkpoint")
    p.add_argument("name", nargs="?", default=DEFAULT_MODEL, choices=sorted(MODELS))
    p.set_defaults(func=cmd_fetch_model)
    p = sub.add_parser("run", help="OpenAI Batch requests (JSONL) -> chat.completion results (JSONL), resumable")
    p.add_argument("-i", "--input", required=True, help="OpenAI Batch input lines (custom_id, method, url, body)")
    p.add_argument("-o", "--output", required=True, help="results, appended; a rerun skips answered custom_ids")
    p.add_argument("--model", default=DEFAULT_MODEL, help="registered name, .gguf file or HF checkpoint directory")
    p.add_argument(
        "--method",
        default="pask",
        type=method_spec,
        help=f"{', '.join(METHOD_NAMES)}, or NAME:LABEL, a labelled variant of the method config "
        "(e.g. pask:v1, the first PASK)",
    )
    p.add_argument("--method-config", help="TOML of method variants and overrides, on top of configs/methods.toml")
    p.add_argument("--budget", type=budget_value, default=0.33, help="total KV budget in (0, 1] (full KV: 1)")
    p.add_argument(
        "--policy",
        default=AUTO_POLICY,
        help="PASK policy: auto (the shipped one that fits the model), a directory, or none (PASK uncalibrated)",
    )
    p.add_argument(
        "--max-batch", type=int_at_least(1), default=8, help="cache rows (continuous) or rows per micro-batch (static)"
    )
    p.add_argument(
        "--kv-memory-mb",
        type=positive,
        help="KV-cache memory: it sets the row count (a smaller cache gets more rows)",
    )
    p.add_argument(
        "--scheduler",
        default="continuous",
        choices=("continuous", "static"),
        help="continuous: a finished row takes the next request at once; static: micro-batches decode to their end",
    )
    p.add_argument(
        "--prefill-rows",
        type=int_at_least(1),
        help="continuous: rows prefilled together at most (default: all admitted; 1 wastes no padding on CPU)",
    )
    p.add_argument(
        "--dtype",
        default="auto",
        choices=("auto", "float32", "bfloat16"),
        help="weights, activations and KV cache (auto: bfloat16 on TPU / GPU, float32 on CPU)",
    )
    p.add_argument("--mesh", help="DATAxMODEL mesh of this process's devices, e.g. 8x1 or 4x2 (default: one device)")
    p.add_argument(
        "--prefill-chunk",
        type=int_at_least(1),
        help="prompts longer than this many tokens are prefilled in equal chunks of at most this many (default: "
        "pask_jax.runtime.PREFILL_CHUNK, 2048): prefill memory follows the chunk, not the prompt",
    )
    p.add_argument(
        "--grammar-backend",
        type=grammar_backend,
        default=DEFAULT_GRAMMAR_BACKEND,
        help="outlines: our schema translation + outlines-core (a schema constraint it does not enforce is refused); "
        "outlines-loose: the same, such constraints dropped; llguidance: llguidance's JSON Schema compiler; auto: "
        "outlines where it enforces every keyword, else llguidance",
    )
    p.add_argument(
        "--grammar-cache",
        metavar="DIR",
        help="directory compiled grammars persist in, for later runs and other processes or hosts (default: "
        "$PASK_JAX_GRAMMAR_CACHE, else ~/.cache/pask-jax/grammars); none: in memory only",
    )
    p.add_argument(
        "--prep-workers",
        type=int_at_least(0),
        default=DEFAULT_PREP_WORKERS,
        help="host threads compiling request grammars while the device runs (continuous batching: a request is "
        "admitted once its grammar is compiled); 0: every grammar compiled before anything runs",
    )
    p.set_defaults(func=cmd_run, check=_check_run)
    p = sub.add_parser("compare", help="print the answers of several `run` outputs side by side")
    p.add_argument("input", help="the input JSONL the outputs answer")
    p.add_argument("outputs", nargs="+", help="`pask-jax run` output files")
    p.set_defaults(func=cmd_compare, check=_check_compare)
    p = sub.add_parser(
        "calibrate",
        help="calibrate PASK on your requests (--data) or an evaluation suite's calibration part; compile a policy",
    )
    p.add_argument("--model", default=DEFAULT_MODEL, help="registered name, .gguf file or HF checkpoint directory")
    p.add_argument(
        "--data",
        help="OpenAI Batch input lines (as `pask-jax run` reads) to calibrate on; split by tool set into a "
        "calibration part and a dev part (written beside the policy as dev.jsonl)",
    )
    p.add_argument(
        "--dev-fraction",
        type=float_in(0.0, 1.0, open_high=True),
        help="(--data) share of the requests held out as the dev part (default 0.2)",
    )
    p.add_argument(
        "--budgets", default="0.2,0.33,0.5", type=budget_list, help="budgets compiled into the policy (others on load)"
    )
    p.add_argument("--groups", type=int_at_least(1), default=4, help="layer groups")
    p.add_argument(
        "--levels", type=level_list, help="comma-separated keep levels per bucket, 0 included (default: DEFAULT_LEVELS)"
    )
    p.add_argument("--tolerance", type=float_in(0.0), default=0.02, help="task-error increase a floor may allow")
    p.add_argument("--checkpoint", help="orbax progress directory (rerun to resume)")
    p.add_argument(
        "--max-items", type=int_at_least(1), help="calibrate at most this many items now (rerun with --checkpoint)"
    )
    p.add_argument(
        "--floor-share",
        type=float_in(0.0, 1.0),
        default=1.0,
        help="fraction of a layer group's share its floors may take",
    )
    p.add_argument(
        "--low-storage",
        choices=LOW_STORAGE_NAMES,
        help="also measure every bucket stored at this LOW precision and compile precision actions (RELEASE / "
        "RETAIN_LOW / RETAIN_HIGH) under the byte budget",
    )
    p.add_argument(
        "--value",
        default="distortion",
        choices=ACTION_VALUES,
        help="precision actions: what the byte knapsack counts as an action's value, the attention-output distortion "
        "it removes (default) or the gold tokens' NLL increase it removes",
    )
    p.add_argument("--stats", help="compile saved statistics (a stats.json, or a policy directory holding one) instead")
    p.add_argument(
        "--high-stats",
        help="statistics of the same items measured at a second LOW precision (a stats.json or policy directory, "
        "e.g. --low-storage kivi4): RETAIN_HIGH becomes that block precision instead of full precision (two block "
        "pools and a full-precision window)",
    )
    p.add_argument(
        "--window",
        type=int_at_least(1),
        help=f"with --high-stats: the full-precision window the cache keeps (PASK's high_window; at least a block; "
        f"default {TWO_POOL_WINDOW}): its bytes are set aside from the budget",
    )
    p.add_argument("--ablation", default="none", choices=ABLATIONS, help="compile an ablated policy")
    p.add_argument("--out", required=True, help="policy directory, e.g. policies/my-model")
    p.set_defaults(func=cmd_calibrate, check=_check_calibrate)
    add_calibration_suite_options(p)
    p = sub.add_parser("triaxial-table", help="TriAxialKV's tag table from INT2 and INT4 statistics, at a budget")
    p.add_argument("--int2", required=True, help="statistics (stats.json) calibrated with --low-storage kivi2")
    p.add_argument("--int4", required=True, help="statistics (stats.json) calibrated with --low-storage kivi4")
    p.add_argument("--budget", required=True, type=budget_value, help="total KV budget in bytes, in (0, 1]")
    p.add_argument("--head-dim", required=True, type=int_at_least(1), help="the model's head_dim (entry bytes)")
    p.add_argument("--group", default=32, type=int_at_least(1), help="tokens per KIVI block (default 32)")
    p.add_argument("--residual", default=128, type=int_at_least(1), help="full-precision window (default 128)")
    p.add_argument("--label", default="", help="write the section as triaxialkv:LABEL (default: triaxialkv)")
    p.add_argument("--out", required=True, help="method config file (TOML) to write")
    p.set_defaults(func=cmd_triaxial_table, check=_check_triaxial_table)
    add_commands(sub, DEFAULT_MODEL)
    args = parser.parse_args(argv)
    try:
        check_args(args)  # the front door: bad paths and settings end here, before anything loads
        if args.command in ("run", "calibrate"):
            enable_compile_cache()
        status = args.func(args)
    except (FetchError, ValueError, ModuleNotFoundError) as e:
        parser.exit(2, f"pask-jax {args.command}: error: {e}\n")
    sys.exit(status or 0)


if __name__ == "__main__":
    main()
