"""The shared matrix (kvpress style): one list of method instances through the same invariants on a tiny model.

A case is a method instance built for the budget it runs at (PASK's policy tables are per budget), so variants of one
method (a small SnapKV window, DapQ's content choices, PASK with a synthetic policy or DapQ ranking) are cases too.
Every compressed invariant runs at one budget (`BUDGET`), so the tests of a case share its engine, its compiled steps
and its static generation of PROMPTS (the `matrix` fixture); budget 1 is the second plan of a case.
The golden record at the end holds every case to the tokens and kept entries it gave when it was recorded.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from pathlib import Path

import numpy as np
import pytest
from flax import nnx
from support import BUCKETS, BUDGET, CASES, NEW, PROMPTS, ROLES, Matrix

from pask_jax.experiments.sweep import generate_shared
from pask_jax.methods import METHODS
from pask_jax.models.decoder import Decoder, ModelConfig
from pask_jax.runtime.engine import Engine
from pask_jax.runtime.prefill import prefill_jit as _prefill
from pask_jax.runtime.sampling import SamplingConfig
from pask_jax.runtime.scheduler import ContinuousBatcher, SequenceRequest
from pask_jax.runtime.shapes import DEFAULT_LENGTH_BUCKETS, prefill_chunks

NAMES = sorted(CASES)
# One case per distinct prompt statistic and fill (every method at its defaults, the block pools, PASK's window query
# and its precision actions): the tests over shared and chunked prefills, whose cost is a prefill compile per case.
PREFILL_NAMES = sorted(
    {n for n in CASES if n in METHODS}
    | {
        "kivi_group8",
        "triaxialkv_group8",
        "pask_policy_dapq_rank_both_queries",
        "pask_actions",
        "pask_actions_two_pools",
    }
)
# Variants that differ from their method only in how entries are scored or shared out (pooling, windows, pseudo-query
# content, PASK's ranks): they run the tests at the matrix's budget, on its static generation (the cap, the kept
# entries, the golden record); the tests that compile engines of their own (budget 1, a single row, continuous
# batching) run on every method and storage case.
SCORING_VARIANTS = {
    "snapkv_window8_avg",
    "pyramidkv_window4",
    "pyramidkv_window_inside",
    "dapq_last",
    "dapq_max_pooled",
    "pask_policy_v1",
    "pask_policy_dapq_rank_both_queries",
}
ENGINE_NAMES = [name for name in NAMES if name not in SCORING_VARIANTS]
pytestmark = pytest.mark.usefixtures("quick_compiles")  # thousands of small compiles, each run once or twice


@pytest.fixture(scope="module")
def full_tokens(matrix: Matrix) -> list[list[int]]:
    """Full KV through an engine of its own (default groups: one per layer), no roles."""
    gens = Engine(matrix.model, length_buckets=BUCKETS).generate(PROMPTS, SamplingConfig(max_new_tokens=NEW))
    return [g.tokens for g in gens]


@pytest.mark.parametrize("name", NAMES)
def test_running_cap_holds_at_every_step(matrix: Matrix, name: str):
    """The cap is in bytes (metadata counted): held bytes <= b * full bf16 bytes after every step, the slack one slot
    entry per (layer, head) (the token being written; the prefill keeps at least one). At budget 1 nothing leaves."""
    budget = 1.0 if name == "full" else BUDGET
    bytes_ = matrix.engine(name, budget).plan.bytes
    slack = bytes_.slot_bytes / bytes_.full_bytes
    for prompt, gen in zip(PROMPTS, matrix.static(name, budget), strict=True):
        stats = gen.stats
        assert stats.generated_tokens == NEW  # every request runs to its limit: every step is checked
        assert len(stats.kept_ratios) == len(stats.kv_bytes_ratios) == NEW  # prefill + every step but the last
        for t, (entries, held) in enumerate(zip(stats.kept_ratios, stats.kv_bytes_ratios, strict=True)):
            if budget == 1.0:
                assert entries == 1.0, (t, entries)
            else:
                assert held <= budget + slack / (len(prompt) + t) + 1e-9, (t, held)
        if name != "full":
            assert stats.kv_bytes_ratio_mean < budget + 0.05


@pytest.mark.parametrize("name", ENGINE_NAMES)
def test_budget_one_reproduces_full_kv(matrix: Matrix, full_tokens: list[list[int]], name: str):
    """At budget 1 every entry stays: a lossless cache gives full KV's tokens, a quantized one keeps every entry."""
    gens = matrix.static(name, 1.0)
    if matrix.engine(name, 1.0).storage.lossless:
        assert [g.tokens for g in gens] == full_tokens
    else:
        assert all(ratio == 1.0 for g in gens for ratio in g.stats.kept_ratios)


