"""Ragged KV cache invariants: fill, write, evict keep `table` a permutation with the live slots first."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pask_jax.attention import decode_attention, pool_attention
from pask_jax.cache import GroupCache
from pask_jax.kernels import ref_gather_attention
from pask_jax.layers import layer_groups
from pask_jax.methods.base import budget_capacity

B, K, C, H = 2, 3, 8, 4


def check_invariants(cache: GroupCache) -> None:
    table, length, pos = np.asarray(cache.table), np.asarray(cache.length), np.asarray(cache.pos)
    for idx in np.ndindex(length.shape):
        assert sorted(table[idx]) == list(range(C)), "table must stay a permutation of the slots"
        live = set(table[idx][: length[idx]])
        assert live == set(np.flatnonzero(pos[idx] >= 0)), "live slots are exactly those with a position"


def test_layer_groups_are_consecutive_and_cover_all_layers():
    assert layer_groups(24, 4) == ((0, 6), (6, 12), (12, 18), (18, 24))
    assert layer_groups(30, 4) == ((0, 8), (8, 16), (16, 23), (23, 30))
    with pytest.raises(ValueError, match="num_groups=5"):
        layer_groups(4, 5)


def test_fill_write_evict_roundtrip():
    rng = np.random.default_rng(0)
    cache = GroupCache.empty(1, B, K, C, H, jnp.float32)
    prompt_k = jnp.asarray(rng.normal(size=(B, 5, K, H)), jnp.float32)
    positions = jnp.broadcast_to(jnp.arange(5), (B, 5))
    keep = jnp.asarray(np.tile([4, 1, 3, 0], (B, K, 1)), jnp.int32)
    count = jnp.asarray([[4, 2, 0], [3, 3, 3]], jnp.int32)
    cache = cache.fill(0, prompt_k, prompt_k, positions, positions * 10, keep, count)
    check_invariants(cache)
    np.testing.assert_array_equal(cache.length[0], count)
    np.testing.assert_array_equal(cache.pos[0, 0, 0, :4], [4, 1, 3, 0])
    np.testing.assert_array_equal(cache.role[0, 1, 2, :3], [40, 10, 30])
    np.testing.assert_allclose(cache.k.codes[0, 1, 0, 2], prompt_k[1, 3, 0])

    enter = jnp.asarray([[True, False, True], [True, True, True]])
    new = jnp.ones((B, K, H))
    cache = cache.write(0, new, new, jnp.asarray([5, 5]), jnp.asarray([7, 7]), enter)
    check_invariants(cache)
    np.testing.assert_array_equal(cache.length[0], [[5, 2, 1], [4, 4, 4]])
    assert int(cache.pos[0, 0, 0, 4]) == 5 and int(cache.role[0, 0, 0, 4]) == 7

    # Evict slot 1 of (0, 0) and slot 0 of (1, 2); leave the others.
    slot = jnp.asarray([[1, 0, 0], [0, 0, 0]])
    do = jnp.asarray([[True, False, False], [False, False, True]])
    cache = cache.evict(0, slot, do)
    check_invariants(cache)
    np.testing.assert_array_equal(cache.length[0], [[4, 2, 1], [4, 4, 3]])
    assert int(cache.pos[0, 0, 0, 1]) == -1 and int(cache.pos[0, 1, 2, 0]) == -1
    # A freed slot is the next one written.
    cache = cache.write(0, new * 2, new, jnp.asarray([6, 6]), jnp.asarray([0, 0]), jnp.ones((B, K), bool))
    check_invariants(cache)
    assert int(cache.pos[0, 0, 0, 1]) == 6 and int(cache.pos[0, 1, 2, 0]) == 6
    assert not bool(cache.overflow)


def test_insert_rows_replaces_only_the_named_rows():
    rng = np.random.default_rng(1)
    big = GroupCache.empty(2, 4, K, C, H, jnp.float32)
    big = big.write(0, *(jnp.ones((4, K, H)),) * 2, jnp.arange(4), jnp.zeros(4, jnp.int32), jnp.ones((4, K), bool))
    small = GroupCache.empty(2, 2, K, C, H, jnp.float32)
    values = jnp.asarray(rng.normal(size=(2, K, H)), jnp.float32)
    small = small.write(1, values, values, jnp.array([7, 9]), jnp.array([3, 4]), jnp.ones((2, K), bool))
    out = big.insert_rows(small, jnp.array([2, 4]))  # row 4 is past the batch: skipped (a padding row)
    for name in ("k", "v", "pos", "role", "score", "table", "length"):
        got, before, fresh = (np.asarray(jax.tree.leaves(getattr(c, name))[0]) for c in (out, big, small))
        np.testing.assert_array_equal(got[:, 2], fresh[:, 0], err_msg=name)
        np.testing.assert_array_equal(got[:, [0, 1, 3]], before[:, [0, 1, 3]], err_msg=name)
    check_invariants(out)
    with pytest.raises(ValueError, match="cannot insert rows"):
        big.insert_rows(GroupCache.empty(2, 2, K, C + 1, H, jnp.float32), jnp.array([0, 1]))


def test_overflow_is_flagged_not_silent():
    cache = GroupCache.empty(1, 1, 1, 2, H, jnp.float32)
    one = jnp.ones((1, 1, H))
    for p in range(3):
        cache = cache.write(0, one, one, jnp.asarray([p]), jnp.asarray([0]), jnp.ones((1, 1), bool))
    assert bool(cache.overflow) and int(cache.length[0, 0, 0]) == 2


def test_pool_attention_equals_gathered_reference_after_evictions():
    rng = np.random.default_rng(1)
    cache = GroupCache.empty(1, B, K, C, H, jnp.float32)
    step = jax.jit(GroupCache.write, static_argnums=1)
    for p in range(C):
        kv = jnp.asarray(rng.normal(size=(B, K, H)), jnp.float32)
        cache = step(cache, 0, kv, kv * 2, jnp.full((B,), p), jnp.zeros((B,), jnp.int32), jnp.ones((B, K), bool))
    cache = cache.evict(0, jnp.asarray(rng.integers(0, C, (B, K))), jnp.ones((B, K), bool))
    q = jnp.asarray(rng.normal(size=(B, K, 2, H)), jnp.float32)
    k, v = cache.k.codes[0], cache.v.codes[0]  # full precision: the codes are the values
    pool = pool_attention(q, k, v, cache.pos[0] >= 0)
    gathered = ref_gather_attention(q, k, v, cache.table[0], cache.length[0])
    np.testing.assert_allclose(pool, gathered, atol=1e-5)
    heads = q.reshape(B, K * 2, H)  # decode attention takes the query heads flat, G consecutive per KV head
    xla = decode_attention(heads, cache, 0)
    np.testing.assert_array_equal(xla, pool.reshape(B, K * 2, H))  # the XLA path is the pool
    kernel = decode_attention(heads, cache, 0, use_kernel=True)  # the Pallas kernel, interpreted here
    np.testing.assert_allclose(kernel, gathered.reshape(B, K * 2, H), atol=1e-5)


def test_budget_capacity():
    assert budget_capacity(1000, 24, 1.0) == 1024 + 1
    assert budget_capacity(1000, 24, 0.33) == 338 + 1  # ceil(0.33 * 1024) + the token being written
    with pytest.raises(ValueError, match="budget=0"):
        budget_capacity(10, 10, 0.0)
