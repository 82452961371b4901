"""The shared matrix (kvpress style): one list of method instances through the same invariants on a tiny model.

A case is a method instance built for the budget it runs at (PASK's policy tables are per budget), so variants of one
method (a small SnapKV window, DapQ's content choices, PASK with a synthetic policy or DapQ ranking) are cases too.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest
from conftest import synthetic_stats
from flax import nnx

from pask_jax.calibration.compiler import compile_policy
from pask_jax.engine import Engine, SamplingConfig, generate_shared
from pask_jax.methods import METHODS, DapQ, KVMethod, PaskKV, PyramidKV, SnapKV
from pask_jax.models.qwen3 import ModelConfig, Qwen3
from pask_jax.scheduler import ContinuousBatcher, SequenceRequest
from pask_jax.structure.roles import Role

PROMPTS = [list(range(3, 40)), [7, 7, 120, 5, 9, 11, 13, 2, 2, 8, 100, 101], list(range(50, 75))]
NEW = 20
BUCKETS = (16, 64)
ROLES = [[Role.SINK] + [Role.DESCRIPTION if i % 3 else Role.USER_TEXT for i in range(1, len(p))] for p in PROMPTS]


@pytest.fixture(scope="module")
def model() -> Qwen3:
    return Qwen3(ModelConfig.tiny("qwen3", num_layers=4, vocab_size=256), rngs=nnx.Rngs(5))


@pytest.fixture(scope="module")
def full_tokens(model: Qwen3) -> list[list[int]]:
    gens = Engine(model, length_buckets=BUCKETS).generate(PROMPTS, SamplingConfig(max_new_tokens=NEW))
    return [g.tokens for g in gens]


BUDGETS = (0.3, 0.4, 0.5, 1.0)  # every budget a test below runs at
SYNTHETIC_POLICY = compile_policy(synthetic_stats(num_layers=4, groups=2), list(BUDGETS))

CASES: dict[str, Callable[[float], KVMethod]] = {
    **{name: (lambda budget, cls=cls: cls()) for name, cls in METHODS.items()},
    "snapkv_window8_avg": lambda budget: SnapKV(window=8, pooling="avg"),
    "pyramidkv_window4": lambda budget: PyramidKV(window=4),
    "pyramidkv_window_inside": lambda budget: PyramidKV(window=4, allotment="pyramid"),
    "dapq_last": lambda budget: DapQ(content="last", num_pseudo=8),
    "dapq_random": lambda budget: DapQ(content="random", num_pseudo=8),
    "dapq_max_pooled": lambda budget: DapQ(num_pseudo=8, pooling="max"),
    "pask_policy": lambda budget: PaskKV.from_policy(SYNTHETIC_POLICY, budget),
    "pask_policy_dapq_rank": lambda budget: PaskKV.from_policy(SYNTHETIC_POLICY, budget, rank="dapq"),
    "pask_policy_v1": lambda budget: PaskKV.from_policy(
        SYNTHETIC_POLICY, budget, rank="recency", system_as_request=False
    ),
}


def make(model: Qwen3, case: str, budget: float) -> Engine:
    return Engine(model, method=CASES[case](budget), budget=budget, num_groups=2, length_buckets=BUCKETS)


@pytest.mark.parametrize("name", sorted(CASES))
def test_running_cap_holds_at_every_step(model: Qwen3, name: str):
    budget = 1.0 if name == "full" else 0.3
    gens = make(model, name, budget).generate(PROMPTS, SamplingConfig(max_new_tokens=NEW), prompt_roles=ROLES)
    for prompt, gen in zip(PROMPTS, gens, strict=True):
        assert len(gen.stats.kept_ratios) == gen.stats.generated_tokens  # prefill + every step but the last token
        for t, ratio in enumerate(gen.stats.kept_ratios):
            full_tokens = len(prompt) + t
            # the slack: at most one entry per (layer, head) beyond b * full(t) (the prefill keeps at least one)
            assert ratio <= budget + 1.0 / full_tokens + 1e-9, (t, ratio)
        if name != "full":
            assert gen.stats.kept_ratio_mean < budget + 0.05


@pytest.mark.parametrize("name", sorted(CASES))
def test_budget_one_reproduces_full_kv(model: Qwen3, full_tokens: list[list[int]], name: str):
    gens = make(model, name, 1.0).generate(PROMPTS, SamplingConfig(max_new_tokens=NEW), prompt_roles=ROLES)
    assert [g.tokens for g in gens] == full_tokens


@pytest.mark.parametrize("name", sorted(CASES))
def test_deterministic_and_batch_equals_single(model: Qwen3, name: str):
    engine = make(model, name, 0.4)
    first = [g.tokens for g in engine.generate(PROMPTS, SamplingConfig(max_new_tokens=NEW), prompt_roles=ROLES)]
    again = [g.tokens for g in engine.generate(PROMPTS, SamplingConfig(max_new_tokens=NEW), prompt_roles=ROLES)]
    assert first == again
    single = [
        engine.generate([p], SamplingConfig(max_new_tokens=NEW), prompt_roles=[r])[0].tokens
        for p, r in zip(PROMPTS[:2], ROLES, strict=False)
    ]
    assert single == first[:2]


@pytest.mark.parametrize("name", sorted(CASES))
def test_continuous_batching_equals_static(model: Qwen3, name: str):
    """Five requests with their own token limits through four cache rows (one ends at its first token, its row takes
    the fifth request mid-run) give static batching's greedy tokens and kept ratios, each cut at its limit.
    (The static run and the four-row shapes are those of the test above: its compiled steps are reused.)"""
    engine = make(model, name, 0.4)
    static = engine.generate(PROMPTS, SamplingConfig(max_new_tokens=NEW), prompt_roles=ROLES)
    which, limits = [0, 1, 2, 0, 1], [NEW, 3, 9, 1, 14]
    requests = [SequenceRequest(PROMPTS[k], n, ROLES[k]) for k, n in zip(which, limits, strict=True)]
    continuous = dict(ContinuousBatcher(engine, rows=4).run(requests))
    assert sorted(continuous) == list(range(len(requests)))
    for i, (k, limit) in enumerate(zip(which, limits, strict=True)):
        assert continuous[i].tokens == static[k].tokens[:limit], (i, limit)
        assert continuous[i].stats.kept_ratios == static[k].stats.kept_ratios[:limit], i
        assert continuous[i].finish_reason == "length"


@pytest.mark.parametrize("name", sorted(CASES))
def test_prefill_keeps_unique_valid_entries(model: Qwen3, name: str):
    engine = make(model, name, 0.5)
    lengths = np.array([len(p) for p in PROMPTS[:2]] + [1, 1], np.int32)
    tokens = np.zeros((4, 64), np.int32)
    for i, p in enumerate(PROMPTS[:2]):
        tokens[i, : len(p)] = p
    _, caches, _ = engine.prefill(tokens, lengths, np.zeros_like(tokens), engine.capacities(64, 64))
    for (start, _), cache in zip(engine.plan.groups, caches, strict=True):
        pos, length, table = np.asarray(cache.pos), np.asarray(cache.length), np.asarray(cache.table)
        for idx in np.ndindex(length.shape):
            live = pos[idx][table[idx][: length[idx]]]
            assert len(set(live)) == len(live), "kept entries must be unique"
            assert (live >= 0).all() and (live < lengths[idx[1]]).all(), "kept entries must be real prompt tokens"
            quota = max(int(np.floor(engine.plan.allowance(start + idx[0], lengths[idx[1]]))), 1)
            assert length[idx] == min(quota, cache.capacity)


def test_shared_prefill_equals_separate_engines(model: Qwen3):
    """A sweep's shared prefill (one forward, every method's own fill) gives each engine its own tokens and caps."""
    engines = [make(model, name, 0.4) for name in sorted(CASES)]
    shared = generate_shared(engines, PROMPTS, SamplingConfig(max_new_tokens=NEW), prompt_roles=ROLES)
    for engine, gens in zip(engines, shared, strict=True):
        alone = engine.generate(PROMPTS, SamplingConfig(max_new_tokens=NEW), prompt_roles=ROLES)
        assert [g.tokens for g in gens] == [g.tokens for g in alone], engine.method.name
        assert [g.stats.kept_ratios for g in gens] == [g.stats.kept_ratios for g in alone], engine.method.name


def test_shared_prefill_refuses_engines_of_different_models(model: Qwen3):
    other = Qwen3(ModelConfig.tiny("qwen3", num_layers=4, vocab_size=256), rngs=nnx.Rngs(6))
    engines = [make(model, "full", 1.0), Engine(other, length_buckets=BUCKETS)]
    with pytest.raises(ValueError, match="same model"):
        generate_shared(engines, PROMPTS, SamplingConfig(max_new_tokens=4))
    with pytest.raises(ValueError, match="one per engine"):
        generate_shared(engines[:1], PROMPTS, constraints=[None, None])


def test_pask_without_any_roles_is_an_error(model: Qwen3):
    engine = make(model, "pask_policy", 0.4)
    with pytest.raises(ValueError, match="decides by token roles"):
        engine.generate(PROMPTS, SamplingConfig(max_new_tokens=4))
    make(model, "snapkv", 0.4).generate(PROMPTS[:1], SamplingConfig(max_new_tokens=2))  # others need none
