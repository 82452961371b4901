"""Scheduling: `Scheduler` runs jobs as static micro-batches (`batching.py`) or by continuous batching: a fixed
number of cache rows; a row whose sequence ends takes the next waiting request.

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
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, wait

import jax
import numpy as np

from pask_jax.memory import rows_fitting
from pask_jax.runtime.batching import Job, MemoryLimitError, micro_batches, sampling_groups
from pask_jax.runtime.engine import Engine
from pask_jax.runtime.rows import DecodeRows, Generation
from pask_jax.runtime.sampling import SamplingConfig, mask_words
from pask_jax.runtime.shapes import BatchShape, length_bucket, padded_batch
from pask_jax.runtime.step import StepInput
from pask_jax.storage import full_entry_bytes
from pask_jax.structure.constraint import TokenConstraint


@dataclasses.dataclass(frozen=True)
class SequenceRequest:
    """One sequence for the batcher: prompt token ids (their roles, and the constraint's tool each describes), its
    own token limit and constraint.

    `constraint` covers this sequence alone (a batch of one, e.g. `GrammarConstraint([grammar], vocab)`), or is a
    Future of it while the host still prepares it (its grammar compiling on a worker): the sequence is admitted once
    it is done.
    """

    ids: Sequence[int]
    max_new_tokens: int
    roles: Sequence[int] | None = None
    constraint: TokenConstraint | Future[TokenConstraint] | None = None
    tools: Sequence[int] | None = None

    @property
    def ready(self) -> bool:
        return not isinstance(self.constraint, Future) or self.constraint.done()


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

    A request whose constraint is still a Future (its grammar compiling on a host worker) waits while the rows run:
    free rows take the waiting requests that are ready, in order, so one slow compile holds back no other request;
    only when no row is live does the batcher wait for the next preparation to finish (`prep_wait_s`: the seconds
    the device waited on the host). A preparation that failed is yielded as its exception in place of a Generation.
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
        self.prep_wait_s = 0.0

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
        if self.overlap_grammar:
            engine.decode_logits(caches, StepInput.first(width))
        else:
            bits = np.full((width, mask_words(engine.cfg.vocab_size)), -1, np.int32)
            engine.decode_step(caches, StepInput.first(width), bits, jax.random.key(0), self.sampling)

    def run(self, requests: Sequence[SequenceRequest]) -> Iterator[tuple[int, Generation | Exception]]:
        """Yields (request index, Generation) as each sequence ends (a failed preparation: its exception); requests
        are admitted in order among those ready. A request's `ttft_s` counts from the start of the run (time spent
        waiting for a row or for its preparation included)."""
        if not requests:
            return
        self.check(requests)
        engine, cfg = self.engine, self.engine.cfg
        shape = row_shape(engine, requests, self.rows)
        start = time.perf_counter()
        caches = engine.empty_caches(shape.padded_rows, shape.capacities)
        rows = DecodeRows(
            engine, shape.padded_rows, cfg.vocab_size, cfg.num_layers * cfg.num_kv_heads,
            full_entry_bytes(cfg.head_dim), self.sampling, shape.capacities, overlap_grammar=self.overlap_grammar,
        )  # fmt: skip
        waiting = collections.deque(range(len(requests)))
        while waiting or rows.live:
            if not rows.live:
                self._wait_for_one(requests, waiting)
            ready = [i for i in waiting if requests[i].ready][: len(rows.free_slots)]
            for i in ready:
                waiting.remove(i)
            failed = {i: error for i in ready if (error := _failure(requests[i].constraint)) is not None}
            yield from failed.items()
            admitted = list(zip([i for i in ready if i not in failed], rows.free_slots, strict=False))
            for chunk in admission_chunks(
                [len(requests[i].ids) for i, _ in admitted], engine.data_size, self.max_prefill_rows
            ):
                group = [admitted[k] for k in chunk]
                admitted_requests = [requests[i] for i, _ in group]
                caches, logits, kept = self._prefill_into(caches, admitted_requests, [slot for _, slot in group], shape)
                rows.admit(
                    [i for i, _ in group], [slot for _, slot in group], [len(r.ids) for r in admitted_requests],
                    [r.max_new_tokens for r in admitted_requests], logits, kept,
                    [_resolved(r.constraint) for r in admitted_requests], start,
                )  # fmt: skip
            yield from rows.release()
            if not rows.live or rows.free_slots and any(requests[i].ready for i in waiting):
                continue  # a row ended at its first token, or a preparation finished: fill the rows before the step
            caches = rows.step(caches)
            yield from rows.release()

    def _wait_for_one(self, requests: Sequence[SequenceRequest], waiting: collections.deque) -> None:
        """With no row live, wait (the device idle) until a waiting request's preparation is done."""
        pending = [requests[i].constraint for i in waiting]
        if not pending or not all(isinstance(c, Future) and not c.done() for c in pending):
            return
        start = time.perf_counter()
        wait(pending, return_when=FIRST_COMPLETED)
        self.prep_wait_s += time.perf_counter() - start

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
        return engine.insert_rows(caches, new, rows), logits, kept

    def _group_shape(self, shape: BatchShape, rows: int, bucket: int) -> BatchShape:
        """The prefill shape of `rows` admitted requests at length `bucket`, filled to the cache's capacities (what
        `run` prefills and `precompile` compiles)."""
        return dataclasses.replace(
            shape, rows=rows, padded_rows=padded_batch(rows, self.engine.data_size), prompt_bucket=bucket
        )


