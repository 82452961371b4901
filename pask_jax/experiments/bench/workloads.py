"""Benchmark prompts: BFCL evaluation prompts, long-context BFCL prompts padded with distractor tools, synthetic ones.

- `bfcl`: the first `pool` evaluation items taken round-robin over the BFCL categories, each prompt with its own
  tools and its own grammar.
- `<N>k` / `<N>` (e.g. `2k`, `512`): long-context prompts where the KV cache dominates (`bfcl.long_context`): one
  BFCL question whose tools list carries distractor functions until the prompt reaches N tokens (at most N, so every
  prompt falls in the N-token length bucket). The grammar allows the item's own functions only: for speed, the
  distractors lengthen the context, not the grammar.
- synthetic (no tokenizer, the random tiny model): random token prompts of the same lengths, no grammar, no roles.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from pask_jax.arguments import PROTOCOL_GRAMMAR_BACKEND
from pask_jax.experiments import bfcl
from pask_jax.experiments.bfcl.long_context import long_context_prompt
from pask_jax.experiments.bfcl.prompt import bfcl_prompt, bfcl_python_functions, format_tool_prompt, prepare_tool_prompt
from pask_jax.models.tokenizer import Tokenizer
from pask_jax.requests import RequestBuilder
from pask_jax.runtime.shapes import length_bucket
from pask_jax.structure import CompiledGrammar
from pask_jax.structure.roles import Role


@dataclasses.dataclass
class Workload:
    """A pool of prompts, longest first; a batch of n takes the first n (cycling), so it always pads to one bucket."""

    name: str
    description: str
    prompts: list[list[int]]
    roles: list[list[int]] | None
    grammars: list[CompiledGrammar] | None
    item_ids: list[str]

    @property
    def prompt_bucket(self) -> int:
        """The length bucket every batch of this workload pads to (the engine's default buckets)."""
        return length_bucket(len(self.prompts[0]))

    def take(self, n: int) -> tuple[list[list[int]], list[list[int]] | None, list[CompiledGrammar] | None]:
        idx = [i % len(self.prompts) for i in range(n)]
        roles = None if self.roles is None else [self.roles[i] for i in idx]
        grammars = None if self.grammars is None else [self.grammars[i] for i in idx]
        return [self.prompts[i] for i in idx], roles, grammars


def workload_tokens(name: str) -> int | None:
    """Target prompt tokens of a workload: bfcl -> None (prompts as they are), 2k -> 2048, 512 -> 512."""
    if name == "bfcl":
        return None
    try:
        return int(name[:-1]) * 1024 if name.endswith("k") else int(name)
    except ValueError:
        raise ValueError(f"workload {name!r}: expected 'bfcl', '<N>k' or '<N>' prompt tokens") from None


def evaluation_items(count: int) -> list[dict]:
    """The first `count` evaluation items taken round-robin over the BFCL categories."""
    per_category = {c: bfcl.evaluation_sample(c, 0, -(-count // len(bfcl.CATEGORIES))) for c in bfcl.CATEGORIES}
    items = []
    for k in range(max(len(v) for v in per_category.values())):
        items += [v[k] for v in per_category.values() if k < len(v)]
    return items[:count]


def category_prompts(tokenizer: Tokenizer, category: str, count: int) -> list[list[int]]:
    """Token ids of the first `count` items of one BFCL category, in the fixed BFCL prompt."""
    items = bfcl.load_category(category)[:count]
    if len(items) < count:
        raise ValueError(f"BFCL category {category!r} has only {len(items)} items, {count} asked for")
    return [tokenizer.encode(bfcl_prompt(item)) for item in items]


def _from_texts(name: str, description: str, tokenizer: Tokenizer, entries: list[tuple[dict, str, list]]) -> Workload:
    """(item, prompt text, tools listed) per prompt -> tokens, prompt roles and the item's own grammar.

    Every prompt is the item's question (`item["question"][0]`) with the listed tools, in BFCL's fixed prompt.
    """
    builder, rows = RequestBuilder(tokenizer, None, grammar_backend=PROTOCOL_GRAMMAR_BACKEND), []
    for item, text, tools in entries:
        own = bfcl_python_functions(item["function"])
        prepared = prepare_tool_prompt(builder, item["question"][0], tools, grammar_functions=own)
        if prepared.text != text:
            raise ValueError(f"{item['id']}: the workload's prompt is not BFCL's prompt over its tools")
        rows.append((prepared.ids, prepared.roles, prepared.grammar, item["id"]))
    rows.sort(key=lambda r: -len(r[0]))
    return Workload(name, description, *map(list, zip(*rows, strict=True)))


def bfcl_workload(tokenizer: Tokenizer, pool: int) -> Workload:
    items = evaluation_items(pool)
    entries = [(item, bfcl_prompt(item), bfcl_python_functions(item["function"])) for item in items]
    return _from_texts("bfcl", "BFCL evaluation prompts as they are, each with its own tools", tokenizer, entries)


def long_context_workload(name: str, tokenizer: Tokenizer, target: int, pool: int, seed: int) -> Workload:
    fitting = [it for it in evaluation_items(8 * pool) if len(tokenizer.encode(bfcl_prompt(it))) <= target // 2]
    if not fitting:
        raise ValueError(f"workload {name!r}: no BFCL question fits in half of {target} tokens; use a longer target")
    entries = []
    for k, item in enumerate(fitting[:pool]):
        messages, tools = long_context_prompt(item, tokenizer, target, seed + k)
        entries.append((item, format_tool_prompt(messages, tools), tools))
    description = (
        f"one BFCL question per prompt, its tools list filled with distractor functions up to {target} tokens; "
        "grammar over the item's own functions"
    )
    return _from_texts(name, description, tokenizer, entries)


def synthetic_workload(name: str, vocab_size: int, pool: int, seed: int) -> Workload:
    """Random token prompts: 64..255 tokens for "bfcl", else 0.9..1.0 of the target length. Their roles are a
    stand-in (the sink, then user text), so role-driven methods run; there is no grammar."""
    rng = np.random.default_rng(seed)
    target = workload_tokens(name)
    lengths = rng.integers(64, 256, pool) if target is None else rng.integers(int(0.9 * target), target + 1, pool)
    prompts = sorted(([int(t) for t in rng.integers(1, vocab_size, n)] for n in lengths), key=len, reverse=True)
    ids = [f"synthetic-{i}" for i in range(pool)]
    roles = [[Role.SINK] + [Role.REQUEST_TEXT] * (len(p) - 1) for p in prompts]
    return Workload(name, f"synthetic random-token prompts ({name})", prompts, roles, None, ids)


def build_workload(name: str, tokenizer: Tokenizer | None, vocab_size: int, pool: int, seed: int) -> Workload:
    """The named workload of `pool` prompts; without a tokenizer, its synthetic stand-in."""
    target = workload_tokens(name)
    if tokenizer is None:
        return synthetic_workload(name, vocab_size, pool, seed)
    if target is None:
        return bfcl_workload(tokenizer, pool)
    return long_context_workload(name, tokenizer, target, pool, seed)
