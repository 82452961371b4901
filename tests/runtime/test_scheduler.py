"""Scheduling (static micro-batches, continuous waves) and continuous batching on a tiny model: stop tokens, the
grammar-free overlap switch, compiles, memory-sized rows, bad requests. (Token identity with static batching for
every method: tests/methods/test_methods.py.)"""

from __future__ import annotations

import threading
from concurrent.futures import Future

import jax
import pytest
from flax import nnx

from pask_jax.methods import make_method
from pask_jax.models.decoder import Decoder, ModelConfig
from pask_jax.runtime.batching import Job, MemoryLimitError, micro_batches, sampling_groups
from pask_jax.runtime.engine import Engine
from pask_jax.runtime.sampling import SamplingConfig
from pask_jax.runtime.scheduler import (
    ContinuousBatcher,
    Scheduler,
    SequenceRequest,
    admission_chunks,
    row_shape,
    rows_for_memory,
)
from pask_jax.structure.constraint import FreeTextConstraint
from pask_jax.structure.schema import GrammarError

COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
PROMPTS = [[5, 17, 42, 8, 99, 3, 61], [7, 7, 120], [200, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12], [9] * 20, [3, 4]]
BUCKETS = (16, 32)
_compiles = [0]
jax.monitoring.register_event_duration_secs_listener(
    lambda event, seconds, **kw: _compiles.__setitem__(0, _compiles[0] + (event == COMPILE_EVENT))
)


@pytest.fixture(scope="module")
def model() -> Decoder:
    return Decoder(ModelConfig.tiny("qwen2", vocab_size=256), rngs=nnx.Rngs(3))


def test_stop_tokens_free_rows_and_both_step_orders_agree(model: Decoder):
    reference = Engine(model, length_buckets=BUCKETS).generate(PROMPTS, SamplingConfig(max_new_tokens=10))
    stop = reference[0].tokens[4]  # a token the model writes: some rows stop on it, early
    engine = Engine(model, stop_token_ids=[stop], length_buckets=BUCKETS)
    static = engine.generate(PROMPTS, SamplingConfig(max_new_tokens=10))
    requests = [SequenceRequest(p, 10) for p in PROMPTS]
    for overlap, prefill_rows in ((True, None), (False, None), (True, 1)):
        batcher = ContinuousBatcher(engine, rows=3, overlap_grammar=overlap, max_prefill_rows=prefill_rows)
        out = dict(batcher.run(requests))
        assert [out[i].tokens for i in range(len(PROMPTS))] == [g.tokens for g in static]
        assert [out[i].finish_reason for i in range(len(PROMPTS))] == [g.finish_reason for g in static]
    assert static[0].finish_reason == "stop" and static[0].tokens[-1] == stop


def test_grammar_overlap_defaults_to_off_on_the_host_cores_only(model: Decoder, monkeypatch: pytest.MonkeyPatch):
    engine = Engine(model, length_buckets=BUCKETS)
    for backend, overlap in (("cpu", False), ("tpu", True), ("gpu", True)):
        monkeypatch.setattr(jax, "default_backend", lambda backend=backend: backend)
        assert ContinuousBatcher(engine, rows=1).overlap_grammar is overlap
        assert ContinuousBatcher(engine, rows=1, overlap_grammar=not overlap).overlap_grammar is (not overlap)


def test_requests_wait_for_a_row_and_a_warm_run_compiles_nothing(model: Decoder):
    engine = Engine(model, length_buckets=BUCKETS)
    batcher = ContinuousBatcher(engine, rows=2)
    requests = [SequenceRequest(p, n) for p, n in zip(PROMPTS, (6, 2, 4, 3, 5), strict=True)]
    order = [i for i, _ in batcher.run(requests)]
    assert order == [1, 2, 0, 3, 4]  # a row that ends takes the next request before the next step
    ttft = {i: g.stats.ttft_s for i, g in batcher.run(requests)}
    assert ttft[4] > ttft[0]  # the fifth request waited for a row
    before = _compiles[0]
    shuffled = [requests[i] for i in (4, 2, 0, 3, 1)]  # other arrivals, rows refilled at other steps
    assert len(list(batcher.run(shuffled))) == len(requests)
    assert _compiles[0] == before


