"""The total KV budget in bytes: how many entries a layer may hold, and the cap each decode step keeps.

A method's allowance (`KVMethod.keep_allowance`) is in entries of the budget's reference, a bf16 K/V entry without
metadata (`storage.full_entry_bytes`): `allowance * full_entry_bytes` bytes. What the cache may hold of it depends on
how it stores entries (`pask_jax.storage`): a bf16 slot entry with its metadata costs a little more than the
reference (at head_dim 64, 269 bytes for 256), an int8 one about half, a KIVI-2 block entry about a fifth. At budget
1 nothing is capped (the cache keeps every entry, whatever it costs), so budget 1 always reproduces full KV.

The decode step keeps, per (layer, sequence, KV head), `held_bytes <= allowance(P + t) * full_entry_bytes` after each
token (the token being written is the slack). With a block pool it first takes the oldest slot entries down a block
(the window shrinking) and only then lets an entry -- or a whole block -- leave. With two block pools each pool's
blocks cost their own bytes.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

from pask_jax.cache import GroupCache
from pask_jax.methods.base import SLACK, KVMethod
from pask_jax.storage import Storage, full_entry_bytes


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Kept:
    """What a cache holds per sequence row, summed over layers and KV heads."""

    entries: jax.Array  # i32[B] live entries
    bytes: jax.Array  # f32[B] bytes held, counted as the budget counts them


@dataclasses.dataclass(frozen=True)
class ByteBudget:
    """The byte side of a plan: its storage, head_dim, and whether the budget caps at all (b < 1)."""

    storage: Storage
    head_dim: int
    capped: bool

    @property
    def full_bytes(self) -> int:
        return full_entry_bytes(self.head_dim)

    @property
    def slot_bytes(self) -> float:
        return self.storage.slot_entry_bytes(self.head_dim)

    @property
    def block_bytes(self) -> float:
        """Bytes of one whole block of the (first) block pool."""
        return self.pool_block_bytes[0]

    @property
    def pool_block_bytes(self) -> tuple[float, ...]:
        """Bytes of one whole block of each block pool."""
        pools = range(len(self.storage.block_pools))
        return tuple(self.storage.block * self.storage.block_entry_bytes(self.head_dim, p) for p in pools)

    def slot_entries(self, allowance):
        """Slot entries (before the floor) an allowance of `allowance` reference entries pays for."""
        return allowance * self.full_bytes / self.slot_bytes if self.capped else allowance

    def held(self, slots: jax.Array, *blocks: jax.Array | int) -> jax.Array:
        """Bytes of `slots` slot entries and `blocks[p]` blocks of each block pool p."""
        held = slots * self.slot_bytes
        for count, block_bytes in zip(blocks, self.pool_block_bytes, strict=False):
            held = held + count * block_bytes
        return held

    def cache_held(self, cache: GroupCache, layer: int) -> jax.Array:
        """f32[B, K]: bytes one layer of a group cache holds per (sequence, KV head), from its own lengths."""
        return self.held(cache.length[layer], *(pool.count[layer] for pool in cache.block_pools))

    def slot_capacity(self, allowance: float, full: int) -> int:
        """Slots a layer allowed `allowance` reference entries at its final full length `full` needs."""
        if self.storage.blocks is None:
            return min(math.ceil(round(float(self.slot_entries(allowance)), 6)), full) + SLACK
        return min(self.storage.window + self.storage.block, full) + SLACK  # the window and one block to go down

    def block_capacity(self, allowance: float, full: int, pool: int = 0) -> int:
        """Blocks of block pool `pool` a layer allowed `allowance` reference entries at full length `full` needs."""
        if self.storage.blocks is None:
            return 0
        whole = -(-full // self.storage.block)
        if not self.capped:
            return whole
        return min(whole, math.floor(allowance * self.full_bytes / self.pool_block_bytes[pool])) + 1

    def prefill_count(
        self,
        allowance: jax.Array,
        available: jax.Array,
        high: jax.Array | None = None,
        retained: jax.Array | None = None,
    ) -> jax.Array:
        """Entries (i32, any shape) a layer keeps of `available` prompt entries under an allowance of `allowance`
        reference entries. With a block pool: the most whose whole blocks plus a slot remainder fit the bytes; or,
        given `high` and `retained` (`prefill_slots`), those slots and then whole blocks."""
        if not self.capped:
            return available
        if self.storage.blocks is None:
            return jnp.minimum(jnp.floor(self.slot_entries(allowance)).astype(jnp.int32), available)
        block, limit = self.storage.block, allowance * self.full_bytes
        if high is not None:
            slots = self.prefill_slots(allowance, available, high, retained)
            blocks = jnp.floor((limit - slots * self.slot_bytes) / self.block_bytes).astype(jnp.int32)
            return slots + jnp.minimum(blocks, (available - slots) // block) * block
        if_all = self.held(available % block, available // block) <= limit
        blocks = jnp.minimum(jnp.floor(limit / self.block_bytes).astype(jnp.int32), available // block)
        spare = jnp.floor((limit - blocks * self.block_bytes) / self.slot_bytes).astype(jnp.int32)
        rest = jnp.minimum(jnp.minimum(spare, block - 1), available - blocks * block)
        return jnp.where(if_all, available, blocks * block + rest)

    def tagged_prefill_count(self, allowance: jax.Array, available: jax.Array, pools: jax.Array) -> jax.Array:
        """i32[B, K]: with two block pools, the most of the best-ranked prompt entries (`pools` i32[B, K, n]: the pool
        of each candidate, best first) whose whole blocks in each pool plus the remainders in slots fit the bytes of
        `allowance` (f[B, 1]) reference entries; at most `available` (i32[B, 1]). The bytes are not monotone in the
        entries kept (a completed block costs less than its entries in slots): the largest count that fits."""
        n = pools.shape[-1]
        taken = jnp.arange(1, n + 1)  # i32[n]: candidates kept
        if not self.capped:
            return jnp.broadcast_to(jnp.minimum(available, n), pools.shape[:2])
        held = jnp.zeros(pools.shape, jnp.float32)
        in_blocks = jnp.zeros(pools.shape, jnp.int32)
        for p, block_bytes in enumerate(self.pool_block_bytes):
            whole = jnp.cumsum(pools == p, axis=-1) // self.storage.block  # i32[B, K, n]: this pool's blocks
            held, in_blocks = held + whole * block_bytes, in_blocks + whole * self.storage.block
        held = held + (taken - in_blocks) * self.slot_bytes
        fits = (held <= (allowance * self.full_bytes)[..., None]) & (taken <= available[..., None])
        return jnp.max(jnp.where(fits, taken, 0), axis=-1).astype(jnp.int32)

    def prefill_slots(
        self, allowance: jax.Array, available: jax.Array, high: jax.Array, retained: jax.Array
    ) -> jax.Array:
        """i32: of `high` prompt entries wanted at full precision, those the slot pool holds after prefill: at most
        the window and, capped, what the bytes left after holding all `retained` entries (the method's, `high`
        among them) in blocks pay for the step up -- so, as during decode, entries go down before any retained
        entry leaves."""
        slots = jnp.minimum(jnp.minimum(high, self.storage.window), available)
        if not self.capped:
            return slots
        entry = self.block_bytes / self.storage.block
        spare = allowance * self.full_bytes - retained * entry  # bytes beyond every retained entry at LOW
        return jnp.clip(jnp.floor(spare / (self.slot_bytes - entry)).astype(jnp.int32), 0, slots)

    def slot_cap(self, allowance: jax.Array) -> jax.Array:
        """i32: slot entries a slot-only layer may hold under an allowance of `allowance` reference entries."""
        return jnp.floor(self.slot_entries(allowance)).astype(jnp.int32)


def block_priority(
    method: KVMethod,
    layer: int,
    pos: jax.Array,  # i32[B, K, NB, T] (-1: dead or free)
    role: jax.Array,  # i8[B, K, NB, T]
    position: jax.Array,  # i32[B]
    prompt_len: jax.Array,  # i32[B]
    live_blocks: jax.Array,  # bool[B, K, NB]
) -> jax.Array:  # f32[B, K, NB]: the lowest live block leaves whole
    """A block's keep-priority: its most valuable entry's, by the method's eviction priority (a block leaves whole,
    so it goes only once its best entry is the least valuable left; one holding a PROTECTED entry, such as an
    attention sink, only when nothing else is left); free blocks never leave."""
    b, kv_heads, nb, t = pos.shape
    flat = method.block_entry_priority(
        layer,
        pos.reshape(b, kv_heads, nb * t),
        role.reshape(b, kv_heads, nb * t).astype(jnp.int32),
        position,
        prompt_len,
    ).reshape(b, kv_heads, nb, t)
    best = jnp.max(jnp.where(pos >= 0, flat, -jnp.inf), axis=-1)  # a block of dead entries: -inf, first to go
    return jnp.where(live_blocks, best, jnp.inf)
