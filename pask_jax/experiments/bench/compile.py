"""Compile time: seconds per step executable (lowering and XLA compile apart), cold and warm XLA cache, and the time
to the first answer from a loaded model.

    pask-jax bench compile [--model qwen2.5-coder-0.5b] [--methods full,snapkv,h2o,dapq,pask] [--budget 0.33]
                           [--prompt-tokens 512,2048] [--batch 1] [--new-tokens 64] [--out results/bench_compile.json]
                           [--shared] [--plans-per-prefill 9] [--method-config TOML] [--policy [LABEL=]VALUE ...]

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
   With --shared, the steps a method sweep compiles (`pask-jax bfcl --methods A,B,...`: `generate_shared`): a
   prefill executable per group of at most --plans-per-prefill methods, then each method's decode step (a method
   whose decode is another's executable is a cache hit), with the total per prompt length.

Methods are specs as the sweeps name them (`NAME` or `NAME:LABEL`): labelled variants from --method-config, PASK's
policies from --policy as `pask-jax bfcl` takes them (LABEL=PATH for `pask:LABEL`; unlabelled: the policy of `pask`
and of the first answer, auto (the shipped one) unless given, none for PASK uncalibrated).

`--model tiny` runs a random 2-layer model (no tokenizer: no first-answer figure), for tests.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import jax

from pask_jax.arguments import AUTO_POLICY, NO_POLICY, PLAIN_PASK, int_at_least, labelled_policies
from pask_jax.experiments.bench.machine import code_state, int_list, machine_info, write_result
from pask_jax.experiments.sweep import PLANS_PER_PREFILL, prefill_groups

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


def _lower_and_compile(lower) -> dict:
    """Seconds of `lower()` and of compiling what it lowered, with the executable's memory analysis."""
    lowered, lower_s = _timed(lower)
    compiled, compile_s = _timed(lowered.compile)
    return {"lower_s": lower_s, "compile_s": compile_s, **memory_mib(compiled)}


def step_times(engine, prompt_tokens: int, batch: int, new_tokens: int) -> dict:
    """Lowering and compile seconds of the prefill and decode executables for one shape (the cache state as it is)."""
    shape = engine.batch_shape([prompt_tokens] * batch, new_tokens)
    hits = _cache_hits[0]
    prefill = _lower_and_compile(lambda: engine.lower_prefill(shape))
    decode = _lower_and_compile(lambda: engine.lower_decode(shape))
    return {
        "prefill": prefill,
        "decode": decode,
        "cache_hits": _cache_hits[0] - hits,
        "shape": {"rows": shape.padded_rows, "prompt_bucket": shape.prompt_bucket, "capacities": shape.capacities},
    }


