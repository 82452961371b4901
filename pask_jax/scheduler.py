"""Continuous batching: a fixed number of cache rows; a row whose sequence ends takes the next waiting request.

Static batching (`Engine.generate`) prefills a batch together and decodes until its longest member ends, so short
answers wait for long ones and a finished row's memory idles. `ContinuousBatcher` keeps one cache of `rows` rows at
fixed capacities (the longest admitted prompt's length bucket plus the new-token bucket, as one static batch of them
would have) and runs one decode step over all rows at a time. Before a step, every free row takes the next waiting
request: the requests admitted together are prefilled in groups of a power of two, longest first (each at its own
length bucket, filled to the shared capacities: `admission_chunks`), and copied into their rows
(`Engine.insert_rows`: a row index is an argument, so no row recompiles).
Each row has its own constraint (grammar state, roles), stop state and token limit; a row that ends is freed at once.

Every step's arrays keep their shapes, so a run compiles one decode step, one insertion per admitted-group size and
one prefill per (group size, length bucket). A free row still takes part in the step (static shapes): it repeats its
last position, which writes and evicts inside its own row and is never read. Greedy tokens equal static batching's.

With `overlap_grammar`, the step is dispatched first (JAX runs it asynchronously) and the next token masks are built
on the host while it runs; the masked sampler follows. Without it, masks are built first and the fused step
(`Engine.decode_step`) samples too, as static batching does. The default (None) overlaps on an accelerator only: on
XLA:CPU the step and the mask work share the same cores, and the overlap measured slower there (docs/RESULTS.md).

Memory: `rows_for_memory` is the row count whose caches fit a byte limit at a given shape: a method that keeps less
per row gets more rows in the same memory.
"""

from __future__ import annotations

import collections
import dataclasses
import time
from collections.abc import Iterator, Sequence

import jax
import numpy as np

from pask_jax.engine import (
    BatchShape,
    Engine,
    Generation,
    RequestStats,
    SamplingConfig,
    length_bucket,
    mask_words,
    padded_batch,
)
from pask_jax.memory import rows_fitting
from pask_jax.structure.constraint import TokenConstraint
from pask_jax.structure.roles import NO_TOOL


@dataclasses.dataclass(frozen=True)
class SequenceRequest:
    """One sequence for the batcher: prompt token ids (their roles, and the constraint's tool each describes), its
    own token limit and constraint.

    `constraint` covers this sequence alone (a batch of one, e.g. `GrammarConstraint([grammar], vocab)`).
    """

    ids: Sequence[int]
    max_new_tokens: int
    roles: Sequence[int] | None = None
    constraint: TokenConstraint | None = None
    tools: Sequence[int] | None = None


@dataclasses.dataclass
class _Row:
    """A request in its cache row."""

    index: int  # into the run's requests
    request: SequenceRequest
    stats: RequestStats
    tokens: list[int] = dataclasses.field(default_factory=list)
    finish: str | None = None  # "stop" | "length" once it ends

    @property
    def position(self) -> int:
        """Position of the newest token: the one the next step feeds."""
        return self.stats.prompt_tokens + len(self.tokens) - 1


