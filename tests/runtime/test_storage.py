"""Quantized storage and the byte budget: what an entry costs, the block pool's invariants, a quantized slot pool,
the window going down a block, attention over both pools, and the method specs that choose a storage."""

from __future__ import annotations

import argparse
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from pask_jax.arguments import LOW_STORAGE_NAMES, STORAGE_NAMES, method_spec
from pask_jax.attention import decode_attention
from pask_jax.cache import GroupCache
from pask_jax.factory import make_engine, resolve_spec
from pask_jax.kernels.quantize import FP8, INT8, PRESETS, KVFormat, dequantize, quantize
from pask_jax.methods import KIVI
from pask_jax.models.decoder import Decoder, ModelConfig
from pask_jax.runtime.budget import ByteBudget
from pask_jax.runtime.sampling import SamplingConfig
from pask_jax.storage import BLOCK_FORMATS, Storage, full_entry_bytes

B, K, H, T = 2, 2, 16, 4  # rows, KV heads, head_dim, block length
KIVI2 = (KVFormat(2, "int", "channel", T), KVFormat(2, "int", "token", H))


def test_entry_bytes_at_head_dim_64():
    # reference 256 = 2 x 64 x 2; slot metadata 13 = pos 2 (i16) + role 1 + tool 2 + score 4 + table 4
    assert full_entry_bytes(64) == 256
    assert Storage().slot_entry_bytes(64) == 256 + 13
    assert Storage(slots=INT8).slot_entry_bytes(64) == 2 * 66 + 13
    assert Storage(slots=FP8).slot_entry_bytes(64) == 2 * 66 + 13
    assert Storage(slots=PRESETS["int4"][0]).slot_entry_bytes(64) == 2 * 40 + 13
    assert Storage(positions=4).slot_entry_bytes(64) == 256 + 15  # i32 positions, for sequences past 32,768
    # a block entry: key and value codes + their share of the f16 scales and zeros, pos 2 + role 1, table 4 / block
    assert Storage(blocks=PRESETS["kivi2"]).block_entry_bytes(64) == 24 + 24 + 3 + 4 / 32
    assert Storage(blocks=PRESETS["kivi4"]).block_entry_bytes(64) == 40 + 40 + 3 + 4 / 32
    # so a 4-bit entry fits b = 0.33 (0.3247 of bf16) and a 2-bit one b = 0.2 (0.1997): KIVI's widest choice
    assert KIVI().widest_bits(0.33, 64) == 4 and KIVI().widest_bits(0.2, 64) == 2


@pytest.mark.parametrize("positions", [2, 4])
def test_stored_positions_take_the_bytes_the_budget_counts(positions: int):
    storage = dataclasses.replace(TWO_POOLS, positions=positions)
    cache = GroupCache.empty(1, B, K, 8, H, jnp.float32, storage=storage, blocks=2)
    for pos in (cache.pos, *(pool.pos for pool in cache.block_pools)):
        assert pos.dtype.itemsize == positions
    cache = cache.write(
        0,
        jnp.ones((B, K, H)),
        jnp.ones((B, K, H)),
        jnp.full(B, 32_767),
        jnp.zeros(B, jnp.int32),
        jnp.ones((B, K), bool),
    )
    assert int(cache.pos[0, 0, 0, 0]) == 32_767  # the last position an i16 holds


def test_the_engine_widens_positions_past_32768_and_refuses_what_they_cannot_hold(wide_model: Decoder):
    engine = make_engine(wide_model, "full", budget=1.0)
    assert engine.storage.positions == 2 and engine.storage.max_positions == 32_768
    with pytest.raises(ValueError, match="exceeds the 32768 positions the cache stores; give the engine a larger"):
        engine.batch_shape([32_000], 1_000)
    wide = make_engine(wide_model, "full", budget=1.0, max_context=65_536)
    assert wide.storage.positions == 4 and wide.storage.max_positions > 65_536


def test_storage_refuses_what_it_cannot_hold():
    with pytest.raises(ValueError, match="per token"):
        Storage(slots=KIVI2[0])
    with pytest.raises(ValueError, match="per channel"):
        Storage(blocks=(INT8, INT8))
    with pytest.raises(ValueError, match="unknown storage 'int3'"):
        Storage.parse("int3")
    assert [Storage.parse(n).name for n in STORAGE_NAMES] == list(STORAGE_NAMES)  # the CLI's JAX-free copy agrees
    assert LOW_STORAGE_NAMES == BLOCK_FORMATS