def sweep_times(engines: dict, prompt_tokens: int, batch: int, new_tokens: int, plans_per_prefill: int) -> dict:
    """What a sweep over `engines` compiles for one shape: a shared prefill per group of at most `plans_per_prefill`
    methods (as `generate_shared` groups them), then each method's decode step. `prefill` sums the groups' figures
    (their memory: the largest group's); `prefill_groups` has each group's."""
    groups = prefill_groups(list(engines.values()), plans_per_prefill)
    shape = groups[0][0].batch_shape([prompt_tokens] * batch, new_tokens)
    start, hits = time.perf_counter(), _cache_hits[0]
    per_group = [
        _lower_and_compile(lambda group=group: group[0].lower_prefill(shape, group[1:])) | {"plans": len(group)}
        for group in groups
    ]
    prefill = {
        key: round((max if key.endswith("_mib") else sum)(g[key] for g in per_group), 3)
        for key in ("lower_s", "compile_s", "temp_mib", "argument_mib", "output_mib")
    }
    decodes = {}
    for spec, engine in engines.items():
        before = _cache_hits[0]
        own = engine.batch_shape([prompt_tokens] * batch, new_tokens)
        decodes[spec] = _lower_and_compile(lambda engine=engine, own=own: engine.lower_decode(own))
        decodes[spec]["cache_hit"] = _cache_hits[0] > before
    return {
        "prefill": prefill,
        "prefill_groups": per_group,
        "decode": decodes,
        "total_s": round(time.perf_counter() - start, 3),
        "cache_hits": _cache_hits[0] - hits,
        "shape": {"rows": shape.padded_rows, "prompt_bucket": shape.prompt_bucket},
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


def load(model: str, methods: list[str], method_config: dict, policies: dict[str, str], budget: float):
    """model, method specs, --policy values by label -> ({spec: engine}, LLM or None, {label: policy hash}); the
    engines share the LLM's loaded weights, and the policies are resolved for the model as `pask-jax run` resolves
    one (the first answer runs plain pask's)."""
    from pask_jax.factory import make_engine, resolve_spec

    def engines(qwen, resolved: dict) -> dict:
        out = {}
        for name in methods:
            spec = resolve_spec(name, method_config, resolved)
            full = spec.name == "full"  # full KV keeps everything: its budget is 1
            out[name] = make_engine(
                qwen, spec.name, 1.0 if full else budget, policy=spec.policy, overrides=dict(spec.overrides)
            )
        return out

    if model == TINY:  # a random model: no shipped policy fits it, so auto runs PASK uncalibrated
        from flax import nnx

        from pask_jax.models.decoder import Decoder, ModelConfig
        from pask_jax.policy import PersistencePolicy

        qwen = Decoder(ModelConfig.tiny("qwen2", vocab_size=256), rngs=nnx.Rngs(0))
        resolved = {k: PersistencePolicy.load(v) for k, v in policies.items() if v not in (AUTO_POLICY, NO_POLICY)}
        return engines(qwen, resolved), None, {k: p.content_hash() for k, p in resolved.items()}
    from pask_jax.checkpoint import Checkpoint
    from pask_jax.experiments.sweep import resolve_policies
    from pask_jax.llm import LLM

    resolved = resolve_policies(policies, Checkpoint.open(model).fingerprint)
    llm = LLM(model, method="pask", budget=budget, policy=resolved.get(PLAIN_PASK))
    return engines(llm.model, resolved), llm, {k: p.content_hash() for k, p in resolved.items()}


def _print_steps(label: str, prompt_tokens: int, cold: dict, warm: dict) -> None:
    decode_cold = cold["decode"]
    if "total_s" in cold:  # a sweep: the decode figures summed over its methods
        decode_cold = {k: sum(d[k] for d in cold["decode"].values()) for k in ("lower_s", "compile_s")}
    print(
        f"{label:>10} P={prompt_tokens:<6} prefill lower {cold['prefill']['lower_s']:6.2f}s compile "
        f"{cold['prefill']['compile_s']:6.2f}s (warm {warm['prefill']['compile_s']:.2f}s) | decode lower "
        f"{decode_cold['lower_s']:6.2f}s compile {decode_cold['compile_s']:6.2f}s",
        flush=True,
    )


def run(args: argparse.Namespace) -> dict:
    cache = Path(tempfile.mkdtemp(prefix="pask-jax-xla-"))
    use_fresh_cache(cache)
    from pask_jax.methods import load_method_config

    method_config = load_method_config(args.method_config)
    engines, llm, hashes = load(args.model, list(args.specs), method_config, args.policies, args.budget)
    result: dict = {
        "benchmark": "compile",
        "model": args.model,
        "budget": args.budget,
        "batch": args.batch,
        "new_tokens": args.new_tokens,
        "shared": args.shared,
        "plans_per_prefill": args.plans_per_prefill if args.shared else None,
        "methods": list(args.specs),
        "method_config": args.method_config,
        "policies": args.policy or [],
        "policy_hashes": hashes,
        "machine": machine_info(),
        "code": code_state(),
        "xla_cache_dir": str(cache),
    }
    if llm is not None and not args.shared:  # a sweep has no first answer; its cache would hold this one's steps
        lines = Path(args.requests).read_text().splitlines()
        request = json.loads(next(line for line in lines if line.strip()))["body"]
        result["first_answer"] = {"request": args.requests, "method": "pask", "budget": args.budget}
        result["first_answer"]["cold"] = first_answer(llm, request)
        jax.clear_caches()
        result["first_answer"]["warm"] = first_answer(llm, request)
    rows = []
    for prompt_tokens in args.prompt_tokens:
        if args.shared:
            cold = sweep_times(engines, prompt_tokens, args.batch, args.new_tokens, args.plans_per_prefill)
            jax.clear_caches()
            warm = sweep_times(engines, prompt_tokens, args.batch, args.new_tokens, args.plans_per_prefill)
            rows.append({"methods": list(engines), "prompt_tokens": prompt_tokens, "cold": cold, "warm": warm})
            _print_steps(f"{len(engines)} methods", prompt_tokens, cold, warm)
            print(f"{'':>10} total cold {cold['total_s']:.1f}s, warm {warm['total_s']:.1f}s", flush=True)
        else:
            for method, engine in engines.items():
                cold = step_times(engine, prompt_tokens, args.batch, args.new_tokens)
                jax.clear_caches()
                warm = step_times(engine, prompt_tokens, args.batch, args.new_tokens)
                rows.append({"method": method, "prompt_tokens": prompt_tokens, "cold": cold, "warm": warm})
                _print_steps(method, prompt_tokens, cold, warm)
        if args.out:  # after every length: a run stopped by a later, larger compile keeps what it measured
            write_result(args.out, result | {"steps": rows})
    result["steps"] = rows
    return result


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pask-jax bench compile", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="qwen2.5-coder-0.5b", help="registered name, checkpoint path, or 'tiny'")
    p.add_argument("--methods", default=",".join(DEFAULT_METHODS), help="comma-separated methods")
    p.add_argument("--budget", type=float, default=0.33, help="KV budget of the compressed methods")
    p.add_argument("--prompt-tokens", type=int_list, default=(512, 2048), help="prompt lengths (comma-separated)")
    p.add_argument("--batch", type=int, default=1, help="prompts per batch")
    p.add_argument("--new-tokens", type=int, default=64, help="new tokens the caches are sized for")
    p.add_argument("--requests", default="examples/requests.jsonl", help="OpenAI Batch lines: the first is answered")
    p.add_argument("--out", help="results JSON")
    p.add_argument("--shared", action="store_true", help="one prefill for all the methods, as a sweep compiles it")
    p.add_argument(
        "--plans-per-prefill",
        type=int_at_least(1),
        default=PLANS_PER_PREFILL,
        help=f"with --shared: methods compiled into one shared prefill (default {PLANS_PER_PREFILL})",
    )
    p.add_argument("--method-config", help="TOML of method variants and overrides, on top of configs/methods.toml")
    p.add_argument(
        "--policy",
        action="append",
        help="plain pask's (and the first answer's) policy: auto (default: the shipped one), a directory, or none "
        "(PASK uncalibrated); LABEL=PATH: the policy of pask:LABEL (repeatable)",
    )
    return p


def main(argv: list[str] | None = None) -> dict:
    parser = build_parser()
    args = parser.parse_args(argv)
    from pask_jax.factory import resolve_spec
    from pask_jax.methods import load_method_config
    from pask_jax.policy import PersistencePolicy

    if args.method_config and not Path(args.method_config).is_file():
        parser.error(f"--method-config {args.method_config}: no such file")
    method_config = load_method_config(args.method_config)
    methods = args.methods.split(",")
    try:
        args.policies = labelled_policies(args.policy or [], [PLAIN_PASK, *methods])  # the first answer runs pask
        # before the model loads: every label, and the budget of every policy given as a directory
        given = {
            k: None if v in (AUTO_POLICY, NO_POLICY) else PersistencePolicy.load(v) for k, v in args.policies.items()
        }
        args.specs = {spec: resolve_spec(spec, method_config, given) for spec in methods}
        for spec in args.specs.values():
            if spec.policy is not None:
                spec.policy.table(args.budget)  # a policy that cannot answer the budget: before the model loads
    except ValueError as error:
        parser.error(str(error))
    if not 0.0 < args.budget <= 1.0:
        parser.error(f"--budget {args.budget} must be in (0, 1]")
    if args.model != TINY and not Path(args.requests).is_file():
        parser.error(f"--requests {args.requests}: no such file")
    return run(args)
