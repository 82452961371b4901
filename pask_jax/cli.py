"""Command line: `pask-jax run | compare | bfcl | niah | calibrate | bench | fetch-model` (`pask-jax CMD --help`)."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import NoReturn

from pask_jax.bfcl import CATEGORIES, SPLIT_RULE, SPLIT_RULES, SPLITS
from pask_jax.models.fetch import MODELS, FetchError, fetch_model

DEFAULT_MODEL = "qwen2.5-coder-0.5b"
METHOD_NAMES = ("full", "random", "streamingllm", "h2o", "snapkv", "pyramidkv", "dapq", "pask")  # = methods.METHODS


def cmd_fetch_model(args: argparse.Namespace) -> None:
    path = fetch_model(args.name)
    print(f"{args.name}: {path}  ({MODELS[args.name].license})")


def _method_spec(spec: str) -> str:
    """`NAME` or `NAME:LABEL` (a labelled variant of the method config), its method checked without importing JAX."""
    if spec.partition(":")[0] not in METHOD_NAMES:
        raise argparse.ArgumentTypeError(f"unknown method {spec!r}; known: {', '.join(METHOD_NAMES)} (or NAME:LABEL)")
    return spec


# ---- the front door: every argument a subcommand can check without a model, checked before any expensive work ----
# Value checks are argparse `type=` functions (`argument --budget: ...`); paths are checked by `check_args` once
# the command line is parsed. Either way the error is one line on stderr, `pask-jax CMD: error: ...`, exit status 2.
# Output paths: a missing parent directory is created when the output is written (`mkdir -p`, as batch tools do),
# but only below an existing directory other than the filesystem root: `/missing-dir/out.jsonl` is refused (a new
# top-level directory is almost always a typo), and so is a parent that is a file or cannot be written.

POLICY_META = "policy.json"  # what makes a directory a policy (`pask_jax.policy.PersistencePolicy.load`)
STATS_FILE = "stats.json"  # = pask_jax.policy.STATS_FILE (kept here: the front door imports no JAX)


class UsageError(ValueError):
    """A command line that cannot run: the message names the argument and what is wrong with it."""


class _Parser(argparse.ArgumentParser):
    """argparse with each error on one line, `pask-jax CMD: error: MESSAGE`, exit status 2 (no usage block)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see `{self.prog} --help`)\n")