def test_quantized_slot_pool_round_trips_within_its_step():
    rng = np.random.default_rng(0)
    for fmt in (INT8, FP8):
        cache = GroupCache.empty(1, B, K, 6, H, jnp.float32, storage=Storage(slots=fmt))
        x = jnp.asarray(rng.normal(size=(B, K, H)) * 3, jnp.float32)
        cache = cache.write(0, x, -x, jnp.array([5, 9]), jnp.array([1, 2]), jnp.ones((B, K), bool))
        k, v = cache.slot_kv(0)
        slot = np.asarray(cache.table[0, :, :, 0])  # the slot each (row, head) wrote
        got = np.take_along_axis(np.asarray(k), slot[..., None, None], axis=2)[:, :, 0]
        absmax = np.abs(np.asarray(x)).max(-1, keepdims=True)
        tolerance = absmax / 127 if fmt == INT8 else absmax * 2.0**-4
        assert (np.abs(got - np.asarray(x)) <= tolerance + 1e-6).all()
        assert cache.k.codes.dtype == (jnp.int8 if fmt == INT8 else jnp.float8_e4m3fn)


def _kivi_cache(blocks: int = 3, slots: int = 10) -> GroupCache:
    return GroupCache.empty(1, B, K, slots, H, jnp.float32, storage=Storage(blocks=KIVI2, window=2), blocks=blocks)


def test_fill_puts_the_oldest_whole_blocks_down_and_the_rest_in_slots():
    rng = np.random.default_rng(1)
    p = 11
    prompt = jnp.asarray(rng.normal(size=(B, p, K, H)), jnp.float32)
    positions = jnp.broadcast_to(jnp.arange(p), (B, p))
    keep = jnp.broadcast_to(jnp.arange(p)[::-1], (B, K, p)).astype(jnp.int32)  # newest first, as recency ranks
    count = jnp.array([[11, 11], [6, 3]], jnp.int32)
    cache = _kivi_cache().fill(0, prompt, prompt, positions, positions, keep, count)
    blocks, pos = np.asarray(cache.blocks.count[0]), np.asarray(cache.blocks.pos[0])
    np.testing.assert_array_equal(blocks, [[2, 2], [1, 0]])  # 11 -> 2 blocks + 3 slots; 6 (newest) -> 1 + 2; 3 -> 3
    np.testing.assert_array_equal(cache.length[0], [[3, 3], [2, 3]])
    np.testing.assert_array_equal(pos[0, 0, :2].ravel(), np.arange(8))  # positions 0..7 in blocks, in order
    np.testing.assert_array_equal(np.sort(np.asarray(cache.pos[0, 0, 0])[:3]), [8, 9, 10])
    np.testing.assert_array_equal(pos[1, 0, 0], [5, 6, 7, 8])  # the kept 6 are positions 5..10
    assert (pos[1, 1] == -1).all()
    k, _ = cache.blocks.dequantized(0)  # f32[B, K, NB * T, H]
    error = np.abs(np.asarray(k)[0, 0, :8] - np.asarray(prompt)[0, :8, 0])
    scale = (np.asarray(prompt)[0, :4, 0].max(0) - np.asarray(prompt)[0, :4, 0].min(0)) / 3  # 2 bits: 3 steps
    assert (error[:4] <= scale / 2 + 1e-2).all()