def _resolved(constraint: TokenConstraint | Future[TokenConstraint] | None) -> TokenConstraint | None:
    return constraint.result() if isinstance(constraint, Future) else constraint


def _failure(constraint: TokenConstraint | Future[TokenConstraint] | None) -> BaseException | None:
    """The error of a preparation that failed (a done Future), else None."""
    return constraint.exception() if isinstance(constraint, Future) else None


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


class Scheduler:
    """Orders and batches `Job`s on one engine, static or continuous; yields each job's `Generation` (or the
    `MemoryLimitError` of a job whose cache alone exceeds `kv_memory_bytes`) as it ends.

    `"continuous"`: per sampling group, waves of jobs (in order) through a `ContinuousBatcher`: a wave grows while
    one row sized for all of its members fits the memory limit, which sets its row count (at most `max_batch`).
    `"static"`: `batching.micro_batches` (length-sorted, at most `max_batch` rows whose KV cache fits the limit), each
    run by `Engine.generate` until its longest answer ends. `engine`: the engine, or a function that builds it on
    first need (the memory rules need it only under a limit). `overlap_grammar` and `max_prefill_rows`: the
    `ContinuousBatcher`'s.
    """

    MODES = ("continuous", "static")

    def __init__(
        self,
        engine: Engine | Callable[[], Engine],
        mode: str = "continuous",
        *,
        max_batch: int = 8,
        kv_memory_bytes: int | None = None,
        overlap_grammar: bool | None = None,
        max_prefill_rows: int | None = None,
    ):
        if mode not in self.MODES:
            raise ValueError(f"unknown scheduler {mode!r}; choose from {', '.join(self.MODES)}")
        if max_batch < 1:
            raise ValueError(f"max_batch={max_batch} must be >= 1")
        self._engine, self.mode, self.max_batch, self.kv_memory_bytes = engine, mode, max_batch, kv_memory_bytes
        self.overlap_grammar, self.max_prefill_rows = overlap_grammar, max_prefill_rows
        self.prep_wait_s = 0.0  # continuous: the seconds its batchers waited for preparations with no row live

    @property
    def engine(self) -> Engine:
        if not isinstance(self._engine, Engine):
            self._engine = self._engine()
        return self._engine

    def micro_batches(self, jobs: Sequence[Job]) -> list[list[int]]:
        """The static batches of `jobs` (indices): `batching.micro_batches` under this memory limit."""
        return micro_batches(jobs, self.max_batch, self.fits)

    def fits(self, batch: Sequence[Job]) -> bool:
        """Whether a micro-batch's KV cache (its padded rows and buckets, this method's capacities) fits the limit."""
        if self.kv_memory_bytes is None:
            return True
        shape = self.engine.batch_shape([len(j.ids) for j in batch], max(j.max_new_tokens for j in batch))
        return self.engine.cache_bytes(shape) <= self.kv_memory_bytes

    def too_large(self, job: Job) -> MemoryLimitError | None:
        """The error of a job whose KV cache alone (one row) exceeds `kv_memory_bytes`, else None."""
        if self.kv_memory_bytes is None:
            return None
        need = self.engine.cache_bytes(self.engine.batch_shape([len(job.ids)], job.max_new_tokens))
        if need <= self.kv_memory_bytes:
            return None
        return MemoryLimitError(f"its KV cache needs {need} bytes, over the limit of {self.kv_memory_bytes}")

    def rows(self, batch: Sequence[Job]) -> int:
        """Rows of a continuous batch of these jobs: `max_batch`, or fewer if the memory limit says so."""
        if self.kv_memory_bytes is None:
            return self.max_batch
        sequences = [SequenceRequest(j.ids, j.max_new_tokens) for j in batch]
        return rows_for_memory(self.engine, row_shape(self.engine, sequences, 1), self.kv_memory_bytes, self.max_batch)

    def run(
        self, jobs: Sequence[Job], constraint: Callable[[list[int]], TokenConstraint]
    ) -> Iterator[tuple[list[int], list[Generation | MemoryLimitError], int]]:
        """Yields (job indices, their generations or errors, the Unix second they date from: a static batch's start,
        a continuous job's end) as they end. `constraint(indices)`: the constraint of those jobs' rows, built just
        before they run (continuous: one job at a time, or a Future of it that admits the job when done; static: the
        batch)."""
        if self.mode == "continuous":
            yield from self._continuous(jobs, constraint)
            return
        for indices in self.micro_batches(jobs):
            batch = [jobs[i] for i in indices]
            if len(batch) == 1 and (error := self.too_large(batch[0])) is not None:
                yield indices, [error], int(time.time())
                continue
            engine, rows_constraint = self.engine, constraint(indices)
            sampling = dataclasses.replace(batch[0].sampling, max_new_tokens=max(j.max_new_tokens for j in batch))
            start = time.perf_counter()
            generations = engine.generate(
                [j.ids for j in batch], sampling, prompt_roles=[j.roles for j in batch],
                prompt_tools=[j.tools for j in batch], constraint=rows_constraint,
            )  # fmt: skip
            yield indices, generations, int(time.time() - (time.perf_counter() - start))

    def _continuous(
        self, jobs: Sequence[Job], constraint: Callable[[list[int]], TokenConstraint]
    ) -> Iterator[tuple[list[int], list, int]]:
        for group in sampling_groups(jobs):
            waves: list[list[int]] = [[]]
            for i in group:
                if (error := self.too_large(jobs[i])) is not None:
                    yield [i], [error], int(time.time())
                elif self.rows([jobs[j] for j in [*waves[-1], i]]) < 1:
                    waves.append([i])
                else:
                    waves[-1].append(i)
            for wave in filter(None, waves):
                batch = [jobs[i] for i in wave]
                batcher = ContinuousBatcher(
                    self.engine,
                    self.rows(batch),
                    batch[0].sampling,
                    overlap_grammar=self.overlap_grammar,
                    max_prefill_rows=self.max_prefill_rows,
                )
                sequences = [
                    SequenceRequest(j.ids, j.max_new_tokens, j.roles, constraint([i]), j.tools)
                    for i, j in zip(wave, batch, strict=True)
                ]
                for k, generation in batcher.run(sequences):
                    yield [wave[k]], [generation], int(time.time())
                self.prep_wait_s += batcher.prep_wait_s
