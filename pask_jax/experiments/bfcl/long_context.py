"""Long tool-calling prompts: one BFCL question whose tools list is filled with distractor functions.

Where KV compression matters: most of a long prompt is schema the call does not need, some of it is schema the call
does need. The distractors are other functions of the item's own part (calibration, dev or evaluation,
BFCL-preprocessed, deduplicated by name, so a dev or calibration prompt never shows an evaluation schema), taken in a
seeded order while they fit; the item's own functions sit at a seeded place among them. The prompt is BFCL's fixed Qwen
FC prompt over the whole list, at most `target` tokens.

Layouts (where the question is):
- "question_last": BFCL's own, the question in the last user turn, after the tools list.
- "question_first": the question moves into the system message, before the tools list; the last user turn only
  asks for the call. The end of the prompt then says nothing about which tool or which values.
"""

from __future__ import annotations

import functools
import hashlib
import json

import numpy as np

from pask_jax.experiments import bfcl
from pask_jax.experiments.bfcl.prompt import bfcl_python_functions, format_tool_prompt
from pask_jax.models.tokenizer import Tokenizer

LAYOUTS = ("question_last", "question_first")
QUESTION_FIRST_LEAD = "A user's request, to be answered with one of the tools listed below:\n"
QUESTION_FIRST_ASK = "Make the function call that answers the request stated before the tools list."


@functools.cache
def distractor_pool(tokenizer: Tokenizer, split: str = "evaluation") -> tuple[tuple[dict, int], ...]:
    """Every function of the items of part `split` (one of `bfcl.PARTS`; BFCL-preprocessed, deduplicated by name)
    with its tokens in a prompt."""
    if split not in bfcl.PARTS:
        raise ValueError(f"split {split!r}; choose from {', '.join(bfcl.PARTS)}")
    seen, out = set(), []
    for category in bfcl.CATEGORIES:
        for item in getattr(bfcl.split_items(category), split):
            for function in bfcl_python_functions(item["function"]):
                if function["name"] not in seen:
                    seen.add(function["name"])
                    out.append((function, len(tokenizer.encode("\n" + json.dumps(function)))))
    return tuple(out)


def item_seed(item_id: str, seed: int = 0) -> int:
    """A per-item seed that depends only on the item id and `seed` (stable across runs and processes)."""
    return int.from_bytes(hashlib.sha256(f"{seed}:{item_id}".encode()).digest()[:4], "little")


def question_messages(item: dict, layout: str) -> list[dict]:
    """The item's first turn in `layout`."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout {layout!r}; choose from {', '.join(LAYOUTS)}")
    messages = [dict(m) for m in item["question"][0]]
    if layout == "question_last":
        return messages
    system = [m["content"] for m in messages if m["role"] == "system"]
    asked = "\n".join(m["content"] for m in messages if m["role"] == "user")
    lead = "\n\n".join([*system, QUESTION_FIRST_LEAD + asked])
    return [{"role": "system", "content": lead}, {"role": "user", "content": QUESTION_FIRST_ASK}]


def prompt_id(item_id: str, context: int = 0, layout: str = "question_last") -> str:
    """The id of an item's prompt at `context` tokens (0: BFCL's own prompt) in `layout`: the item id for BFCL's own
    prompt, else ``item_id@context:layout``."""
    return item_id if (context, layout) == (0, "question_last") else f"{item_id}@{context}:{layout}"


def item_of_prompt(prompt: str) -> str:
    """The BFCL item id of a `prompt_id`."""
    return prompt.split("@", 1)[0]


def item_prompt(
    item: dict, tokenizer: Tokenizer, context: int = 0, layout: str = "question_last", split: str = "evaluation"
) -> tuple[list[dict], list[dict]]:
    """(messages, tools) of an item's prompt in `layout`: its own functions at context 0 (BFCL's own prompt with the
    question last), else `long_context_prompt` of at most `context` tokens, seeded by the item id."""
    if context:
        return long_context_prompt(item, tokenizer, context, item_seed(item["id"]), layout, split)
    return question_messages(item, layout), bfcl_python_functions(item["function"])


def long_context_prompt(
    item: dict, tokenizer: Tokenizer, target: int, seed: int, layout: str = "question_last", split: str = "evaluation"
) -> tuple[list[dict], list[dict]]:
    """(messages, tools) of a prompt of at most `target` tokens: the item's question in `layout`, its own functions
    among distractors from `split` (the item's split). `format_tool_prompt(messages, tools)` is the prompt."""
    messages = question_messages(item, layout)
    own = bfcl_python_functions(item["function"])
    names = {f["name"] for f in own}
    rng = np.random.default_rng(seed)
    pool = [p for p in distractor_pool(tokenizer, split) if p[0]["name"] not in names]
    budget = target - len(tokenizer.encode(format_tool_prompt(messages, own)))
    chosen = []
    for i in rng.permutation(len(pool)):
        if pool[i][1] <= budget:
            chosen.append(pool[i][0])
            budget -= pool[i][1]
    at = int(rng.integers(len(chosen) + 1))
    while True:  # the per-function estimate ignores merges across lines: drop distractors until it fits
        tools = chosen[:at] + own + chosen[at:]
        if len(tokenizer.encode(format_tool_prompt(messages, tools))) <= target or not chosen:
            return messages, tools
        chosen.pop()
        at = min(at, len(chosen))