def test_take_down_moves_the_oldest_block_and_keeps_the_table_valid():
    rng = np.random.default_rng(2)
    cache = _kivi_cache()
    for p in range(7):
        x = jnp.asarray(rng.normal(size=(B, K, H)), jnp.float32)
        cache = cache.write(0, x, x, jnp.full((B,), p), jnp.zeros((B,), jnp.int32), jnp.ones((B, K), bool))
    before = cache
    cache = cache.take_down(0, jnp.array([[True, False], [True, True]]))
    np.testing.assert_array_equal(cache.length[0], [[3, 7], [3, 3]])
    np.testing.assert_array_equal(cache.blocks.count[0], [[1, 0], [1, 1]])
    np.testing.assert_array_equal(cache.blocks.pos[0, 0, 0, 0], [0, 1, 2, 3])
    table, length, pos = (np.asarray(x[0]) for x in (cache.table, cache.length, cache.pos))
    for idx in np.ndindex(length.shape):
        assert sorted(table[idx]) == list(range(cache.capacity))
        np.testing.assert_array_equal(np.sort(pos[idx][table[idx][: length[idx]]]), np.arange(7 - length[idx], 7))
    # attention over both pools = attention over the same entries dequantized and laid side by side
    q = jnp.asarray(rng.normal(size=(B, 2 * K, H)), jnp.float32)
    for c in (before, cache):
        k, v = c.slot_kv(0)
        keys, values, live = [k], [v], [c.pos[0] >= 0]
        if c.blocks is not None:
            block_k, block_v = c.blocks.dequantized(0)
            keys, values, live = keys + [block_k], values + [block_v], live + [c.blocks.live(0).reshape(B, K, -1)]
        keys, values, live = (jnp.concatenate(x, axis=2) for x in (keys, values, live))
        logits = jnp.einsum("BKGH,BKSH->BKGS", q.reshape(B, K, 2, H), keys) / np.sqrt(H)
        probs = jax.nn.softmax(jnp.where(live[:, :, None], logits, -jnp.inf), axis=-1)
        expected = jnp.einsum("BKGS,BKSH->BKGH", probs, values).reshape(B, 2 * K, H)
        np.testing.assert_allclose(decode_attention(q, c, 0), expected, atol=1e-5)


def test_block_release_frees_the_block_for_the_next_append():
    rng = np.random.default_rng(3)
    pool = _kivi_cache(blocks=2).blocks
    ones = jnp.ones((B, K), bool)
    for first in (0, 4):
        x = jnp.asarray(rng.normal(size=(B, K, T, H)), jnp.float32)
        pos = jnp.broadcast_to(first + jnp.arange(T), (B, K, T))
        pool = pool.append(0, x, x, pos, jnp.zeros((B, K, T), jnp.int32), ones)
    full = pool.append(0, x, x, pos + 4, jnp.zeros((B, K, T), jnp.int32), ones)  # no free block: nothing enters
    np.testing.assert_array_equal(full.count[0], 2)
    pool = pool.release(0, jnp.zeros((B, K), jnp.int32), jnp.array([[True, False], [False, False]]))
    np.testing.assert_array_equal(pool.count[0], [[1, 2], [2, 2]])
    assert (np.asarray(pool.pos[0, 0, 0, 0]) == -1).all() and int(pool.table[0, 0, 0, 0]) == 1
    pool = pool.append(0, x, x, pos + 4, jnp.zeros((B, K, T), jnp.int32), ones)
    np.testing.assert_array_equal(pool.pos[0, 0, 0, 0], [8, 9, 10, 11])  # the freed block is the next written


def test_codes_are_what_the_quantizer_writes():
    rng = np.random.default_rng(4)
    x = jnp.asarray(rng.normal(size=(B, K, T, H)), jnp.float32)
    pool = _kivi_cache(blocks=1).blocks.append(
        0, x, x, jnp.zeros((B, K, T), jnp.int32), jnp.zeros((B, K, T), jnp.int32), jnp.ones((B, K), bool)
    )
    np.testing.assert_array_equal(pool.k.codes[0, :, :, 0], quantize(x, KIVI2[0]).codes)
    k, v = pool.dequantized(0)
    np.testing.assert_allclose(k.reshape(x.shape), dequantize(quantize(x, KIVI2[0]), KIVI2[0]))
    np.testing.assert_allclose(v.reshape(x.shape), dequantize(quantize(x, KIVI2[1]), KIVI2[1]))


@pytest.fixture(scope="module")
def wide_model() -> Decoder:
    """head_dim 32, so that int4 per token (groups of 32 channels) applies."""
    return Decoder(ModelConfig.tiny("qwen3", num_layers=2, head_dim=32), rngs=nnx.Rngs(0))


def test_a_storage_spec_buys_more_entries_in_the_same_bytes(wide_model: Decoder):
    prompts = [list(range(3, 60)), list(range(9, 40))]
    sampling = SamplingConfig(max_new_tokens=8)
    kept = {}
    for spec in ("snapkv", "snapkv@int8", "snapkv@int4"):
        engine = make_engine(wide_model, spec, 0.3, length_buckets=(64,))
        stats = [g.stats for g in engine.generate(prompts, sampling)]
        kept[spec] = np.mean([s.kept_ratio_mean for s in stats])
        assert max(s.kv_bytes_ratio_max for s in stats) <= 0.3 + 0.05  # the byte cap, slack of one entry
    bf16, int8, int4 = Storage(), Storage.parse("int8"), Storage.parse("int4")
    for spec, storage in (("snapkv@int8", int8), ("snapkv@int4", int4)):
        ratio = bf16.slot_entry_bytes(32) / storage.slot_entry_bytes(32)  # 143/87 for int8, 143/55 for int4
        assert kept[spec] == pytest.approx(kept["snapkv"] * ratio, rel=0.1)