def _number(text: str, kind=float):
    try:
        return kind(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not {'an integer' if kind is int else 'a number'}") from None


def _budget(text: str) -> float:
    """A KV budget in (0, 1]."""
    value = _number(text)
    if not 0.0 < value <= 1.0:
        raise argparse.ArgumentTypeError(f"budget {text} must be in (0, 1] (full KV: 1)")
    return value


def _budget_list(text: str) -> str:
    """Comma-separated budgets, each in (0, 1]; returned as given (the commands split it, and calibrate records it)."""
    for item in text.split(","):
        if not item.strip():
            raise argparse.ArgumentTypeError(f"{text!r}: an empty entry in the comma-separated budgets")
        if not 0.0 < _number(item.strip()) <= 1.0:
            raise argparse.ArgumentTypeError(f"{text}: every budget must be in (0, 1], not {item.strip()}")
    return text


def _levels(text: str) -> str:
    """Calibration keep levels: comma-separated fractions in [0, 1], 0 among them; returned as given."""
    values = [_number(item.strip()) for item in text.split(",")]
    if not all(0.0 <= v <= 1.0 for v in values) or 0.0 not in values:
        raise argparse.ArgumentTypeError(f"{text!r}: every level must be in [0, 1], and 0 among them")
    return text


def _int_list(text: str) -> str:
    """Comma-separated positive integers (prompt lengths); returned as given."""
    for item in text.split(","):
        if _number(item.strip(), int) < 1:
            raise argparse.ArgumentTypeError(f"{text!r}: every entry must be a positive integer")
    return text


def _int_at_least(low: int):
    def check(text: str) -> int:
        value = _number(text, int)
        if value < low:
            raise argparse.ArgumentTypeError(f"{text} must be >= {low}")
        return value

    return check


def _positive(text: str) -> float:
    value = _number(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"{text} must be > 0")
    return value


def _float_in(low: float, high: float | None = None, *, open_high: bool = False):
    """A number in [low, high] ([low, high) with `open_high`; >= low without `high`)."""

    def check(text: str) -> float:
        value = _number(text)
        if value < low or (high is not None and (value >= high if open_high else value > high)):
            bound = f">= {low:g}" if high is None else f"in [{low:g}, {high:g}{')' if open_high else ']'}"
            raise argparse.ArgumentTypeError(f"{text} must be {bound}")
        return value

    return check


def _input_file(path: str, flag: str) -> None:
    p = Path(path)
    if not p.exists():
        raise UsageError(f"{flag} {path}: no such file")
    if not p.is_file():
        raise UsageError(f"{flag} {path}: {'a directory' if p.is_dir() else 'not a regular file'}, not an input file")
    if not os.access(p, os.R_OK):
        raise UsageError(f"{flag} {path}: not readable")


def _creatable(path: str, flag: str) -> None:
    """`path` does not exist: refuse it unless its missing parents can be made (see above)."""
    absolute = Path(os.path.abspath(path))
    ancestor, missing = absolute.parent, []
    while not ancestor.exists():
        missing.append(ancestor)
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        raise UsageError(f"{flag} {path}: {ancestor} is a file, not a directory")
    if missing and ancestor == Path(ancestor.anchor):
        raise UsageError(
            f"{flag} {path}: directory {missing[-1]} does not exist (a typo?); missing directories are made only "
            f"below an existing one other than {ancestor}: create it first if it is meant"
        )
    if not os.access(ancestor, os.W_OK | os.X_OK):
        raise UsageError(f"{flag} {path}: cannot create it: {ancestor} is not writable")


def _output_file(path: str, flag: str) -> None:
    p = Path(path)
    if p.is_dir():
        raise UsageError(f"{flag} {path}: a directory; give the path of a file")
    if p.exists():
        if not os.access(p, os.W_OK):
            raise UsageError(f"{flag} {path}: not writable")
    else:
        _creatable(path, flag)


def _output_dir(path: str, flag: str) -> None:
    p = Path(path)
    if p.exists():
        if not p.is_dir():
            raise UsageError(f"{flag} {path}: a file; give the path of a directory")
        if not os.access(p, os.W_OK | os.X_OK):
            raise UsageError(f"{flag} {path}: not writable")
    else:
        _creatable(path, flag)


def _policy_dir(path: str, flag: str, alternatives: str = "") -> None:
    p = Path(path)
    if not p.exists():
        raise UsageError(
            f"{flag}: no such policy directory {path} (give a directory from `pask-jax calibrate`{alternatives})"
        )
    if not p.is_dir():
        raise UsageError(f"{flag}: {path} is a file; a policy is a directory from `pask-jax calibrate`{alternatives}")
    if not (p / POLICY_META).is_file():
        raise UsageError(f"{flag}: {path} holds no policy (no {POLICY_META}); create one with `pask-jax calibrate`")


def _method_specs(text: str, flag: str) -> None:
    specs = [s.strip() for s in text.split(",")]
    if not all(specs):
        raise UsageError(f"{flag} {text!r}: an empty entry in the comma-separated list")
    for spec in specs:
        try:
            _method_spec(spec)
        except argparse.ArgumentTypeError as e:
            raise UsageError(f"{flag}: {e}") from None


def _check_run(args: argparse.Namespace) -> None:
    _input_file(args.input, "-i/--input")
    _output_file(args.output, "-o/--output")
    if Path(args.output).resolve() == Path(args.input).resolve():
        raise UsageError(f"-o/--output {args.output}: the output file must not be the input file")
    if args.policy not in ("auto", "none"):  # checked for every method: a mistyped path is a mistake either way
        _policy_dir(args.policy, "--policy", ", or auto or none")
    if args.method_config:
        _input_file(args.method_config, "--method-config")


def _check_compare(args: argparse.Namespace) -> None:
    _input_file(args.input, "input")
    for output in args.outputs:
        _input_file(output, "output")


def _check_bfcl(args: argparse.Namespace) -> None:
    _method_specs(args.methods, "--methods")
    if args.categories != "all":
        unknown = [c for c in args.categories.split(",") if c not in CATEGORIES]
        if unknown:
            raise UsageError(f"--categories: unknown {', '.join(map(repr, unknown))}; known: {', '.join(CATEGORIES)}")
    for entry in args.policy or []:
        _policy_dir(entry.rpartition("=")[2], f"--policy {entry}")
    if args.method_config:
        _input_file(args.method_config, "--method-config")
    if args.out:
        _output_file(args.out, "--out")


def _check_calibrate(args: argparse.Namespace) -> None:
    if args.data and args.stats:
        raise UsageError("--data calibrates, --stats compiles earlier statistics: give one of them")
    if args.data and (args.per_category is not None or args.split_rule is not None or args.target == "canonical"):
        raise UsageError(
            "--per-category, --split-rule and --target canonical are for BFCL calibration; --data calibrates on "
            "your requests against the model's own answers"
        )
    if args.dev_fraction is not None and not args.data:
        raise UsageError("--dev-fraction splits --data; BFCL has its own split (--split-rule)")
    if args.data:
        _input_file(args.data, "--data")
    if args.stats:
        stats = Path(args.stats)
        if stats.is_dir():
            if not (stats / STATS_FILE).is_file():
                raise UsageError(
                    f"--stats {args.stats}: the directory holds no {STATS_FILE} (give a statistics file, or a policy "
                    "directory calibrated with statistics)"
                )
        else:
            _input_file(args.stats, "--stats")
    _output_dir(args.out, "--out")
    if args.checkpoint:
        _output_dir(args.checkpoint, "--checkpoint")


def _check_niah(args: argparse.Namespace) -> None:
    for entry in args.policy or []:
        label, _, path = entry.rpartition("=")
        if path and label != "pask":  # a malformed entry: niah.parse_policies names the form, before any loading
            _policy_dir(path, f"--policy {entry}")
    if args.method_config:
        _input_file(args.method_config, "--method-config")
    _output_file(args.out, "--out")


FRONT_DOORS = {
    "run": _check_run,
    "compare": _check_compare,
    "bfcl": _check_bfcl,
    "calibrate": _check_calibrate,
    "niah": _check_niah,
}  # bench passes its flags through to each benchmark's own parser


def check_args(args: argparse.Namespace) -> None:
    """The front door: UsageError for an argument a subcommand cannot run with, before anything loads."""
    check = FRONT_DOORS.get(args.command)
    if check is not None:
        check(args)


def _llm_options(args: argparse.Namespace) -> dict:
    """LLM's method, budget, policy and hyper-parameters; a labelled variant takes its method config section."""
    from pask_jax.evaluate import resolve_spec
    from pask_jax.methods import load_method_config

    method, overrides = args.method.partition(":")[0], None
    if ":" in args.method or args.method_config:
        # a ValueError (an unknown label, a bad config file): main reports it, `pask-jax run: error: ...`, status 2
        _, overrides, _ = resolve_spec(args.method, load_method_config(args.method_config), {})
    policy = None if args.policy in (None, "none") else args.policy
    return dict(
        method=method, budget=args.budget, policy=policy if method == "pask" else None, method_overrides=overrides
    )


def cmd_run(args: argparse.Namespace) -> int:
    """OpenAI Batch lines -> chat.completion lines, resumable by custom_id; exit status 1 if any line failed.

    Several processes (`jax.distributed.initialize()` from the environment: JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES,
    JAX_PROCESS_ID, or PASK_DISTRIBUTED=1 on a Cloud TPU slice): process p of n answers the input lines whose 0-based
    index mod n is p, into its own file `<output>.<p>-of-<n>` (see `pask_jax.batch`), each on a `--mesh` of its own
    devices."""
    import jax

    from pask_jax.batch import run_batch
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
            **options,
        )

    summary = run_batch(build, args.input, args.output, process=jax.process_index(), processes=jax.process_count())
    print(summary.line(), file=sys.stderr)
    return 1 if summary.failed or summary.failed_before else 0


