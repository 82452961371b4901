"""Run BFCL through the engine: grammar-constrained generation per (method, budget, category), scored by BFCL.

    pask-jax bfcl --model qwen2.5-coder-0.5b --methods full --budget 1.0 --categories all --limit 25 --out r.json

Items come from the evaluation part of the fixed split (`bfcl.evaluation_sample`). `split="dev"` scores dev items
instead (`bfcl.dev_sample`), for tuning a method without looking at evaluation items; its scores are never reported as
results. A policy calibrated on items outside the calibration part of the run's split rule is refused.
Each batch gets one compiled grammar per item (its own functions), the prompt roles of its tokens, and the engine's
per-request statistics (kept/full KV ratios, token counts, times).

`context=N` turns each item into a long prompt of at most N tokens (`bfcl.long_context`): its tools list filled
with distractor functions of its own split, the question after (`layout="question_last"`) or before
(`"question_first"`) the tools, and the grammar allowing every tool in the prompt, as a user's request would. The time
to build the prompts and compile their grammars is recorded per category (`prepare_s`).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import jax
import numpy as np
from tqdm.auto import tqdm

from pask_jax.arguments import PROTOCOL_GRAMMAR_BACKEND
from pask_jax.experiments import bfcl
from pask_jax.experiments.bench.machine import write_json
from pask_jax.experiments.bfcl.long_context import LAYOUTS, item_of_prompt, item_prompt
from pask_jax.experiments.bfcl.prompt import PROMPTS, prepare_bfcl, prepare_tool_prompt
from pask_jax.experiments.sweep import generate_shared
from pask_jax.factory import make_engine, resolve_spec
from pask_jax.models.chat_template import ChatTemplate
from pask_jax.models.decoder import Decoder
from pask_jax.models.tokenizer import Tokenizer
from pask_jax.policy import ModelFingerprint, PersistencePolicy
from pask_jax.requests import PreparedRequest, RequestBuilder
from pask_jax.runtime.engine import Engine
from pask_jax.runtime.sampling import SamplingConfig
from pask_jax.runtime.shapes import DEFAULT_LENGTH_BUCKETS
from pask_jax.structure.backend import grammar_constraint


@dataclasses.dataclass(frozen=True)
class EvalConfig:
    methods: tuple[str, ...] = ("full",)
    budgets: tuple[float, ...] = (1.0,)
    categories: tuple[str, ...] = bfcl.CATEGORIES
    offset: int = 0
    limit: int = 25
    batch_size: int = 8
    max_new_tokens: int = 256
    framing: str = "tool_call"
    grammar_backend: str = PROTOCOL_GRAMMAR_BACKEND  # ours: the grammar every committed BFCL number was decoded under
    prompt: str = "bfcl"  # or "bfcl_parallel" / "template" (`prompt.PROMPTS`): the parallel-call framings
    num_groups: int = 4
    split: str = "evaluation"  # or "dev": dev items, for tuning
    split_rule: str = bfcl.SPLIT_RULE  # "item-hash" reproduces results scored under the earlier per-item split
    context: int = 0  # > 0: long prompts of at most this many tokens, every tool in the grammar
    layout: str = "question_last"  # long prompts: the question after the tools list, or "question_first"
    length_buckets: tuple[int, ...] = DEFAULT_LENGTH_BUCKETS  # prompt lengths prefill pads to (fewer: fewer compiles)

    def __post_init__(self) -> None:
        if self.split not in bfcl.SPLITS:
            raise ValueError(f"split={self.split!r}; choose one of {', '.join(bfcl.SPLITS)}")
        if self.split_rule not in bfcl.SPLIT_RULES:
            raise ValueError(f"split_rule={self.split_rule!r}; choose one of {', '.join(bfcl.SPLIT_RULES)}")
        if self.context < 0 or self.layout not in LAYOUTS:
            raise ValueError(f"context={self.context} must be >= 0 and layout={self.layout!r} one of {LAYOUTS}")
        if self.prompt not in PROMPTS or (self.prompt != "bfcl" and self.context):
            raise ValueError(f"prompt={self.prompt!r}: one of {', '.join(PROMPTS)}; long prompts use 'bfcl'")
        if self.prompt == "template" and self.framing != "tool_call":
            raise ValueError(f"prompt 'template' writes the template's own calls, not framing {self.framing!r}")

    def sample(self, category: str) -> list[dict]:
        return bfcl.split_sample(self.split, category, self.offset, self.limit, rule=self.split_rule)


def _item_result(item: dict, answer: dict, gen, tokenizer: Tokenizer, cfg: EvalConfig) -> dict:
    text = tokenizer.decode(gen.tokens)
    dev = cfg.split == "dev"  # item-hash dev items are calibration items: scored for tuning only
    valid, error_type, _ = bfcl.score_text(item, answer, text, allow_calibration=dev, rule=cfg.split_rule)
    return {
        "id": item["id"],
        "text": text,
        "valid": bool(valid),
        "parsed": error_type != "ast_decoder:decoder_failed",
        "error_type": error_type,
        "kept_ratio_mean": gen.stats.kept_ratio_mean,
        "kept_ratio_max": gen.stats.kept_ratio_max,
        "kv_bytes_ratio_mean": gen.stats.kv_bytes_ratio_mean,
        "kv_bytes_ratio_max": gen.stats.kv_bytes_ratio_max,
        "prompt_tokens": gen.stats.prompt_tokens,
        "generated_tokens": gen.stats.generated_tokens,
        "finish_reason": gen.finish_reason,
        "ttft_s": round(gen.stats.ttft_s, 3),
        "decode_s": round(sum(gen.stats.token_times_s), 3),
    }


def item_stats(items: list[dict]) -> dict:
    """Counts, accuracy, parse rate and kept/full KV ratios (entries; bytes where every item records them: files
    scored before the budget counted bytes do not) over scored items (a category run, or merged runs)."""
    n = max(len(items), 1)
    byte_ratios = {}
    if items and all("kv_bytes_ratio_mean" in r for r in items):
        byte_ratios = {
            "kv_bytes_ratio_mean": float(np.mean([r["kv_bytes_ratio_mean"] for r in items])),
            "kv_bytes_ratio_max": float(np.max([r["kv_bytes_ratio_max"] for r in items])),
        }
    return {
        "n": len(items),
        "correct": sum(r["valid"] for r in items),
        "accuracy": sum(r["valid"] for r in items) / n,
        "parsed_fraction": sum(r["parsed"] for r in items) / n,
        "kept_ratio_mean": float(np.mean([r["kept_ratio_mean"] for r in items])) if items else 1.0,
        "kept_ratio_max": float(np.max([r["kept_ratio_max"] for r in items])) if items else 1.0,
    } | byte_ratios


def _category_run(items: list[dict], parser_s: float, decode_s: float, steps: int) -> dict:
    return item_stats(items) | {
        "parser_seconds_per_step_fraction": parser_s / max(decode_s + parser_s, 1e-9),
        "decode_steps": steps,
        "items": items,
    }


def _prepare(item: dict, builder: RequestBuilder, cfg: EvalConfig) -> PreparedRequest:
    if not cfg.context:
        return prepare_bfcl(builder, item, max_tokens=cfg.max_new_tokens, framing=cfg.framing, prompt=cfg.prompt)
    messages, tools = item_prompt(item, builder.tokenizer, cfg.context, cfg.layout, cfg.split)
    return prepare_tool_prompt(builder, messages, tools, max_tokens=cfg.max_new_tokens, framing=cfg.framing)


def run_key(method: str, budget: float) -> str:
    """How a results file names a (method spec, budget) run."""
    return f"{method}@{budget:g}"


def run_category(
    engines: dict[tuple[str, float], Engine],
    builder: RequestBuilder,
    category: str,
    items: list[dict],  # the category's sample (`cfg.sample(category)`)
    cfg: EvalConfig,
    progress: tqdm | None = None,
    *,
    partial: dict | None = None,
    on_batch: Callable[[], None] | None = None,
) -> list[dict]:
    """One category through every engine; each batch's grammars, prompt roles and prefill are shared by all.

    `partial` holds the category's finished batches (`{"items": {run_key: {id: item}}, "timing": {run_key: [...]}}`):
    a batch whose items it has for every engine is skipped, every new batch is added to it, then `on_batch` runs
    (a results file saved after every batch resumes where it stopped)."""
    answers = bfcl.load_answers(category)
    start_prepare = time.perf_counter()
    prepared = [_prepare(item, builder, cfg) for item in items]
    prepare_s = time.perf_counter() - start_prepare
    order = np.argsort([len(p.ids) for p in prepared], kind="stable")  # similar lengths share a batch: less padding
    partial = partial if partial is not None else {}
    done = partial.setdefault("items", {})
    timing = partial.setdefault("timing", {})  # per run: parser s, decode s, steps, wall s
    for key in engines:
        done.setdefault(run_key(*key), {})
        timing.setdefault(run_key(*key), [0.0, 0.0, 0, 0.0])
    for start in range(0, len(items), cfg.batch_size):
        idx = [int(i) for i in order[start : start + cfg.batch_size]]
        if all(items[i]["id"] in done[run_key(*key)] for key in engines for i in idx):
            continue
        batch = [prepared[i] for i in idx]
        grammars = [p.grammar for p in batch]
        constraints = [grammar_constraint(grammars, engine.cfg.vocab_size) for engine in engines.values()]
        outputs = generate_shared(
            list(engines.values()),
            [p.ids for p in batch],
            SamplingConfig(max_new_tokens=cfg.max_new_tokens),
            prompt_roles=[p.roles for p in batch],
            prompt_tools=[p.tools for p in batch],
            constraints=constraints,
        )
        for key, gens, constraint in zip(engines, outputs, constraints, strict=True):
            t = timing[run_key(*key)]
            t[0] += constraint.mask_s + constraint.advance_s
            for k, i in enumerate(idx):
                item = _item_result(items[i], answers[items[i]["id"]], gens[k], builder.tokenizer, cfg)
                done[run_key(*key)][item["id"]] = item
                t[1] += sum(gens[k].stats.token_times_s)
                t[2] += len(gens[k].stats.token_times_s)
            # the shared prefill plus this engine's decode steps (the longest sequence saw every step)
            t[3] += gens[0].stats.ttft_s + max(sum(g.stats.token_times_s) for g in gens)
        if progress is not None:
            progress.update(len(idx) * len(engines))
        if on_batch is not None:
            on_batch()
    runs = []
    for method, budget in engines:
        key = run_key(method, budget)
        parser_s, decode_s, steps, wall_s = timing[key]
        scored = [done[key][item["id"]] for item in items]
        runs.append(
            {"method": method, "budget": budget, "category": category, "wall_s": round(wall_s, 1)}
            | {"prepare_s": round(prepare_s, 2)}
            | _category_run(scored, parser_s, decode_s, int(steps))
        )
    return runs


def build_engines(
    model: Decoder,
    tokenizer: Tokenizer,
    cfg: EvalConfig,
    method_config: dict[str, dict],
    policies: dict[str, PersistencePolicy],
) -> dict[tuple[str, float], Engine]:
    """One engine per (method spec, budget). A spec is a method name or `NAME:LABEL`, a labelled variant: its own
    config section `["NAME:LABEL"]` (e.g. `["snapkv:w8"]`, for hyper-parameter sweeps side by side) and, for PASK,
    the policy labelled LABEL if one is given (ablations), else the one labelled "pask" (online hyper-parameter
    variants under the same policy). Without a policy PASK runs uncalibrated. Hyper-parameters: the method's config
    section, then the spec's own section."""
    engines = {}
    for spec in cfg.methods:
        method = resolve_spec(spec, method_config, policies)
        for budget in cfg.budgets if method.name != "full" else (1.0,):  # full KV ignores the budget: run it once
            engines[(spec, budget)] = make_engine(
                model,
                method.method,
                budget,
                policy=method.policy,
                overrides=method.overrides,
                num_groups=None if method.policy is not None else cfg.num_groups,
                stop_token_ids=tokenizer.eos_token_ids,
                length_buckets=cfg.length_buckets,
            )
    return engines