def test_method_specs_name_a_storage(wide_model: Decoder):
    assert make_engine(wide_model, "snapkv@int8", 0.3).storage == Storage.parse("int8")
    assert make_engine(wide_model, "kivi", 0.5).storage.blocks[0].bits == 4  # the widest the budget pays for
    assert make_engine(wide_model, "kivi", 0.2).storage.blocks[0].bits == 2
    assert resolve_spec("snapkv@int4", {}).method == "snapkv@int4"
    with pytest.raises(ValueError, match="chooses its own storage"):
        make_engine(wide_model, "kivi@int8", 0.3)
    with pytest.raises(ValueError, match="unknown storage"):
        make_engine(wide_model, "snapkv@int3", 0.3)
    assert method_spec("h2o:w8@fp8") == "h2o:w8@fp8"
    with pytest.raises(argparse.ArgumentTypeError, match="unknown storage 'int2'"):
        method_spec("snapkv@int2")
    assert KIVI().widest_bits(0.32, 64) == 2 and KIVI().widest_bits(0.33, 64) == 4  # 83.1 bytes of 256 is 0.3247


@pytest.mark.parametrize("storage", [Storage(slots=FP8), Storage(blocks=KIVI2, window=2)])
def test_decode_attention_kernels_read_codes_as_the_xla_path_does(storage: Storage):
    """The Pallas kernels (interpreted) over the same cache -- codes and scales, not dequantized pools -- give the
    XLA path's attention: an 8-bit slot pool, and KIVI's full-precision window merged with its block pool."""
    rng = np.random.default_rng(5)
    cache = GroupCache.empty(1, B, K, 10, 16, jnp.float32, storage=storage, blocks=3)
    for p in range(9):
        x = jnp.asarray(rng.normal(size=(B, K, 16)), jnp.float32)
        cache = cache.write(0, x, -x, jnp.full((B,), p), jnp.zeros((B,), jnp.int32), jnp.ones((B, K), bool))
    if storage.blocks is not None:
        cache = cache.take_down(0, jnp.array([[True, True], [True, False]]))
        cache = cache.evict(0, cache.table[0, :, :, 0], jnp.array([[False, True], [False, False]]))
    q = jnp.asarray(rng.normal(size=(B, 2 * K, 16)), jnp.float32)
    xla = decode_attention(q, cache, 0)
    np.testing.assert_allclose(decode_attention(q, cache, 0, use_kernel=True), xla, atol=2e-5, rtol=1e-5)


# ---- two block pools (TriAxialKV): INT4 and INT2 blocks of the same length, each entry in the pool of its tag ----

KIVI4 = (KVFormat(4, "int", "channel", T), KVFormat(4, "int", "token", H))
TWO_POOLS = Storage(blocks=KIVI4, second_blocks=KIVI2, window=T)


def _two_pool_cache(blocks: tuple[int, int] = (3, 3), slots: int = 12) -> GroupCache:
    return GroupCache.empty(1, B, K, slots, H, jnp.float32, storage=TWO_POOLS, blocks=blocks)


def test_two_pools_need_blocks_of_one_length_and_a_window_of_a_block():
    with pytest.raises(ValueError, match="same length"):
        Storage(blocks=KIVI4, second_blocks=PRESETS["kivi2"], window=32)
    with pytest.raises(ValueError, match="window of at least a block"):
        Storage(blocks=KIVI4, second_blocks=KIVI2, window=T - 1)
    with pytest.raises(ValueError, match="needs a block pool"):
        Storage(second_blocks=KIVI2)
    assert TWO_POOLS.name == "kivi4+kivi2"
    assert TWO_POOLS.block_entry_bytes(H, 1) == Storage(blocks=KIVI2).block_entry_bytes(H)