@pytest.mark.parametrize("name", ENGINE_NAMES)
def test_deterministic_and_batch_equals_single(matrix: Matrix, name: str):
    """A rerun gives the same tokens; so does every prompt in other rows beside other prompts (the same shapes), and
    the shortest prompt alone: one row, its own length bucket (16, not the batch's 64) and capacities."""
    engine, first = matrix.engine(name, BUDGET), [g.tokens for g in matrix.static(name, BUDGET)]
    sampling = SamplingConfig(max_new_tokens=NEW)
    again = [g.tokens for g in engine.generate(PROMPTS, sampling, prompt_roles=ROLES)]
    assert first == again
    moved = [1, 2, 0]  # every prompt in another row
    rotated = engine.generate([PROMPTS[k] for k in moved], sampling, prompt_roles=[ROLES[k] for k in moved])
    assert [g.tokens for g in rotated] == [first[k] for k in moved]
    (single,) = engine.generate(PROMPTS[1:2], sampling, prompt_roles=ROLES[1:2])
    assert single.tokens == first[1]


@pytest.mark.parametrize("name", ENGINE_NAMES)
def test_continuous_batching_equals_static(matrix: Matrix, name: str):
    """Five requests with their own token limits through four cache rows (one ends at its first token, its row takes
    the fifth request mid-run) give static batching's greedy tokens and kept ratios, each cut at its limit.
    (The static run and the four-row shapes are those of the matrix's static generation: its steps are reused.)"""
    engine, static = matrix.engine(name, BUDGET), matrix.static(name, BUDGET)
    which, limits = [0, 1, 2, 0, 1], [NEW, 3, 9, 1, 14]
    requests = [SequenceRequest(PROMPTS[k], n, ROLES[k]) for k, n in zip(which, limits, strict=True)]
    continuous = dict(ContinuousBatcher(engine, rows=4).run(requests))
    assert sorted(continuous) == list(range(len(requests)))
    for i, (k, limit) in enumerate(zip(which, limits, strict=True)):
        assert continuous[i].tokens == static[k].tokens[:limit], (i, limit)
        assert continuous[i].stats.kept_ratios == static[k].stats.kept_ratios[:limit], i
        assert continuous[i].finish_reason == "length"


@pytest.mark.parametrize("name", NAMES)
def test_prefill_keeps_unique_valid_entries(matrix: Matrix, name: str):
    """(Four rows, the 64 bucket, capacities for 64 new tokens: the static generation's prefill, compiled once.)"""
    engine = matrix.engine(name, BUDGET)
    lengths = np.array([len(p) for p in PROMPTS[:2]] + [1, 1], np.int32)
    tokens = np.zeros((4, 64), np.int32)
    for i, p in enumerate(PROMPTS[:2]):
        tokens[i, : len(p)] = p
    _, caches, _ = engine.prefill(tokens, lengths, np.zeros_like(tokens), engine.capacities(64, 64))
    by_age = engine.method.prefill_high(0, np.zeros((1, 1, 1), np.float32), np.ones((1, 1), bool)) is None
    block = engine.storage.block
    for (start, _), cache in zip(engine.plan.groups, caches, strict=True):
        pos, length, table = np.asarray(cache.pos), np.asarray(cache.length), np.asarray(cache.table)
        role = np.asarray(cache.role, np.int32)
        pool_of = np.stack([engine.method.block_pool(start + li, r) for li, r in enumerate(role)])  # each slot's pool
        block_pos = [np.asarray(pool.pos) for pool in cache.block_pools]  # dead and free entries: -1
        room = cache.capacity + sum(pool.blocks * pool.block for pool in cache.block_pools)
        for idx in np.ndindex(length.shape):
            live = pos[idx][table[idx][: length[idx]]]
            live_pools = pool_of[idx][table[idx][: length[idx]]]
            in_blocks = [p[idx][p[idx] >= 0] for p in block_pos]
            if by_age and block_pos:  # each pool's oldest whole blocks in its blocks, the newer rest in slots
                for p, in_pool in enumerate(in_blocks):
                    mine = live[live_pools == p]
                    assert len(mine) < block
                    assert len(mine) == 0 or in_pool.max(initial=-1) < mine.min()
            elif block_pos:  # the window of full-precision entries and a block's remainder
                assert len(live) < engine.storage.window + block
            live = np.concatenate([*in_blocks, live])
            assert len(set(live)) == len(live), "kept entries must be unique"
            assert (live >= 0).all() and (live < lengths[idx[1]]).all(), "kept entries must be real prompt tokens"
            allowance = engine.plan.allowance(start + idx[0], lengths[idx[1]])  # bf16 entries; the bytes decide
            # (a method's full-precision entries, or two pools' blocks, change what the bytes pay for: the cap test
            # checks it, and tests/runtime/test_storage.py the count of two pools)
            if by_age and len(block_pos) < 2:
                quota = max(int(engine.plan.bytes.prefill_count(allowance, lengths[idx[1]])), 1)
                assert len(live) == min(quota, room)