def used_sections(method_config: dict[str, dict], methods) -> dict[str, dict]:
    """The sections of `method_config` that the method specs `methods` read (`NAME:LABEL`, `NAME`; any `@STORAGE`
    aside): a section no run reads does not change a result."""
    names = {spec.partition("@")[0] for spec in methods}
    return {k: v for k, v in method_config.items() if k in names or k in {n.partition(":")[0] for n in names}}


def run_config(cfg: EvalConfig, method_config: dict[str, dict], policies: dict[str, PersistencePolicy]) -> dict:
    """The `config` a results file records (the run's settings, the method configs its methods read, and policies),
    as JSON has it."""
    config = dataclasses.asdict(cfg) | {"method_config": used_sections(method_config, cfg.methods)}
    config["policies"] = {
        label: {"model": p.model, "groups": p.groups, "budgets": [t.budget for t in p.tables], "notes": p.notes}
        | {"content_hash": p.content_hash()}
        for label, p in policies.items()
    }
    return json.loads(json.dumps(config))


def read_results(path: Path | None, model_name: str, config: dict) -> tuple[list[dict], dict | None]:
    """The finished runs and the category under way (`partial`) in `path`, none if it does not exist; ValueError,
    before any model work, if the file is not a BFCL results file or was made with other settings."""
    if path is None or not path.exists():
        return [], None
    try:
        previous = json.loads(path.read_text())
        old_model, old_config, runs = previous["model"], previous["config"], previous["runs"]
    except (json.JSONDecodeError, KeyError, TypeError) as exc:
        raise ValueError(f"{path} is not a BFCL results file ({exc}); choose another --out") from None
    if isinstance(old_config, dict):  # a file recording every section compares on the ones its methods read
        # (files from before the grammar backend was a setting were decoded under the protocol's)
        old_config = (
            {"grammar_backend": PROTOCOL_GRAMMAR_BACKEND}
            | old_config
            | {"method_config": used_sections(old_config.get("method_config", {}), old_config.get("methods", ()))}
        )
    differ = ["model"] if old_model != model_name else []
    differ += sorted(k for k in set(old_config) | set(config) if old_config.get(k) != config.get(k))
    if differ:
        raise ValueError(f"{path} was made with other settings ({', '.join(differ)} differ): choose another --out")
    return runs, previous.get("partial")