def test_fill_puts_each_pools_oldest_whole_blocks_into_that_pool():
    rng = np.random.default_rng(6)
    p = 13
    prompt = jnp.asarray(rng.normal(size=(B, p, K, H)), jnp.float32)
    positions = jnp.broadcast_to(jnp.arange(p), (B, p))
    pools = jnp.asarray([[0, 1] * 6 + [0], [1] * 9 + [0] * 4], jnp.int32)  # i32[B, P]: the pool of each position
    keep = jnp.broadcast_to(jnp.arange(p)[::-1], (B, K, p)).astype(jnp.int32)  # newest first
    count = jnp.array([[13, 13], [13, 9]], jnp.int32)
    cache = _two_pool_cache().fill(0, prompt, prompt, positions, positions, keep, count, pools=pools)
    int4, int2 = cache.block_pools
    # row 0: pool 0 holds 0, 2, .., 12 (7 entries: a block + 3), pool 1 holds 1, 3, .., 11 (6: a block + 2)
    np.testing.assert_array_equal(int4.pos[0, 0, 0, 0], [0, 2, 4, 6])
    np.testing.assert_array_equal(int2.pos[0, 0, 0, 0], [1, 3, 5, 7])
    in_slots = np.asarray(cache.pos[0, 0, 0])[: int(cache.length[0, 0, 0])]
    np.testing.assert_array_equal(np.sort(in_slots), [8, 9, 10, 11, 12])
    # row 1: pool 1 holds 0..8, pool 0 holds 9..12; head 1 keeps the newest 9 (4..12): pool 1 has 5 of them
    np.testing.assert_array_equal(int2.pos[0, 1, 0, :2].ravel(), np.arange(8))
    np.testing.assert_array_equal(int4.pos[0, 1, 0, 0], [9, 10, 11, 12])
    np.testing.assert_array_equal(int2.pos[0, 1, 1, 0], [4, 5, 6, 7])
    np.testing.assert_array_equal(int4.count[0], [[1, 1], [1, 1]])
    np.testing.assert_array_equal(int2.count[0], [[1, 1], [2, 1]])
    np.testing.assert_array_equal(cache.length[0], [[5, 5], [1, 1]])
    for pool, fmt in ((int4, KIVI4), (int2, KIVI2)):  # each pool quantizes in its own format
        assert pool.formats == fmt


def test_take_down_moves_a_block_of_one_pool_into_that_pool():
    rng = np.random.default_rng(7)
    cache = _two_pool_cache()
    tags = [1, 0, 1, 1, 0, 1, 0, 0, 1]  # pool 1: 0, 2, 3, 5, 8; pool 0: 1, 4, 6, 7 (a block each)
    for p, tag in enumerate(tags):
        x = jnp.asarray(rng.normal(size=(B, K, H)), jnp.float32)
        cache = cache.write(0, x, x, jnp.full((B,), p), jnp.full((B,), tag), jnp.ones((B, K), bool))
    pool = cache.role[0].astype(jnp.int32)  # here the role is the pool
    down = cache.take_down(0, jnp.ones((B, K), bool), pool=pool)
    int4, int2 = down.block_pools
    np.testing.assert_array_equal(int2.count[0], 1)  # the pool holding the oldest entry goes first
    np.testing.assert_array_equal(int4.count[0], 0)
    np.testing.assert_array_equal(int2.pos[0, 0, 0, 0], [0, 2, 3, 5])
    np.testing.assert_array_equal(down.length[0], 5)
    again = down.take_down(0, jnp.ones((B, K), bool), pool=down.role[0].astype(jnp.int32))
    np.testing.assert_array_equal(again.block_pools[0].pos[0, 0, 0, 0], [1, 4, 6, 7])  # then pool 0's block
    np.testing.assert_array_equal(again.length[0], 1)
    stuck = again.take_down(0, jnp.ones((B, K), bool), pool=again.role[0].astype(jnp.int32))
    np.testing.assert_array_equal(stuck.length[0], 1)  # no pool has a block of live entries: nothing moves