def test_a_request_is_admitted_once_its_preparation_is_done(model: Decoder):
    """A constraint still compiling holds back its own request only; a failed one comes back as its error; the batcher
    waits (and counts the wait) only when no row is live."""
    engine = Engine(model, length_buckets=BUCKETS)

    def free() -> FreeTextConstraint:
        return FreeTextConstraint(1, 256, 256, [255])

    reference = dict(ContinuousBatcher(engine, rows=2).run([SequenceRequest(p, 4, constraint=free()) for p in PROMPTS]))
    pending, failed = Future(), Future()
    failed.set_exception(GrammarError("function 'f': bad schema"))
    constraints = [pending, free(), failed, free(), free()]
    batcher = ContinuousBatcher(engine, rows=2)
    run = batcher.run([SequenceRequest(p, 4, constraint=c) for p, c in zip(PROMPTS, constraints, strict=True)])
    first, second = next(run), next(run)
    assert first[0] == 2 and isinstance(first[1], GrammarError)  # refused at admission, before any step
    assert second[0] in (1, 3)  # request 0 did not block the rows: later ready requests ran first
    pending.set_result(free())
    rest = dict([second, *run])
    assert sorted(rest) == [0, 1, 3, 4]
    assert {i: g.tokens for i, g in rest.items()} == {i: reference[i].tokens for i in rest}
    assert batcher.prep_wait_s == 0.0  # a row was live whenever request 0 was not ready

    late = Future()
    threading.Timer(0.3, lambda: late.set_result(free())).start()
    alone = ContinuousBatcher(engine, rows=2)
    [(index, generation)] = alone.run([SequenceRequest(PROMPTS[0], 4, constraint=late)])
    assert index == 0 and generation.tokens == reference[0].tokens
    assert alone.prep_wait_s > 0.0  # nothing else to run: the device waited on the host


@pytest.mark.parametrize("overlap, prefill_rows", [(True, None), (False, 1)])
def test_precompile_leaves_nothing_for_the_run_to_compile(model: Decoder, overlap: bool, prefill_rows: int | None):
    engine = Engine(model, length_buckets=(8, 24))  # shapes no other test compiles
    batcher = ContinuousBatcher(engine, rows=3, overlap_grammar=overlap, max_prefill_rows=prefill_rows)
    requests = [SequenceRequest(p, n) for p, n in zip(PROMPTS, (6, 2, 4, 3, 5), strict=True)]
    before = _compiles[0]
    batcher.precompile(requests)
    assert _compiles[0] > before
    compiled = _compiles[0]
    assert len(list(batcher.run(requests))) == len(requests)
    assert _compiles[0] == compiled


def test_rows_follow_the_memory_limit_and_each_methods_cache(model: Decoder):
    requests = [SequenceRequest(p, 16) for p in PROMPTS]
    full = Engine(model, length_buckets=BUCKETS)
    snap = Engine(model, method=make_method("snapkv", {}, budget=0.25), budget=0.25, length_buckets=BUCKETS)
    two_rows = full.cache_bytes(row_shape(full, requests, 2))
    assert rows_for_memory(full, row_shape(full, requests, 1), two_rows, max_rows=64) == 2
    assert rows_for_memory(snap, row_shape(snap, requests, 1), two_rows, max_rows=64) > 4
    assert rows_for_memory(snap, row_shape(snap, requests, 1), two_rows, max_rows=3) == 3
    assert rows_for_memory(full, row_shape(full, requests, 1), 100, max_rows=64) == 0


