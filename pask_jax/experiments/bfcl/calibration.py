"""PASK calibration on BFCL's calibration part: items -> examples (BFCL's prompt, the model's own call or the
rendered ground truth as the gold) -> the library's calibration loop (`pask_jax.calibration.run`).

Targets (`target=`): "own" (default) teacher-forces the model's own greedy, grammar-constrained call at full KV;
"canonical" uses BFCL's rendered ground truth, which a small model rarely reproduces token for token (the 0.5B model:
2 of 8 items), leaving most items without a task-error signal.

Regimes (`contexts=`, `layouts=`): each item is calibrated once per (context, layout). Context 0 is BFCL's own prompt
(the item's functions only); a context N > 0 is a long prompt of at most N tokens whose tools list is filled with
distractor functions of the calibration part only (`item_prompt`, seeded by the item id), so the floors
measured there see many tools and a long prompt; the layout puts the question after the tools list (BFCL's own) or
before it, in the system message. The example's id is `prompt_id(item, context, layout)`.

    pask-jax calibrate --model qwen2.5-coder-0.5b --per-category 8 --checkpoint ckpt/calib --out policies/my-0.5b
    pask-jax calibrate ... --contexts 0,2048 --layouts question_last,question_first   # 4 prompts per item
"""

from __future__ import annotations

import functools
import json
from collections.abc import Sequence

import numpy as np

from pask_jax.arguments import PROTOCOL_GRAMMAR_BACKEND
from pask_jax.calibration.run import Example, calibrate_examples, example_from_prepared, own_call
from pask_jax.experiments.bfcl import (
    CATEGORIES,
    SPLIT_RULE,
    canonical_calls,
    is_calibration,
    load_answers,
    split_items,
)
from pask_jax.experiments.bfcl.long_context import LAYOUTS, item_prompt, prompt_id
from pask_jax.experiments.bfcl.prompt import format_tool_call, prepare_tool_prompt
from pask_jax.models.decoder import Decoder
from pask_jax.policy_compiler import CalibrationStats
from pask_jax.requests import RequestBuilder
from pask_jax.runtime.engine import Engine

TARGETS = ("own", "canonical")


def calibration_items(
    per_category: int = 8, categories: Sequence[str] = CATEGORIES, rule: str = SPLIT_RULE
) -> list[tuple[dict, dict]]:
    """The first `per_category` calibration-part items of each category, in file order, with their answers."""
    out = []
    for category in categories:
        answers = load_answers(category)
        out += [(item, answers[item["id"]]) for item in split_items(category, rule).calibration[:per_category]]
    return out


def _schema_order(value, spec):
    """Dict keys in the order the schema declares them (the grammar's order), recursively through objects / arrays."""
    if isinstance(value, dict) and isinstance(spec, dict) and isinstance(spec.get("properties"), dict):
        keys = list(spec["properties"])
        ordered = sorted(value, key=lambda k: keys.index(k) if k in keys else len(keys))
        return {k: _schema_order(value[k], spec["properties"].get(k)) for k in ordered}
    if isinstance(value, list) and isinstance(spec, dict) and isinstance(spec.get("items"), dict):
        return [_schema_order(v, spec["items"]) for v in value]
    return value


def gold_text(item: dict, answer: dict, ensure_ascii: bool = True) -> str:
    """The canonical gold calls as the model emits them, then the end of turn (arguments in schema order).

    ``format_tool_call`` writes non-ASCII as ``\\uXXXX`` (``json.dumps`` defaults, as BFCL's handler); the grammar
    spells enum values in raw UTF-8, so `prepare_example` retries with ``ensure_ascii=False`` when it refuses a gold.
    """
    schemas = {f["name"]: f["parameters"] for f in item["function"]}
    calls = []
    for name, args in canonical_calls(answer, item["function"]):
        args = _schema_order(args, schemas.get(name))
        raw = f'<tool_call>\n{{"name": "{name}", "arguments": {json.dumps(args, ensure_ascii=False)}}}\n</tool_call>'
        calls.append(format_tool_call(name, args) if ensure_ascii else raw)
    return "\n".join(calls) + "<|im_end|>"


def prepare_example(
    item: dict,
    answer: dict | None,
    tokenizer,
    vocab_size: int,
    gold=None,
    engine: Engine | None = None,
    context: int = 0,
    layout: str = "question_last",
) -> Example:
    """A BFCL item as BFCL prompts it (context 0, question last) or in a long prompt of at most `context` tokens
    among calibration-part distractors, question in `layout`: tokenise prompt and gold, label prompt roles, walk the
    grammar over the gold (ValueError if it refuses it).

    The gold: `gold` token ids if given; else the model's own call (`own_call`) when an `engine` is given; else the
    canonical rendering of the ground truth `answer`."""
    messages, tools = item_prompt(item, tokenizer, context, layout, "calibration")
    prepared = prepare_tool_prompt(
        RequestBuilder(tokenizer, None, grammar_backend=PROTOCOL_GRAMMAR_BACKEND), messages, tools
    )
    if gold is not None:
        renderings = [gold]
    elif engine is not None:
        renderings = [own_call(engine, np.asarray(prepared.ids, np.int32), prepared.grammar)]
    else:
        renderings = [tokenizer.encode(gold_text(item, answer, ensure_ascii)) for ensure_ascii in (True, False)]
    return example_from_prepared(prompt_id(item["id"], context, layout), prepared, renderings, tokenizer, vocab_size)


def calibrate(
    model: Decoder,
    tokenizer,
    items_with_answers: Sequence[tuple[dict, dict]],
    *,
    target: str = "own",
    rule: str = SPLIT_RULE,
    contexts: Sequence[int] = (0,),
    layouts: Sequence[str] = ("question_last",),
    **options,
) -> CalibrationStats:
    """Calibrate on BFCL (item, answer) pairs from the calibration part of split `rule` (`calibration_items`; a dev
    or evaluation item is refused), each in every (context, layout) regime, against `target` "own" (the model's own
    full-KV call; prompts where it does not finish are skipped) or "canonical" (the rendered ground truth). Options as
    `calibrate_examples`: groups=4, levels=DEFAULT_LEVELS, checkpoint_dir=None, max_items=None (prompts), batch=32,
    save_every=4, progress=True."""
    if target not in TARGETS:
        raise ValueError(f"target={target!r}: choose one of {', '.join(TARGETS)}")
    if not contexts or any(c < 0 for c in contexts) or not layouts or set(layouts) - set(LAYOUTS):
        raise ValueError(f"contexts={list(contexts)} (tokens, >= 0) and layouts={list(layouts)} (of {LAYOUTS})")
    leaked = [it["id"] for it, _ in items_with_answers if not is_calibration(it["id"], rule)]
    if leaked:
        raise ValueError(f"dev and evaluation items must never be calibrated on (split rule {rule!r}): {leaked[:5]}")
    vocab = model.config.vocab_size
    engine = Engine(model, stop_token_ids=tokenizer.eos_token_ids) if target == "own" else None
    examples = [
        (
            prompt_id(it["id"], context, layout),
            functools.partial(prepare_example, it, a, tokenizer, vocab, engine=engine, context=context, layout=layout),
        )
        for it, a in items_with_answers
        for context in contexts
        for layout in layouts
    ]
    return calibrate_examples(model, examples, target=target, **options)