def cmd_compare(args: argparse.Namespace) -> None:
    """Side by side: the answers of several `pask-jax run` outputs to one input, with kept/full KV and schema checks."""
    from pask_jax.compare import compare_outputs, format_comparison

    print(format_comparison(compare_outputs(args.input, args.outputs)))


def cmd_bfcl(args: argparse.Namespace) -> None:
    """Grammar-constrained BFCL evaluation; prints a table and writes the full JSON."""
    from pask_jax import load_model, load_tokenizer
    from pask_jax.evaluate import EvalConfig, format_table, resolve_spec, run_bfcl

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
    for spec in cfg.methods:  # an unknown NAME:LABEL: before the model loads
        resolve_spec(spec, method_config, policies)
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
    """Calibration statistics (on a user's requests `--data`, the BFCL calibration split, or `--stats` from an earlier
    run) -> a compiled policy carrying them (`stats.json`), so it answers any budget; for `--data`, the dev part's
    requests beside it (`dev.jsonl`, `split.json`)."""
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
    from pask_jax.calibration.run import (
        DEFAULT_LEVELS,
        CalibrationStats,
        calibrate,
        calibrate_requests,
        calibration_items,
    )
    from pask_jax.llm import LLM
    from pask_jax.models.sharding import init_distributed
    from pask_jax.policy import STATS_FILE

    budgets = [float(b) for b in args.budgets.split(",")]  # flags checked by the front door (`_check_calibrate`)
    fraction = DEFAULT_DEV_FRACTION if args.dev_fraction is None else args.dev_fraction
    split = split_requests(read_requests(args.data), fraction) if args.data else None  # bad lines: before any loading
    init_distributed()  # multi-host pods: env-driven, a no-op on one machine
    llm = LLM(args.model, method="full")  # config, tokenizer, chat template and fingerprint; weights on first use
    options = dict(
        groups=args.groups,
        levels=[float(x) for x in args.levels.split(",")] if args.levels else DEFAULT_LEVELS,
        checkpoint_dir=args.checkpoint,
        max_items=args.max_items,
    )
    if args.stats:
        source = Path(args.stats)
        stats = CalibrationStats.load(source / STATS_FILE if source.is_dir() else source)
    elif split is not None:
        prepared = prepare_requests(llm.builder, split.calibration, args.data)  # bad requests: before the weights
        stats = calibrate_requests(llm.model, llm.tokenizer, prepared, data=data_digest(split.calibration), **options)
    else:
        rule = args.split_rule or SPLIT_RULE
        items = calibration_items(8 if args.per_category is None else args.per_category, rule=rule)
        stats = calibrate(llm.model, llm.tokenizer, items, target=args.target or "own", rule=rule, **options)
    if stats.n_items == 0:
        reasons = sorted(set(stats.skipped.values()))[:3]
        raise ValueError(f"no item was calibrated ({len(stats.skipped)} skipped: {reasons}); no policy written")
    ran_with = {k: v for k, v in vars(args).items() if k not in ("command", "func") and v is not None}  # the record
    policy = compile_policy(
        stats,
        budgets,
        tolerance=args.tolerance,
        floor_share=args.floor_share,
        ablation=args.ablation,
        fits=llm.fingerprint,
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


def cmd_bench(args: argparse.Namespace) -> None:
    """`pask-jax bench serving|decode|kernel ...`: the benchmarks in `pask_jax.bench`, each with its own flags."""
    from pask_jax.bench import main as bench_main

    bench_main(args.args)


def cmd_niah(args: argparse.Namespace) -> None:
    """Needle-in-a-haystack retrieval per (method, budget, length, depth, haystack, mode): a table and a resumable
    results JSON (`scripts/plot_niah.py` draws it)."""
    from pask_jax import niah

    policy_paths = niah.parse_policies(args.policy or [])
    methods = niah.parse_names(args.methods, "methods")
    methods += tuple(spec for spec in (f"pask:{label}" for label in policy_paths) if spec not in methods)
    cfg = niah.NiahConfig(
        methods=methods,
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
    from pask_jax.methods import load_method_config
    from pask_jax.models.chat_template import load_chat_template
    from pask_jax.models.fetch import resolve_model_path
    from pask_jax.models.loading import load_config, load_model
    from pask_jax.models.tokenizer import load_tokenizer_from_path
    from pask_jax.policy import ModelFingerprint, PersistencePolicy
    from pask_jax.requests import RequestBuilder

    policies = {label: PersistencePolicy.load(path) for label, path in policy_paths.items()}
    method_config = load_method_config(args.method_config)
    path = resolve_model_path(args.model)
    tokenizer = load_tokenizer_from_path(path)
    niah.check_methods(cfg, method_config, policies, ModelFingerprint.of(load_config(args.model), tokenizer))
    template = load_chat_template(path)
    if template is None:
        raise niah.NiahError(f"{args.model} ships no chat template, which the prompts are rendered with")
    out = Path(args.out)
    niah.read_results(out, niah.run_config(cfg, args.model, template.name, method_config, policies))
    prompts = niah.build_prompts(RequestBuilder(tokenizer, template), cfg)  # tokens only: no model yet
    enable_compile_cache()
    result = niah.run_niah(
        load_model(args.model),
        tokenizer,
        prompts,
        cfg,
        model_name=args.model,
        template_name=template.name,
        method_config=method_config,
        policies=policies,
        out=out,
    )
    print(niah.format_table(result))
    print(f"wrote {out}", file=sys.stderr)


def enable_compile_cache() -> None:
    """Keep XLA executables in `$PASK_JAX_CACHE/xla`: later runs (a sweep in chunks, ablations) skip the compiles
    of shapes an earlier run already built. A 24-layer decode step takes ~7 s to compile on 2 CPU cores.
    `PASK_JAX_XLA_CACHE=off` keeps executables in memory only (the test suite runs so)."""
    import jax

    if os.environ.get("PASK_JAX_XLA_CACHE", "").lower() == "off":
        return

    from pask_jax.models.fetch import cache_dir

    jax.config.update("jax_compilation_cache_dir", str(cache_dir() / "xla"))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 1.0)


def main(argv: list[str] | None = None) -> None:
    from pask_jax.calibration.compiler import ABLATIONS

    parser = _Parser(prog="pask-jax", description=__doc__)
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
        type=_method_spec,
        help=f"{', '.join(METHOD_NAMES)}, or NAME:LABEL, a labelled variant of the method config "
        "(e.g. pask:dapq_tier_request, the long-prompt dev choice)",
    )
    p.add_argument("--method-config", help="TOML of method hyper-parameters (default: configs/methods.toml)")
    p.add_argument("--budget", type=_budget, default=0.33, help="total KV budget in (0, 1] (full KV: 1)")
    p.add_argument(
        "--policy", default="auto", help="PASK policy: auto (the shipped one that fits the model), a directory, none"
    )
    p.add_argument(
        "--max-batch", type=_int_at_least(1), default=8, help="cache rows (continuous) or rows per micro-batch (static)"
    )
    p.add_argument(
        "--kv-memory-mb",
        type=_positive,
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
        type=_int_at_least(1),
        help="continuous: rows prefilled together at most (default: all admitted; 1 wastes no padding on CPU)",
    )
    p.add_argument(
        "--dtype",
        default="auto",
        choices=("auto", "float32", "bfloat16"),
        help="weights, activations and KV cache (auto: bfloat16 on TPU / GPU, float32 on CPU)",
    )
    p.add_argument("--mesh", help="DATAxMODEL mesh of this process's devices, e.g. 8x1 or 4x2 (default: one device)")
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
    p.add_argument("--budget", default="1.0", type=_budget_list, help="total KV budget(s) in (0, 1], comma-separated")
    p.add_argument("--categories", default="all", help="'all' or comma-separated BFCL categories")
    p.add_argument("--offset", type=_int_at_least(0), default=0, help="first item of each category (of the split)")
    p.add_argument("--limit", type=_int_at_least(1), default=25, help="items per category")
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
    p.add_argument("--batch-size", type=_int_at_least(1), default=8)
    p.add_argument("--max-new-tokens", type=_int_at_least(1), default=256)
    p.add_argument("--framing", default="tool_call", choices=["tool_call", "json_fence"])
    p.add_argument(
        "--context",
        type=_int_at_least(0),
        default=0,
        help="> 0: long prompts of at most this many tokens, each item's tools among distractor tools, every tool "
        "in the grammar",
    )
    p.add_argument("--layout", default="question_last", choices=["question_last", "question_first"])
    p.add_argument(
        "--length-buckets",
        type=_int_list,
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
    p = sub.add_parser(
        "calibrate", help="calibrate PASK on your requests (--data) or the BFCL calibration split; compile a policy"
    )
    p.add_argument("--model", default=DEFAULT_MODEL, help="registered name, .gguf file or HF checkpoint directory")
    p.add_argument(
        "--data",
        help="OpenAI Batch input lines (as `pask-jax run` reads) to calibrate on instead of BFCL; split by tool set "
        "into a calibration part and a dev part (written beside the policy as dev.jsonl)",
    )
    p.add_argument(
        "--dev-fraction",
        type=_float_in(0.0, 1.0, open_high=True),
        help="(--data) share of the requests held out as the dev part (default 0.2)",
    )
    p.add_argument(
        "--budgets", default="0.2,0.33,0.5", type=_budget_list, help="budgets compiled into the policy (others on load)"
    )
    p.add_argument("--per-category", type=_int_at_least(1), help="(BFCL) calibration items per category (default 8)")
    p.add_argument("--split-rule", choices=SPLIT_RULES, help=f"(BFCL) which calibration part (default {SPLIT_RULE})")
    p.add_argument("--groups", type=_int_at_least(1), default=4, help="layer groups")
    p.add_argument(
        "--levels", type=_levels, help="comma-separated keep levels per bucket, 0 included (default: DEFAULT_LEVELS)"
    )
    p.add_argument(
        "--target",
        choices=("own", "canonical"),
        help="(BFCL) teacher-forced call: the model's own full-KV call (default; always for --data), or the rendered "
        "ground truth",
    )
    p.add_argument("--tolerance", type=_float_in(0.0), default=0.02, help="task-error increase a floor may allow")
    p.add_argument("--checkpoint", help="orbax progress directory (rerun to resume)")
    p.add_argument(
        "--max-items", type=_int_at_least(1), help="calibrate at most this many items now (rerun with --checkpoint)"
    )
    p.add_argument(
        "--floor-share",
        type=_float_in(0.0, 1.0),
        default=1.0,
        help="fraction of a layer group's share its floors may take",
    )
    p.add_argument("--stats", help="compile saved statistics (a stats.json, or a policy directory holding one) instead")
    p.add_argument("--ablation", default="none", choices=ABLATIONS, help="compile an ablated policy")
    p.add_argument("--out", required=True, help="policy directory, e.g. policies/my-model")
    p.set_defaults(func=cmd_calibrate)
    p = sub.add_parser("niah", help="needle-in-a-haystack retrieval for every method at the same KV budgets")
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument(
        "--methods",
        default="full,dapq,snapkv,pyramidkv,h2o,streamingllm,pask",
        help="comma-separated method specs (pask: uncalibrated); each --policy adds pask:LABEL",
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
    p.add_argument(
        "--policy",
        action="append",
        help="[LABEL=]PATH: a compiled PASK policy, run as method pask:LABEL (default label: calibrated); repeatable",
    )
    p.add_argument("--method-config", help="TOML of method hyper-parameters (default: configs/methods.toml)")
    p.add_argument("--out", required=True, help="results JSON; an existing one is resumed (only missing cells run)")
    p.set_defaults(func=cmd_niah)
    # prefix "+": every "--flag" after `bench` is passed through to the script's own parser (`pask-jax bench --help`)
    p = sub.add_parser("bench", help="benchmarks: serving | decode | kernel", prefix_chars="+", add_help=False)
    p.add_argument("args", nargs=argparse.REMAINDER, help="a benchmark and its flags (`pask-jax bench serving --help`)")
    p.set_defaults(func=cmd_bench)
    args = parser.parse_args(argv)
    try:
        check_args(args)  # the front door: bad paths and settings end here, before anything loads
        if args.command in ("run", "bfcl", "calibrate"):
            enable_compile_cache()
        status = args.func(args)
    except (FetchError, ValueError, ModuleNotFoundError) as e:
        parser.exit(2, f"pask-jax {args.command}: error: {e}\n")
    sys.exit(status or 0)


if __name__ == "__main__":
    main()