def row_shape(engine: Engine, requests: Sequence[SequenceRequest], rows: int) -> BatchShape:
    """The shape of a batcher's cache: `rows` rows (rounded up to a multiple of the mesh's data size) sized for the
    longest prompt and the largest token limit of `requests`."""
    shape = engine.batch_shape([max(len(r.ids) for r in requests)], max(r.max_new_tokens for r in requests))
    width = -(-rows // engine.data_size) * engine.data_size
    return dataclasses.replace(shape, rows=width, padded_rows=width)


def rows_for_memory(engine: Engine, shape: BatchShape, kv_memory_bytes: int, max_rows: int) -> int:
    """The most rows (at most `max_rows`, a multiple of the mesh's data size) whose caches at `shape`'s capacities
    fit `kv_memory_bytes`; 0 when not even one row fits."""

    def bytes_at(n: int) -> int:
        return engine.cache_bytes(dataclasses.replace(shape, rows=n, padded_rows=n))

    rows = min(max_rows, rows_fitting(bytes_at, kv_memory_bytes))
    return rows - rows % engine.data_size


def default_overlap_grammar() -> bool:
    """Build the masks while the step runs only where the step runs elsewhere than the host's cores."""
    return jax.default_backend() != "cpu"


class ContinuousBatcher:
    """Generates `SequenceRequest`s on one engine with `rows` cache rows, refilling rows as sequences end.

    `sampling` gives temperature, top-p and seed (its `max_new_tokens` is unused: each request has its own limit).
    `max_prefill_rows` caps the rows prefilled together (None: every admitted request, in power-of-two groups). A
    group is padded to its longest prompt; where prefill throughput does not grow with rows (XLA:CPU: 70 padded
    tokens/s at 1 row and at 8), 1 wastes nothing; an accelerator gains from larger groups. `overlap_grammar=None`
    takes `default_overlap_grammar()`.
    """

    def __init__(
        self,
        engine: Engine,
        rows: int,
        sampling: SamplingConfig | None = None,
        *,
        overlap_grammar: bool | None = None,
        max_prefill_rows: int | None = None,
    ):
        if rows < 1:
            raise ValueError(f"rows={rows} must be >= 1")
        if max_prefill_rows is not None and max_prefill_rows < 1:
            raise ValueError(f"max_prefill_rows={max_prefill_rows} must be >= 1")
        self.engine, self.rows, self.sampling = engine, rows, sampling or SamplingConfig()
        if overlap_grammar is None:
            overlap_grammar = default_overlap_grammar()
        self.overlap_grammar, self.max_prefill_rows = overlap_grammar, max_prefill_rows

    def check(self, requests: Sequence[SequenceRequest]) -> None:
        """ValueError naming the first request the engine cannot run (before anything is computed)."""
        engine = self.engine
        vocab = engine.cfg.vocab_size
        for i, r in enumerate(requests):
            if r.max_new_tokens < 1:
                raise ValueError(f"request {i}: max_new_tokens={r.max_new_tokens} must be >= 1")
            if r.roles is not None and len(r.roles) != len(r.ids):
                raise ValueError(f"request {i}: {len(r.roles)} roles for {len(r.ids)} prompt tokens")
            if any(t < 0 or t >= vocab for t in r.ids):
                raise ValueError(f"request {i}: prompt token ids must be in [0, {vocab})")
            if engine.method.needs_roles and r.roles is None and r.constraint is None:
                raise ValueError(
                    f"request {i}: method {engine.method.name!r} decides by token roles: give roles or a constraint"
                )
            try:
                engine.batch_shape([len(r.ids)], r.max_new_tokens)  # empty, past the buckets or the context limit
            except ValueError as e:
                raise ValueError(f"request {i}: {e}") from None

    def precompile(self, requests: Sequence[SequenceRequest]) -> None:
        """Compile every step `run(requests)` can take before it runs, as a server does at start-up: the prefill of
        each admission-group size at each of the requests' length buckets ahead of time (nothing executes, so long
        prompts cost only their compiles), and the cheap steps (row insertion, the sampler, one decode step) by
        running them once on empty rows."""
        self.check(requests)
        engine = self.engine
        shape = row_shape(engine, requests, self.rows)
        width, capacities = shape.padded_rows, shape.capacities
        sizes = {
            padded_batch(len(chunk), engine.data_size)
            for admitted in range(1, min(width, len(requests)) + 1)
            for chunk in admission_chunks([0] * admitted, engine.data_size, self.max_prefill_rows)
        }
        buckets = {length_bucket(len(r.ids), engine.length_buckets) for r in requests}
        caches = engine.empty_caches(width, capacities)
        for size in sorted(sizes):
            for bucket in sorted(buckets):
                engine.lower_prefill(self._group_shape(shape, size, bucket)).compile()
            skipped = np.full(size, width, np.int32)  # every row index past the batch: nothing is written
            caches = engine.insert_rows(caches, engine.empty_caches(size, capacities), skipped)
            engine.warm_sampler(size, self.sampling)
        engine.warm_sampler(width, self.sampling)
        zeros, ones = np.zeros(width, np.int32), np.ones(width, np.int32)
        if self.overlap_grammar:
            engine.decode_logits(caches, zeros, zeros, zeros, ones)
        else:
            bits = np.full((width, mask_words(engine.cfg.vocab_size)), -1, np.int32)
            engine.decode_step(caches, zeros, zeros, zeros, ones, bits, jax.random.key(0), self.sampling)

    def run(self, requests: Sequence[SequenceRequest]) -> Iterator[tuple[int, Generation]]:
        """Yields (request index, Generation) as each sequence ends; requests are admitted in order. A request's
        `ttft_s` counts from the start of the run (time spent waiting for a row included)."""
        if not requests:
            return
        self.check(requests)
        engine, sampling = self.engine, self.sampling
        shape = row_shape(engine, requests, self.rows)
        width = shape.padded_rows
        words = mask_words(engine.cfg.vocab_size)
        full_per_token = engine.cfg.num_layers * engine.cfg.num_kv_heads
        start = time.perf_counter()
        caches = engine.empty_caches(width, shape.capacities)
        key = jax.random.key(sampling.seed)
        waiting = collections.deque(range(len(requests)))
        slots: list[_Row | None] = [None] * width
        # what the next step feeds each row (a free row repeats its last position: written and evicted in-row)
        tokens, positions = np.zeros(width, np.int32), np.zeros(width, np.int32)
        roles, prompt_lengths = np.zeros(width, np.int32), np.ones(width, np.int32)
        called = np.full(width, NO_TOOL, np.int32)  # the tool each row's current call calls

        def take(slot: int, token: int) -> None:
            """A sampled token joins its row's output; unless it ends the row, the next step feeds it."""
            row = slots[slot]
            row.tokens.append(token)
            row.stats.generated_tokens += 1
            if token in engine.stop_token_ids:
                row.finish = "stop"
            elif len(row.tokens) >= row.request.max_new_tokens:
                row.finish = "length"
            else:
                constraint = row.request.constraint
                if constraint is not None:
                    roles[slot] = int(constraint.advance(np.array([token]))[0])
                    called[slot] = int(constraint.called_tools()[0])
                tokens[slot], positions[slot] = token, row.position

        def masks(rows: Sequence[int]) -> np.ndarray:
            """i32[len(rows), W] packed masks of these rows (a free or unconstrained row: every token)."""
            bits = np.full((len(rows), words), -1, np.int32)
            for i, slot in enumerate(rows):
                row = slots[slot]
                if row is not None and row.request.constraint is not None:
                    bits[i] = row.request.constraint.mask()[0]
            return bits

        def release() -> Iterator[tuple[int, Generation]]:
            """Free the rows whose sequence ended (the next admission refills them) and hand their results out."""
            for slot, row in enumerate(slots):
                if row is not None and row.finish is not None:
                    slots[slot] = None
                    roles[slot], prompt_lengths[slot], called[slot] = 0, 1, NO_TOOL
                    yield row.index, Generation(row.tokens, row.finish, row.stats)

        while waiting or any(slots):
            free = [slot for slot, row in enumerate(slots) if row is None][: len(waiting)]
            admitted = [(waiting.popleft(), slot) for slot in free]
            for chunk in admission_chunks(
                [len(requests[i].ids) for i, _ in admitted], engine.data_size, self.max_prefill_rows
            ):
                group = [admitted[k] for k in chunk]
                caches, logits, kept = self._prefill_into(
                    caches, [requests[i] for i, _ in group], [slot for _, slot in group], shape
                )
                for k, (index, slot) in enumerate(group):
                    n = len(requests[index].ids)
                    stats = RequestStats(prompt_tokens=n, kept_ratios=[kept[k] / (full_per_token * n)])
                    slots[slot] = _Row(index, requests[index], stats)
                    prompt_lengths[slot] = n
                # their first tokens come from the prefill logits (padded group rows: every token allowed)
                bits = np.full((logits.shape[0], words), -1, np.int32)
                bits[: len(group)] = masks([slot for _, slot in group])
                key, sub = jax.random.split(key)
                first = np.asarray(engine.sample(logits, bits, sub, sampling))
                ttft = time.perf_counter() - start
                for k, (_, slot) in enumerate(group):
                    slots[slot].stats.ttft_s = ttft
                    take(slot, int(first[k]))
            yield from release()
            if waiting and not all(slots) or not any(slots):
                continue  # a row ended at its first token: refill it before the step
            t0 = time.perf_counter()
            key, sub = jax.random.split(key)
            every = range(width)
            if self.overlap_grammar:
                logits, caches, kept, overflow = engine.decode_logits(
                    caches, tokens, positions, roles, prompt_lengths, called
                )
                sampled = engine.sample(logits, masks(every), sub, sampling)  # masks built while the step runs
            else:
                sampled, caches, kept, overflow = engine.decode_step(
                    caches, tokens, positions, roles, prompt_lengths, masks(every), sub, sampling, called
                )
            sampled, kept = np.asarray(sampled), np.asarray(kept)
            if bool(overflow):
                raise RuntimeError(
                    f"KV cache overflow: method {engine.method.name!r} exceeded capacities {shape.capacities}"
                )
            dt = time.perf_counter() - t0
            for slot, row in enumerate(slots):
                if row is not None:
                    row.stats.token_times_s.append(dt)
                    row.stats.kept_ratios.append(kept[slot] / (full_per_token * (row.position + 1)))
                    take(slot, int(sampled[slot]))
            yield from release()

    def _prefill_into(
        self, caches: list, group: Sequence[SequenceRequest], slots: Sequence[int], shape: BatchShape
    ) -> tuple[list, jax.Array, np.ndarray]:
        """Prefill `group` together (their own length bucket, `shape`'s capacities) into rows `slots` of `caches`
        (donated) -> (caches, last-token logits f32[b, V] of the padded group, kept entries i32[b])."""
        engine = self.engine
        batch = self._group_shape(
            shape, len(group), length_bucket(max(len(r.ids) for r in group), engine.length_buckets)
        )
        roles = [r.roles if r.roles is not None else [0] * len(r.ids) for r in group]
        tokens, lengths, prompt_roles = batch.pad([r.ids for r in group], roles)
        tools = batch.pad_tools([r.tools for r in group])
        logits, new, kept = engine.prefill(tokens, lengths, prompt_roles, shape.capacities, tools)
        rows = np.full(batch.padded_rows, shape.padded_rows, np.int32)  # padding rows: past the batch, skipped
        rows[: batch.rows] = slots
        return engine.insert_rows(caches, new, rows), logits, np.asarray(kept)

    def _group_shape(self, shape: BatchShape, rows: int, bucket: int) -> BatchShape:
        """The prefill shape of `rows` admitted requests at length `bucket`, filled to the cache's capacities (what
        `run` prefills and `precompile` compiles)."""
        return dataclasses.replace(
            shape, rows=rows, padded_rows=padded_batch(rows, self.engine.data_size), prompt_bucket=bucket
        )


def admission_chunks(lengths: Sequence[int], data_size: int = 1, max_rows: int | None = None) -> list[list[int]]:
    """The prefill groups of requests admitted together (positions into `lengths`): longest first, in chunks of a
    power of two (6 -> 4 + 2) of at most `max_rows`, so that no group is padded with empty rows and each is prefilled
    at its own length bucket; what is left once at most `data_size` remain is one chunk (a mesh pads a group to whole
    rows per device)."""
    order = sorted(range(len(lengths)), key=lambda k: -lengths[k])
    cap = len(order) if max_rows is None else max(max_rows, data_size)
    chunks = []
    while order:
        n = min(len(order), cap)
        size = n if n <= data_size else 1 << (n.bit_length() - 1)
        chunks.append(order[:size])
        order = order[size:]
    return chunks
