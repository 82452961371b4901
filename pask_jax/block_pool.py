"""The block pool of a layer group's cache: low-precision entries stored a block of `block` tokens at a time.

A block holds `block` consecutive entries of one (layer, sequence, KV head) in a KIVI format: keys quantized per
channel over the block (one f16 scale and zero per channel), values per token over groups of channels. Keys have
outlier channels that a per-token group would spend its range on; a per-channel group gives each its own scale, and
that needs several tokens at once -- hence blocks. A block enters whole (the prompt at prefill, or the `block` oldest
entries of the slot pool going down during decode) and leaves whole; inside a live block an entry can be dead
(`pos` -1: masked, its bytes still held).

Like the slot pool, `table` is a permutation of the NB blocks whose first `count` entries are the live blocks (in the
order they entered), so taking a block is O(1) and releasing one swaps it with the last live block.
Every array carries a leading layer axis Lg; `layer` arguments index it.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from pask_jax.kernels.quantize import KVFormat, QuantizedBlock, dequantize, quantize


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class BlockPool:
    """NB blocks of `block` entries per (layer, sequence, KV head)."""

    k: QuantizedBlock  # codes u8[Lg, B, K, NB, T, H*bits/8]; scale, zero f16[Lg, B, K, NB, 1, H] (per channel)
    v: QuantizedBlock  # codes u8[Lg, B, K, NB, T, H*bits/8]; scale, zero f16[Lg, B, K, NB, T, H/g] (per token)
    pos: jax.Array  # i16[Lg, B, K, NB, T] original position of each entry, -1 if dead or free (or i32)
    role: jax.Array  # i8[Lg, B, K, NB, T]
    table: jax.Array  # i32[Lg, B, K, NB] block permutation: first `count` live
    count: jax.Array  # i32[Lg, B, K] live blocks
    formats: tuple[KVFormat, KVFormat] = dataclasses.field(metadata=dict(static=True))  # (key, value)

    @property
    def blocks(self) -> int:
        return self.table.shape[-1]

    @property
    def block(self) -> int:
        return self.pos.shape[-1]

    @classmethod
    def empty(
        cls,
        layers: int,
        batch: int,
        kv_heads: int,
        blocks: int,
        head_dim: int,
        formats: tuple[KVFormat, KVFormat],
        position_dtype: jax.typing.DTypeLike = jnp.int16,  # `Storage.position_dtype`
    ) -> BlockPool:
        block = formats[0].group
        zeros = jnp.zeros((layers, batch, kv_heads, blocks, block, head_dim), jnp.float32)
        shape = (layers, batch, kv_heads, blocks)
        return cls(
            k=jax.tree.map(jnp.zeros_like, quantize(zeros, formats[0])),
            v=jax.tree.map(jnp.zeros_like, quantize(zeros, formats[1])),
            pos=jnp.full((*shape, block), -1, position_dtype),
            role=jnp.zeros((*shape, block), jnp.int8),
            table=jnp.broadcast_to(jnp.arange(blocks, dtype=jnp.int32), shape),
            count=jnp.zeros(shape[:-1], jnp.int32),
            formats=formats,
        )

    def partition_specs(self, axes: tuple[str | None, str | None]) -> BlockPool:
        """The PartitionSpec of every array: sequence and KV-head dimensions per `axes`, the rest whole."""
        return jax.tree.map(lambda x: P(None, *axes, *([None] * (x.ndim - 3))), self)

    def fill(
        self,
        layer: int,
        k: jax.Array,  # f[B, K, n, H] entries in the order they go into blocks (n a multiple of the block)
        v: jax.Array,  # f[B, K, n, H]
        pos: jax.Array,  # i32[B, K, n]
        role: jax.Array,  # i32[B, K, n]
        count: jax.Array,  # i32[B, K] live blocks (the first count * block entries); the rest stay free
    ) -> BlockPool:
        """Load the first blocks of one layer (the pool must be empty)."""
        b, kv_heads, n, h = k.shape
        nb, t = n // self.block, self.block
        if nb > self.blocks:
            raise ValueError(f"{nb} blocks exceed the pool's {self.blocks}")

        def blocked(x: jax.Array) -> jax.Array:
            return x.reshape(b, kv_heads, nb, t, *x.shape[3:])

        live = (jnp.arange(nb) < count[..., None])[..., None]  # bool[B, K, nb, 1]
        qk, qv = quantize(blocked(k), self.formats[0]), quantize(blocked(v), self.formats[1])
        put = lambda pool, new: pool.at[layer, :, :, :nb].set(new.astype(pool.dtype))  # noqa: E731
        return dataclasses.replace(
            self,
            k=jax.tree.map(put, self.k, qk),
            v=jax.tree.map(put, self.v, qv),
            pos=put(self.pos, jnp.where(live, blocked(pos), -1)),
            role=put(self.role, blocked(role).astype(jnp.int8)),
            count=self.count.at[layer].set(count),
        )

    def append(
        self,
        layer: int,
        k: jax.Array,  # f[B, K, T, H] one block's entries
        v: jax.Array,  # f[B, K, T, H]
        pos: jax.Array,  # i32[B, K, T]
        role: jax.Array,  # i32[B, K, T]
        do: jax.Array,  # bool[B, K] where the block enters (there must be a free block)
    ) -> BlockPool:
        """Quantize one block of entries into the free block `table[count]` of every (sequence, head) in `do`."""
        count = self.count[layer]  # [B, K]
        do = do & (count < self.blocks)
        free = jnp.take_along_axis(self.table[layer], jnp.minimum(count, self.blocks - 1)[..., None], axis=-1)
        block = jnp.where(do, free[..., 0], self.blocks)  # out of range: skipped
        rows, heads = jnp.arange(k.shape[0])[:, None], jnp.arange(k.shape[1])[None, :]

        def put(pool: jax.Array, new: jax.Array) -> jax.Array:
            return pool.at[layer, rows, heads, block].set(new.astype(pool.dtype), mode="drop")

        return dataclasses.replace(
            self,
            k=jax.tree.map(put, self.k, quantize(k, self.formats[0])),
            v=jax.tree.map(put, self.v, quantize(v, self.formats[1])),
            pos=put(self.pos, pos),
            role=put(self.role, role.astype(jnp.int8)),
            count=self.count.at[layer].add(do.astype(jnp.int32)),
        )

    def release(self, layer: int, block: jax.Array, do: jax.Array) -> BlockPool:
        """Free `block` (i32[B, K], a live block) where `do` (bool[B, K]); swap-with-last keeps `table` valid."""
        table, count = self.table[layer], self.count[layer]  # [B, K, NB], [B, K]
        do = do & (count > 0)
        index = jnp.argmax(table == block[..., None], axis=-1)
        last = count - 1
        last_block = jnp.take_along_axis(table, jnp.maximum(last, 0)[..., None], axis=-1)[..., 0]
        rows, heads = jnp.arange(block.shape[0])[:, None], jnp.arange(block.shape[1])[None, :]
        skip = self.blocks
        table = self.table.at[layer, rows, heads, jnp.where(do, index, skip)].set(last_block, mode="drop")
        table = table.at[layer, rows, heads, jnp.where(do, last, skip)].set(block, mode="drop")
        pos = self.pos.at[layer, rows, heads, jnp.where(do, block, skip)].set(-1, mode="drop")
        return dataclasses.replace(self, table=table, pos=pos, count=self.count.at[layer].add(-do.astype(jnp.int32)))

    def live(self, layer: int) -> jax.Array:  # bool[B, K, NB, T]: live entries of live blocks
        """Entries that attention sees: alive inside a block that is live (a released block's entries are -1)."""
        return self.pos[layer] >= 0

    def dequantized(self, layer: int) -> tuple[jax.Array, jax.Array]:  # f32[B, K, NB * T, H] each
        """One layer's keys and values in float32, blocks laid end to end (free blocks too: mask with `live`)."""
        k, v = dequantize(_at(self.k, layer), self.formats[0]), dequantize(_at(self.v, layer), self.formats[1])
        b, kv_heads, nb, t, h = k.shape
        return k.reshape(b, kv_heads, nb * t, h), v.reshape(b, kv_heads, nb * t, h)

    def insert_rows(self, other: BlockPool, rows: jax.Array) -> BlockPool:
        """Sequence rows `rows` (i32[b]) replaced by `other`'s b rows; a row past the batch is skipped."""
        return jax.tree.map(lambda x, y: x.at[:, rows].set(y, mode="drop"), self, other)


def _at(block: QuantizedBlock, layer: int) -> QuantizedBlock:
    return jax.tree.map(lambda x: x[layer], block)