def run_bfcl(
    model: Decoder,
    tokenizer: Tokenizer,
    model_name: str,
    cfg: EvalConfig,
    *,
    method_config: dict[str, dict] | None = None,
    policies: dict[str, PersistencePolicy] | None = None,
    out: Path | None = None,
    chat_template: ChatTemplate | None = None,
) -> dict:
    """Every (method spec, budget) over every category; `policies` (label -> policy) calibrate PASK;
    `chat_template` (the checkpoint's) for ``cfg.prompt == "template"``.

    `out` is rewritten after every batch (the finished categories' runs, and the finished batches of the category
    under way as `partial`) and resumed: given a file made with the same settings, only what it lacks runs."""
    policies = policies or {}
    samples = {category: cfg.sample(category) for category in cfg.categories}
    sample_ids = {item["id"] for items in samples.values() for item in items}
    fingerprint = ModelFingerprint.of(model.config, tokenizer)
    for label, policy in policies.items():
        policy.check_fits(fingerprint)
        calibrated = {item_of_prompt(i) for i in policy.calibration_items}  # an item's long prompts count as it
        outside = sorted(i for i in calibrated if not bfcl.is_calibration(i, cfg.split_rule))
        if outside:
            raise ValueError(
                f"policy {label!r} was calibrated on {', '.join(outside[:3])}, outside the calibration part of split "
                f"rule {cfg.split_rule!r}: recalibrate on that part, or score under the rule it was calibrated for"
            )
        if seen := sorted(sample_ids & calibrated):  # item-hash dev samples can overlap
            raise ValueError(f"policy {label!r} was calibrated on {', '.join(seen[:3])}: pick a dev --offset past them")
    method_config = method_config or {}
    if cfg.prompt == "template" and chat_template is None:
        raise ValueError("prompt 'template' needs the checkpoint's chat template")
    config = run_config(cfg, method_config, policies)
    runs, under_way = read_results(out, model_name, config)
    builder = RequestBuilder(tokenizer, chat_template, grammar_backend=cfg.grammar_backend)
    engines = build_engines(model, tokenizer, cfg, method_config, policies)

    def result(partial: dict | None = None) -> dict:
        summary = summarize_runs(runs)
        return {"model": model_name, "config": config, "runs": runs, "summary": summary} | (
            {"partial": partial} if partial else {}
        )

    def save(partial: dict | None = None) -> None:  # `partial`: the category under way, filled in place per batch
        if out is not None:
            write_json(out, result(partial))

    done = sum(r["n"] for r in runs) + sum(len(scored) for scored in (under_way or {}).get("items", {}).values())
    with tqdm(total=len(sample_ids) * len(engines), initial=done, desc="bfcl", unit="generation") as progress:
        for category, items in samples.items():
            if any(r["category"] == category for r in runs):
                continue
            partial = under_way if under_way and under_way["category"] == category else {"category": category}
            on_batch = functools.partial(save, partial)
            runs += run_category(engines, builder, category, items, cfg, progress, partial=partial, on_batch=on_batch)
            save()
            # Every category brings new length buckets, so new executables for each engine; a sweep that kept them
            # all would exhaust the process's memory maps (vm.max_map_count) on CPU. Repeated shapes come back from
            # the persistent compile cache.
            jax.clear_caches()
    return result()


def summarize_runs(runs: list[dict]) -> list[dict]:
    """Per (method, budget): BFCL's non-live, live and overall means over the categories present."""
    keys = dict.fromkeys((r["method"], r["budget"]) for r in runs)
    summary = []
    for method, budget in keys:
        scores = {r["category"]: (r["correct"], r["n"]) for r in runs if (r["method"], r["budget"]) == (method, budget)}
        summary.append({"method": method, "budget": budget, **bfcl.summarize(scores)})
    return summary


def format_table(result: dict, categories: Sequence[str]) -> str:
    """Accuracy per (method, budget) x category, then the three means, as a Markdown table."""
    head = ["method", "budget", *categories, "non_live", "live", "overall"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for s in result["summary"]:
        accs = {
            r["category"]: r["accuracy"]
            for r in result["runs"]
            if r["method"] == s["method"] and r["budget"] == s["budget"]
        }
        cells = [f"{100 * accs[c]:.0f}" if c in accs else "-" for c in categories]
        means = [f"{100 * s[k]:.1f}" if s.get(k) is not None else "-" for k in ("non_live", "live", "overall")]
        lines.append("| " + " | ".join([s["method"], f"{s['budget']:g}", *cells, *means]) + " |")
    return "\n".join(lines)