def test_forced_take_down_moves_a_mixed_block_into_the_lowest_precision_pool():
    """Two entries of each pool in the slots, a block of four: neither pool can take a block of its own; forced (the
    bytes over), the four go down together into the last pool (INT2), the INT4 entries among them re-quantized at 2
    bits; unforced, nothing moves."""
    rng = np.random.default_rng(8)
    cache = _two_pool_cache()
    for p, tag in enumerate([0, 1, 0, 1, 1]):
        x = jnp.asarray(rng.normal(size=(B, K, H)), jnp.float32)
        cache = cache.write(0, x, x, jnp.full((B,), p), jnp.full((B,), tag), jnp.ones((B, K), bool))
    pool = cache.role[0].astype(jnp.int32)
    do = jnp.ones((B, K), bool)
    np.testing.assert_array_equal(cache.take_down(0, do, pool=pool).length[0], 5)  # pool 1 has three: not a block
    kept = cache.take_down(0, do, pool=pool, forced=jnp.zeros((B, K), bool))
    np.testing.assert_array_equal(kept.length[0], 5)
    forced = cache.take_down(0, do, pool=pool, forced=jnp.asarray([[True, False]] * B))
    int4, int2 = forced.block_pools
    np.testing.assert_array_equal(int4.count[0], 0)
    np.testing.assert_array_equal(int2.count[0], [[1, 0]] * B)  # only the forced head moved
    np.testing.assert_array_equal(int2.pos[0, :, 0, 0], [[0, 1, 2, 3]] * B)  # the oldest four, of both pools
    np.testing.assert_array_equal(forced.length[0], [[1, 5]] * B)


def test_tagged_prefill_count_keeps_the_most_newest_entries_whose_blocks_and_rest_fit():
    budget = ByteBudget(TWO_POOLS, H, capped=True)
    slot, (block4, block2) = budget.slot_bytes, budget.pool_block_bytes
    pools = jnp.asarray([[[1, 1, 1, 1, 0, 0, 0, 0, 0, 1]]], jnp.int32)  # i32[1, 1, 10]: the candidates, newest first
    available = jnp.asarray([[10]])

    def count(limit_bytes: float) -> int:
        allowance = jnp.asarray([[limit_bytes / budget.full_bytes]])
        return int(budget.tagged_prefill_count(allowance, available, pools)[0, 0])

    assert block2 < 2 * slot and block4 < 3 * slot  # at head_dim 16, blocks of 4: 136 and 168 bytes, a slot 79
    assert count(slot) == 1
    assert count(2 * slot) == 4  # a whole INT2 block costs less than two slot entries
    assert count(block2 + block4) == 8  # 7 would hold three slot entries, more bytes than a block
    assert count(block2 + block4 + slot) == 9
    assert count(block2 + block4 + 2 * slot) == 10  # everything
    assert count(1e9) == 10
    uncapped = ByteBudget(TWO_POOLS, H, capped=False)
    assert int(uncapped.tagged_prefill_count(jnp.asarray([[0.1]]), available, pools)[0, 0]) == 10


def test_attention_over_two_pools_is_attention_over_their_entries():
    """The XLA path over the window and both pools = softmax attention over the same entries dequantized side by
    side; the Pallas kernels (interpreted) reading both pools' codes give the XLA path's attention."""
    rng = np.random.default_rng(8)
    cache = _two_pool_cache()
    for p, tag in enumerate([0, 1, 1, 0, 1, 0, 1, 1, 0, 0, 1]):
        x = jnp.asarray(rng.normal(size=(B, K, H)), jnp.float32)
        cache = cache.write(0, x, -x, jnp.full((B,), p), jnp.full((B,), tag), jnp.ones((B, K), bool))
    for do in (jnp.ones((B, K), bool), jnp.array([[True, False], [True, True]])):
        cache = cache.take_down(0, do, pool=cache.role[0].astype(jnp.int32))
    cache = cache.evict(0, cache.table[0, :, :, 0], jnp.array([[False, True], [False, False]]))
    assert all(int(pool.count.sum()) > 0 for pool in cache.block_pools)
    k, v = cache.slot_kv(0)
    keys, values, live = [k], [v], [cache.pos[0] >= 0]
    for pool in cache.block_pools:
        block_k, block_v = pool.dequantized(0)
        keys, values, live = keys + [block_k], values + [block_v], live + [pool.live(0).reshape(B, K, -1)]
    keys, values, live = (jnp.concatenate(x, axis=2) for x in (keys, values, live))
    q = jnp.asarray(rng.normal(size=(B, 2 * K, H)), jnp.float32)
    logits = jnp.einsum("BKGH,BKSH->BKGS", q.reshape(B, K, 2, H), keys) / np.sqrt(H)
    probs = jax.nn.softmax(jnp.where(live[:, :, None], logits, -jnp.inf), axis=-1)
    expected = jnp.einsum("BKGS,BKSH->BKGH", probs, values).reshape(B, 2 * K, H)
    xla = decode_attention(q, cache, 0)
    np.testing.assert_allclose(xla, expected, atol=1e-5)
    np.testing.assert_allclose(decode_attention(q, cache, 0, use_kernel=True), xla, atol=2e-5, rtol=1e-5)
