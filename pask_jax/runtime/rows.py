"""The one decode loop: cache rows fed one token each per jitted step, for static and continuous batching alike.

`DecodeRows` holds a batch's rows: what the next step feeds each row (token, position, role, the tool its call
calls), each request's output, stop state and statistics, and the constraints that mask them. Requests enter with
`admit` (after their prefill: the first token comes from its logits), `step` runs one decode step over every row and
feeds each live row its sampled token, and `release` hands out the requests that ended and frees their rows.

- Static batching (`Engine.generate`): one prefill, every request admitted at once under one batch constraint, then
  `step` until no row is live.
- Continuous batching (`ContinuousBatcher.run`): each request admitted alone with its own constraint, into a row
  that `release` freed; waiting requests take rows between steps.

A constraint covers the rows admitted with it (its batch is their number) and is advanced for all of them until the
last one ends: a row that ended keeps being fed what its mask allows (a finished grammar row: an end-of-turn id), so
a batch constraint stays in step with its rows. A free row still takes part in the step (static shapes): it repeats
its last token and position, which writes and evicts inside its own row and is never read.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Protocol

import jax
import numpy as np

from pask_jax.runtime.budget import Kept
from pask_jax.runtime.sampling import SamplingConfig, mask_words
from pask_jax.runtime.shapes import Capacity
from pask_jax.runtime.step import StepInput
from pask_jax.structure.constraint import TokenConstraint
from pask_jax.structure.roles import NO_TOOL


@dataclasses.dataclass
class RequestStats:
    prompt_tokens: int
    generated_tokens: int = 0
    ttft_s: float = 0.0  # prefill + first token, seen on the host
    token_times_s: list[float] = dataclasses.field(default_factory=list)  # wall time of each decode step
    kept_ratios: list[float] = dataclasses.field(default_factory=list)  # kept/full KV entries after each step
    kv_bytes_ratios: list[float] = dataclasses.field(default_factory=list)  # held/full bf16 KV bytes after each step

    @property
    def kept_ratio_mean(self) -> float:
        return float(np.mean(self.kept_ratios)) if self.kept_ratios else 1.0

    @property
    def kept_ratio_max(self) -> float:
        return float(np.max(self.kept_ratios)) if self.kept_ratios else 1.0

    @property
    def kv_bytes_ratio_mean(self) -> float:
        return float(np.mean(self.kv_bytes_ratios)) if self.kv_bytes_ratios else 1.0

    @property
    def kv_bytes_ratio_max(self) -> float:
        return float(np.max(self.kv_bytes_ratios)) if self.kv_bytes_ratios else 1.0


@dataclasses.dataclass
class Generation:
    tokens: list[int]
    finish_reason: str  # "stop" | "length"
    stats: RequestStats


@dataclasses.dataclass(frozen=True)
class StepTiming:
    """Host wall-clock time of one step of a generate call: what an `on_step` callback receives.

    Step 0 is the prefill (one forward over the padded prompts, until its logits are ready); step k >= 1 is the k-th
    decode step, which produces token k + 1 of every live row (the first token comes from the prefill logits).
    """

    step: int
    seconds: float  # prefill: until its logits are ready; decode: the whole step, the value `token_times_s` records
    call_seconds: float  # the jitted call alone until its outputs are on the host (decode: without the grammar mask)


StepCallback = Callable[[StepTiming], None]


class StepRunner(Protocol):
    """What the loop asks of an engine (`pask_jax.runtime.Engine`)."""

    stop_token_ids: frozenset[int]
    method: Any  # its `name` names it in errors

    def decode_step(self, caches, step: StepInput, mask_bits, key, sampling): ...

    def decode_logits(self, caches, step: StepInput): ...

    def sample(self, logits, mask_bits, key, sampling): ...


@dataclasses.dataclass
class _Row:
    """A request in its cache row."""

    index: int  # the caller's id for the request
    max_new_tokens: int
    stats: RequestStats
    group: _Group
    tokens: list[int] = dataclasses.field(default_factory=list)
    finish: str | None = None  # "stop" | "length" once it ends

    @property
    def position(self) -> int:
        """Position of the newest token: the one the next step feeds."""
        return self.stats.prompt_tokens + len(self.tokens) - 1


@dataclasses.dataclass(eq=False)
class _Group:
    """Rows admitted together under one constraint (None: unconstrained), in the constraint's row order."""

    constraint: TokenConstraint | None
    slots: list[int]
    live: int  # its rows not yet released