def test_bad_requests_are_named_before_anything_runs(model: Decoder):
    batcher = ContinuousBatcher(Engine(model, length_buckets=BUCKETS), rows=2)
    cases = [
        (SequenceRequest([1] * 40, 4), "request 1: .*largest length bucket 32"),
        (SequenceRequest([1, 2], 0), "request 1: max_new_tokens=0"),
        (SequenceRequest([1, 999], 4), r"request 1: prompt token ids must be in \[0, 256\)"),
        (SequenceRequest([1, 2], 4, roles=[0]), "request 1: 1 roles for 2 prompt tokens"),
    ]
    for bad, message in cases:
        with pytest.raises(ValueError, match=message):
            next(batcher.run([SequenceRequest([1, 2], 4), bad]))
    with pytest.raises(ValueError, match="rows=0"):
        ContinuousBatcher(batcher.engine, rows=0)


def test_admitted_requests_are_prefilled_longest_first_in_power_of_two_groups():
    lengths = [5, 9, 3, 7, 1, 8]
    assert admission_chunks(lengths) == [[1, 5, 3, 0], [2, 4]]  # 6 -> 4 + 2, no empty padding rows
    assert admission_chunks(lengths[:5]) == [[1, 3, 0, 2], [4]]
    assert admission_chunks(lengths, data_size=8) == [[1, 5, 3, 0, 2, 4]]  # a mesh pads any group to 8 rows
    assert admission_chunks(lengths[:5], data_size=2) == [[1, 3, 0, 2], [4]]
    assert admission_chunks(lengths, max_rows=1) == [[1], [5], [3], [0], [2], [4]]
    assert admission_chunks(lengths, max_rows=3) == [[1, 5], [3, 0], [2, 4]]
    assert admission_chunks(lengths, data_size=2, max_rows=1) == [[1, 5], [3, 0], [2, 4]]
    assert admission_chunks([]) == []


def test_static_batches_share_sampling_and_constrainedness_and_are_length_sorted():
    greedy, hot = SamplingConfig(), SamplingConfig(temperature=0.7, seed=1)
    shapes = [(5, greedy, False), (2, greedy, False), (3, hot, False), (1, greedy, True), (4, greedy, False)]
    jobs = [Job([1] * n, 4, s, c) for n, s, c in shapes] + [Job([1] * 9, 4, SamplingConfig(seed=5))]  # greedy: any seed
    assert sampling_groups(jobs) == [[0, 1, 3, 4, 5], [2]]
    assert micro_batches(jobs, max_batch=2) == [[1, 4], [0, 5], [2], [3]]
    unbuilt = Scheduler(lambda: pytest.fail("no memory limit: the engine is not needed"), "static", max_batch=2)
    assert unbuilt.micro_batches(jobs) == [[1, 4], [0, 5], [2], [3]]
    with pytest.raises(ValueError, match="unknown scheduler 'paged'"):
        Scheduler(engine=lambda: None, mode="paged")


def test_static_and_continuous_scheduling_agree_and_refuse_a_request_past_the_memory(model: Decoder):
    engine = Engine(model, length_buckets=BUCKETS)
    reference = engine.generate(PROMPTS, SamplingConfig(max_new_tokens=6))
    jobs = [Job(p, 6, roles=[0] * len(p)) for p in PROMPTS]
    for mode in Scheduler.MODES:
        out = {}
        for indices, generations, _ in Scheduler(engine, mode, max_batch=2).run(jobs, lambda indices: None):
            out.update(zip(indices, generations, strict=True))
        assert [out[i].tokens for i in range(len(PROMPTS))] == [g.tokens for g in reference], mode
    for mode in Scheduler.MODES:
        results = [r for _, rs, _ in Scheduler(engine, mode, kv_memory_bytes=16).run(jobs, lambda i: None) for r in rs]
        assert len(results) == len(jobs) and all(isinstance(r, MemoryLimitError) for r in results)