def test_chunked_prefill_keeps_what_one_pass_keeps(matrix: Matrix):
    """The 64 bucket prefilled in four chunks of 16 (every case in one shared pass, as a sweep runs it) keeps the
    entries one pass keeps, with their scores, and gives the same last-token logits: every method's prompt statistic
    is a sum over queries (attention mass) or a function of positions, roles and the finished prompt."""
    plans = tuple(matrix.engine(name, BUDGET).plan for name in PREFILL_NAMES)
    chunked = tuple(dataclasses.replace(plan, prefill_chunk=16) for plan in plans)
    assert prefill_chunks(64, 16) == 4
    tokens, roles = np.zeros((4, 64), np.int32), np.zeros((4, 64), np.int32)
    lengths = np.ones(4, np.int32)
    for i, (prompt, prompt_roles) in enumerate(zip(PROMPTS, ROLES, strict=True)):
        tokens[i, : len(prompt)], roles[i, : len(prompt)], lengths[i] = prompt, prompt_roles, len(prompt)
    tools = np.full_like(tokens, -1)
    capacities = tuple(matrix.engine(name, BUDGET).capacities(64, 64) for name in PREFILL_NAMES)
    params = matrix.engine(PREFILL_NAMES[0], BUDGET).params
    whole_logits, whole = _prefill(plans, params, tokens, lengths, roles, tools, capacities)
    chunk_logits, chunks = _prefill(chunked, params, tokens, lengths, roles, tools, capacities)
    np.testing.assert_allclose(np.asarray(chunk_logits), np.asarray(whole_logits), rtol=1e-5, atol=1e-5)
    for name, (one_pass, _), (in_chunks, _) in zip(PREFILL_NAMES, whole, chunks, strict=True):
        for a, b in zip(one_pass, in_chunks, strict=True):
            np.testing.assert_array_equal(np.asarray(a.length), np.asarray(b.length), err_msg=name)
            live = np.arange(a.capacity) < np.asarray(a.length)[..., None]
            slots_a, slots_b = np.asarray(a.table), np.asarray(b.table)
            pos_a = np.where(live, np.take_along_axis(np.asarray(a.pos), slots_a, -1), -1)
            pos_b = np.where(live, np.take_along_axis(np.asarray(b.pos), slots_b, -1), -1)
            np.testing.assert_array_equal(np.sort(pos_a, -1), np.sort(pos_b, -1), err_msg=name)
            score_a = np.take_along_axis(np.asarray(a.score), np.argsort(np.asarray(a.pos), -1), -1)
            score_b = np.take_along_axis(np.asarray(b.score), np.argsort(np.asarray(b.pos), -1), -1)
            np.testing.assert_allclose(score_b, score_a, rtol=1e-5, atol=1e-6, err_msg=name)


def test_prefill_chunks_split_every_default_bucket_evenly():
    for bucket in DEFAULT_LENGTH_BUCKETS:
        n = prefill_chunks(bucket, 2048)
        assert bucket % n == 0 and bucket // n <= 2048 and (n == 1 or bucket // n >= 1024), bucket