class DecodeRows:
    """The rows of one cache and the loop that decodes them (see the module docstring).

    `width` rows (the cache's padded batch), `num_layers * num_kv_heads` entries per token for the kept ratios
    (and `full_entry_bytes` bytes each in the budget's bf16 reference, for the byte ratios);
    `overlap_grammar`: dispatch the step first and build the masks while it runs (`Engine.decode_logits`), else
    build them first and run the fused step that samples too (`Engine.decode_step`).
    """

    def __init__(
        self,
        engine: StepRunner,
        width: int,
        vocab_size: int,
        entries_per_token: int,
        full_entry_bytes: int,
        sampling: SamplingConfig,
        capacities: tuple[Capacity, ...],
        *,
        overlap_grammar: bool = False,
        on_step: StepCallback | None = None,
    ):
        self.engine, self.width, self.sampling, self.capacities = engine, width, sampling, capacities
        self.words, self.entries_per_token = mask_words(vocab_size), entries_per_token
        self.full_token_bytes = entries_per_token * full_entry_bytes  # bytes of one token's K/V in bf16, all layers
        self.overlap_grammar, self.on_step = overlap_grammar, on_step
        self.key = jax.random.key(sampling.seed)
        self.slots: list[_Row | None] = [None] * width
        self.groups: list[_Group] = []
        self.steps = 0
        # what the next step feeds each row (a free row repeats its last token and position)
        self.feed = StepInput.first(width)  # host arrays, updated row by row

    @property
    def free_slots(self) -> list[int]:
        """Rows no live group holds, in order: what `admit` may fill."""
        held = {slot for group in self.groups for slot in group.slots}
        return [slot for slot in range(self.width) if slot not in held]

    @property
    def live(self) -> bool:
        return any(row is not None for row in self.slots)

    def admit(
        self,
        indices: Sequence[int],
        slots: Sequence[int],
        prompt_lengths: Sequence[int],
        max_new_tokens: Sequence[int],
        logits: jax.Array,
        kept: Kept,
        constraints: TokenConstraint | Sequence[TokenConstraint | None] | None,
        origin: float,
    ) -> None:
        """Requests `indices` enter rows `slots` (free ones), prefilled together already: `logits` f32[b', V] of
        their padded prefill (row k: request k), `kept` the entries and bytes each holds. `constraints`: one
        covering all these rows (or None), or one per row. Their first tokens are sampled now, in one draw;
        `ttft_s` counts from `origin` (a `time.perf_counter()` value)."""
        entries, held = _on_host(kept)
        if constraints is None or isinstance(constraints, TokenConstraint):
            groups = [_Group(constraints, list(slots), len(slots))]
        else:
            groups = [_Group(constraint, [slot], 1) for constraint, slot in zip(constraints, slots, strict=True)]
        self.groups += groups
        for k, (index, slot) in enumerate(zip(indices, slots, strict=True)):
            n = int(prompt_lengths[k])
            stats = RequestStats(n, kept_ratios=[entries[k] / (self.entries_per_token * n)])
            stats.kv_bytes_ratios.append(float(held[k]) / (self.full_token_bytes * n))
            group = groups[0] if len(groups) == 1 else groups[k]
            self.slots[slot] = _Row(index, int(max_new_tokens[k]), stats, group)
            self.feed.prompt_lengths[slot] = n
        position = {slot: k for k, slot in enumerate(slots)}  # a slot's row in the prefill's logits
        bits = np.full((logits.shape[0], self.words), -1, np.int32)  # padded prefill rows: every token allowed
        for group in groups:
            if group.constraint is not None:
                bits[[position[slot] for slot in group.slots]] = group.constraint.mask()
        self.key, sub = jax.random.split(self.key)
        first = np.asarray(self.engine.sample(logits, bits, sub, self.sampling))
        ttft = time.perf_counter() - origin
        for slot in slots:
            self.slots[slot].stats.ttft_s = ttft
        for group in groups:
            self._take(group, first[[position[slot] for slot in group.slots]])

    def step(self, caches: list) -> list:
        """One decode step over every row (`caches` donated; returns the new ones); each live row takes its token."""
        engine, sampling = self.engine, self.sampling
        t0 = time.perf_counter()
        self.key, sub = jax.random.split(self.key)
        feed = self.feed
        if self.overlap_grammar:
            logits, caches, kept, overflow = engine.decode_logits(caches, feed)
            call_start = time.perf_counter()
            sampled = engine.sample(logits, self._masks(), sub, sampling)  # masks built while the step runs
        else:
            bits = self._masks()
            call_start = time.perf_counter()
            sampled, caches, kept, overflow = engine.decode_step(caches, feed, bits, sub, sampling)
        sampled, (entries, held) = np.asarray(sampled), _on_host(kept)
        call_s = time.perf_counter() - call_start
        if bool(overflow):
            raise RuntimeError(
                f"KV cache overflow: method {engine.method.name!r} exceeded capacities {self.capacities}"
            )
        dt = time.perf_counter() - t0
        for slot, row in enumerate(self.slots):
            if row is not None:
                row.stats.token_times_s.append(dt)
                row.stats.kept_ratios.append(entries[slot] / (self.entries_per_token * (row.position + 1)))
                row.stats.kv_bytes_ratios.append(float(held[slot]) / (self.full_token_bytes * (row.position + 1)))
        for group in self.groups:
            self._take(group, sampled[group.slots])
        self.steps += 1
        if self.on_step is not None:
            self.on_step(StepTiming(self.steps, dt, call_s))
        return caches

    def release(self) -> Iterator[tuple[int, Generation]]:
        """Free the rows whose request ended and hand out (index, Generation) for each; a group whose rows have all
        ended lets its rows go to the next admission."""
        for slot, row in enumerate(self.slots):
            if row is not None and row.finish is not None:
                self.slots[slot] = None
                feed = self.feed
                feed.roles[slot], feed.prompt_lengths[slot], feed.method_inputs.called[slot] = 0, 1, NO_TOOL
                row.group.live -= 1
                yield row.index, Generation(row.tokens, row.finish, row.stats)
        self.groups = [group for group in self.groups if group.live]

    def _take(self, group: _Group, sampled: np.ndarray) -> None:
        """Each of the group's rows takes its sampled token: a live row's output grows (unless the token ends it,
        the next step feeds it); the constraint is fed every row's token, ended rows' included."""
        constraint = group.constraint
        roles = called = None
        if constraint is not None:
            roles, called = constraint.advance(sampled), constraint.called_tools()
        for k, slot in enumerate(group.slots):
            row = self.slots[slot]
            if row is None or row.finish is not None:
                continue
            token = int(sampled[k])
            row.tokens.append(token)
            row.stats.generated_tokens += 1
            if token in self.engine.stop_token_ids:
                row.finish = "stop"
            elif len(row.tokens) >= row.max_new_tokens:
                row.finish = "length"
            else:
                if constraint is not None:
                    self.feed.roles[slot], self.feed.method_inputs.called[slot] = roles[k], called[k]
                self.feed.tokens[slot], self.feed.positions[slot] = token, row.position

    def _masks(self) -> np.ndarray:
        """i32[width, W] packed masks (a free or unconstrained row: every token)."""
        bits = np.full((self.width, self.words), -1, np.int32)
        for group in self.groups:
            if group.constraint is not None:
                bits[group.slots] = group.constraint.mask()
        return bits


def _on_host(kept: Kept) -> tuple[np.ndarray, np.ndarray]:
    """The kept entries i32[B] and bytes f32[B] of a step, as numpy."""
    return np.asarray(kept.entries), np.asarray(kept.bytes)