def test_shared_prefill_equals_separate_engines(matrix: Matrix):
    """A sweep's shared prefill (one forward, every method's own fill) gives each engine its own tokens and caps."""
    engines = [matrix.engine(name, BUDGET) for name in PREFILL_NAMES]
    shared = generate_shared(engines, PROMPTS, SamplingConfig(max_new_tokens=NEW), prompt_roles=ROLES)
    for name, engine, gens in zip(PREFILL_NAMES, engines, shared, strict=True):
        alone = matrix.static(name, BUDGET)
        assert [g.tokens for g in gens] == [g.tokens for g in alone], engine.method.name
        assert [g.stats.kept_ratios for g in gens] == [g.stats.kept_ratios for g in alone], engine.method.name


def test_shared_prefill_refuses_engines_of_different_models(matrix: Matrix):
    other = Decoder(ModelConfig.tiny("qwen3", num_layers=4, vocab_size=256), rngs=nnx.Rngs(6))
    engines = [matrix.engine("full", 1.0), Engine(other, length_buckets=BUCKETS)]
    with pytest.raises(ValueError, match="same model"):
        generate_shared(engines, PROMPTS, SamplingConfig(max_new_tokens=4))
    with pytest.raises(ValueError, match="one per engine"):
        generate_shared(engines[:1], PROMPTS, constraints=[None, None])


def test_pask_without_any_roles_is_an_error(matrix: Matrix):
    engine = matrix.engine("pask_policy", BUDGET)
    with pytest.raises(ValueError, match="decides by token roles"):
        engine.generate(PROMPTS, SamplingConfig(max_new_tokens=4))
    matrix.engine("snapkv", BUDGET).generate(PROMPTS[:1], SamplingConfig(max_new_tokens=2))  # others need none


# ---- golden record: greedy tokens, the prompt entries kept after prefill, the kept ratio after every step, exactly as
# recorded; a deliberate change of behaviour re-records them (PASK_JAX_RECORD_GOLDEN=1 pytest -k golden) and says why
# in its commit

GOLDEN = Path(__file__).resolve().parents[1] / "data" / "golden_matrix.json"
RECORD = os.environ.get("PASK_JAX_RECORD_GOLDEN") == "1"


def kept_positions_digest(matrix: Matrix, case: str) -> str:
    """sha256 of the sorted original positions each (layer, row, KV head) keeps after prefill."""
    engine = matrix.engine(case, BUDGET)
    shape = engine.batch_shape([len(p) for p in PROMPTS], NEW)
    tokens, lengths, roles = shape.pad(PROMPTS, ROLES)
    _, caches, _ = engine.prefill(tokens, lengths, roles, shape.capacities)
    kept = [np.sort(np.asarray(cache.pos), axis=-1)[:, : len(PROMPTS)] for cache in caches]
    return hashlib.sha256(b"".join(k.tobytes() for k in kept)).hexdigest()


def record(matrix: Matrix, case: str) -> dict:
    gens = matrix.static(case, BUDGET)
    return {
        "tokens": [g.tokens for g in gens],
        "kept_ratios": [[round(r, 12) for r in g.stats.kept_ratios] for g in gens],
        "prefill_kept_positions": kept_positions_digest(matrix, case),
    }


@pytest.fixture(scope="module")
def golden() -> dict:
    if RECORD:
        return {}
    if not GOLDEN.exists():
        pytest.fail(f"{GOLDEN} is missing: record it with PASK_JAX_RECORD_GOLDEN=1")
    return json.loads(GOLDEN.read_text())


@pytest.mark.parametrize("case", NAMES)
def test_matrix_matches_the_golden_record(matrix: Matrix, golden: dict, case: str):
    got = record(matrix, case)
    if RECORD:
        saved = json.loads(GOLDEN.read_text()) if GOLDEN.exists() else {}
        GOLDEN.write_text(json.dumps({**saved, case: got}, indent=1, sort_keys=True) + "\n")
        return
    assert case in golden, f"no golden record for {case!r}: record it with PASK_JAX_RECORD_GOLDEN=1"
    assert got == golden[case]
