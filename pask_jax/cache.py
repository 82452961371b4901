"""Statically shaped ragged KV cache.

Layers are split into G consecutive layer groups; each group owns a slot pool of fixed capacity C_g
per (layer, sequence, KV head), sized from the budget, so memory shrinks with the budget and shapes
never depend on data. Which slots are live is ragged per (layer, sequence, KV head):

- `table` is a permutation of the C slots: its first `length` entries are the live slots (in the
  order they entered), the rest are free. Writing takes `table[length]`; evicting swaps the evicted
  slot with the last live one. Both are O(1) and static-shape, and `table` / `length` are exactly
  the index table the Pallas gather-attention kernel reads.
- `pos` holds each slot's original token position (-1 when free), so the XLA path can attend over
  the whole pool with a mask instead of gathering, and methods can reason about recency. (Attention over the
  pool lives in `pask_jax.attention`.)
- `role` holds each entry's structural role id (prompt or generated), for structure-aware methods.
- `tool` holds, for a prompt entry inside an offered tool's definition, that tool's index (-1 otherwise), so a
  method can let the tools not called go once the parser knows the called one.
- `score` holds the method's keep-priority of each entry (attention mass, recency, policy priority...);
  the engine evicts the live entry the method ranks lowest.

Entries are stored in the format `storage.slots` says (`pask_jax.storage`): full precision, or per-token codes with
their scales, quantized as they are written. With `storage.blocks`, the group also has a block pool
(`pask_jax.block_pool`): low-precision entries a block at a time, entering at prefill (whole blocks of the kept
prompt, the oldest or those the method ranks lowest first) or by `take_down` (the oldest or lowest-ranked slot
entries going down, KIVI's window flush). With `storage.second_blocks` it has a second block pool, and the caller
says which pool each entry goes down into (TriAxialKV's tags); a block holds entries of its own pool only.

Every array carries a leading layer axis Lg (the group's layers); `layer` arguments index it.

On a device mesh, `axes` names the mesh axes of the sequence and KV-head dimensions (None: whole); `constrain` lays
every array out by them while a mesh is active, and the Pallas kernel then runs per shard (`jax.shard_map`): each
(sequence, KV head) is independent, so nothing is exchanged between devices.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from pask_jax.block_pool import BlockPool
from pask_jax.kernels.quantize import QuantizedBlock, dequantize, quantize
from pask_jax.storage import Storage


def _set_slots(
    x: jax.Array, layer: int, slot: jax.Array, value: jax.Array, axes: tuple[str | None, str | None]
) -> jax.Array:
    """x[layer, b, h, slot[b, h]] = value[b, h] for every (sequence b, head h); out-of-range slots are skipped.

    x: [Lg, B, K, C, ...], slot: i32[B, K], value: [B, K, ...]. On an active mesh the scatter runs per shard
    (`jax.shard_map` over the cache's `axes`): every device writes its own rows, in place, and nothing is gathered.
    """

    def scatter(x: jax.Array, slot: jax.Array, value: jax.Array) -> jax.Array:
        rows, heads = jnp.arange(x.shape[1])[:, None], jnp.arange(x.shape[2])[None, :]
        return x.at[layer, rows, heads, slot].set(value, mode="drop")

    if jax.sharding.get_abstract_mesh().empty:
        return scatter(x, slot, value)
    per_head = P(*axes)
    return jax.shard_map(scatter, in_specs=(P(None, *axes), per_head, per_head), out_specs=P(None, *axes))(
        x, slot, value
    )


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class GroupCache:
    """Slot pool of one layer group, and its block pool when the storage has one."""

    k: QuantizedBlock  # codes f[Lg, B, K, C, H] at full precision, else the slot format's codes and scales
    v: QuantizedBlock  # as k
    pos: jax.Array  # i16[Lg, B, K, C]   original position of the slot's token, -1 if free (or i32: `Storage`)
    role: jax.Array  # i8[Lg, B, K, C]   structural role id of the slot's token
    tool: jax.Array  # i16[Lg, B, K, C]  index of the offered tool the slot's prompt token describes, -1 if none
    score: jax.Array  # f32[Lg, B, K, C] the method's keep-priority of the slot's entry
    table: jax.Array  # i32[Lg, B, K, C] slot permutation: first `length` live, rest free
    length: jax.Array  # i32[Lg, B, K]    live slots
    overflow: jax.Array  # bool[]          a write found no free slot (the engine raises)
    blocks: BlockPool | None = None  # the low-precision block pool (`storage.blocks`), None without one
    second_blocks: BlockPool | None = None  # the second block pool (`storage.second_blocks`), None without one
    # static (part of the tree structure): how K/V are stored; mesh axes of the sequence and KV-head dimensions
    storage: Storage = dataclasses.field(default=Storage(), metadata=dict(static=True))
    axes: tuple[str | None, str | None] = dataclasses.field(default=(None, None), metadata=dict(static=True))

    @property
    def capacity(self) -> int:
        return self.pos.shape[3]

    @property
    def block_pools(self) -> tuple[BlockPool, ...]:
        """The block pools, in the order of `storage.block_pools` (an entry's pool index is its place here)."""
        return tuple(pool for pool in (self.blocks, self.second_blocks) if pool is not None)

    def with_block_pools(self, pools: list[BlockPool]) -> GroupCache:
        return dataclasses.replace(self, **dict(zip(("blocks", "second_blocks"), pools, strict=False)))

    @classmethod
    def empty(
        cls,
        layers: int,
        batch: int,
        kv_heads: int,
        capacity: int,
        head_dim: int,
        dtype,
        axes: tuple[str | None, str | None] = (None, None),
        storage: Storage = Storage(),
        blocks: int | tuple[int, ...] = 0,
    ) -> GroupCache:
        """An empty cache: `capacity` slots and, with block pools, `blocks` blocks per (layer, sequence, head) in each
        (one number for every pool, or one per pool)."""
        shape = (layers, batch, kv_heads, capacity)
        kv = quantize(jnp.zeros((*shape, head_dim), dtype), storage.slots)
        counts = (blocks,) * len(storage.block_pools) if isinstance(blocks, int) else blocks
        pools = [
            BlockPool.empty(layers, batch, kv_heads, max(n, 1), head_dim, formats, storage.position_dtype)
            for n, formats in zip(counts, storage.block_pools, strict=True)
        ]
        return (
            cls(
                k=kv,
                v=kv,
                pos=jnp.full(shape, -1, storage.position_dtype),
                role=jnp.zeros(shape, jnp.int8),
                tool=jnp.full(shape, -1, jnp.int16),
                score=jnp.zeros(shape, jnp.float32),
                table=jnp.broadcast_to(jnp.arange(capacity, dtype=jnp.int32), shape),
                length=jnp.zeros(shape[:-1], jnp.int32),
                overflow=jnp.zeros((), bool),
                storage=storage,
                axes=axes,
            )
            .with_block_pools(pools)
            .constrain()
        )

    def partition_specs(self) -> GroupCache:
        """The PartitionSpec of every array, as a GroupCache (sequence and KV-head dimensions per `axes`)."""
        rows = (None, *self.axes)  # [Lg, B, K]
        per_slot = jax.tree.map(lambda x: P(*rows, *([None] * (x.ndim - 3))), self.k)
        return dataclasses.replace(
            self,
            k=per_slot,
            v=per_slot,
            pos=P(*rows, None),
            role=P(*rows, None),
            tool=P(*rows, None),
            score=P(*rows, None),
            table=P(*rows, None),
            length=P(*rows),
            overflow=P(),
        ).with_block_pools([pool.partition_specs(self.axes) for pool in self.block_pools])

    def constrain(self) -> GroupCache:
        """Every array constrained to its `partition_specs` while a mesh is active (tracing); else unchanged."""
        if jax.sharding.get_abstract_mesh().empty:
            return self
        return jax.tree.map(
            jax.lax.with_sharding_constraint, self, self.partition_specs(), is_leaf=lambda x: isinstance(x, P)
        )

    def slot_kv(self, layer: int) -> tuple[jax.Array, jax.Array]:  # f[B, K, C, H] each
        """One layer's slot-pool keys and values as attention reads them (dequantized unless full precision)."""
        if self.storage.slots.full:
            return self.k.codes[layer], self.v.codes[layer]
        fmt = self.storage.slots
        return (dequantize(jax.tree.map(lambda x: x[layer], kv), fmt) for kv in (self.k, self.v))

    def fill(
        self,
        layer: int,
        k: jax.Array,  # f[B, P, K, H] the prompt's keys for this layer
        v: jax.Array,  # f[B, P, K, H]
        positions: jax.Array,  # i32[B, P]
        roles: jax.Array,  # i32[B, P]
        keep: jax.Array,  # i32[B, K, n] prompt indices to keep, n <= C (+ the block pool's entries)
        count: jax.Array,  # i32[B, K] how many of `keep` are real (the rest is padding)
        scores: jax.Array | None = None,  # f32[B, K, P] the method's prefill scores
        tools: jax.Array | None = None,  # i32[B, P] the tool each prompt token describes (None: none)
        down: jax.Array | None = None,  # f32[B, K, P] with a block pool: the order entries go down (None: oldest first)
        high: jax.Array | None = None,  # i32[B, K] with a block pool: kept entries to leave in slots (None: 0)
        pools: jax.Array | None = None,  # i32[B, P] with block pools: the pool each prompt entry goes into (None: 0)
    ) -> GroupCache:
        """Load the kept prompt entries of one layer (the cache must be empty): into slots 0..count-1, or with a
        block pool whole blocks of them, lowest in `down` first, into blocks (all but `high` of them and a
        remainder; with two pools, whole blocks of each pool's entries into that pool) and the rest into slots."""
        kept_k = jnp.take_along_axis(k.transpose(0, 2, 1, 3), keep[..., None], axis=2)  # [B, K, n, H]
        kept_v = jnp.take_along_axis(v.transpose(0, 2, 1, 3), keep[..., None], axis=2)
        kept_pos = jnp.take_along_axis(positions[:, None], keep, axis=2)  # [B, K, n]
        kept_role = jnp.take_along_axis(roles[:, None], keep, axis=2)
        kept_tool = (
            jnp.full(keep.shape, -1, jnp.int32) if tools is None else jnp.take_along_axis(tools[:, None], keep, 2)
        )
        kept_score = jnp.zeros(keep.shape, jnp.float32) if scores is None else jnp.take_along_axis(scores, keep, axis=2)
        kept = [kept_k, kept_v, kept_pos, kept_role, kept_tool, kept_score]
        cache = self
        if self.blocks is not None:
            order = kept_pos if down is None else jnp.take_along_axis(down, keep, axis=2)
            kept_pool = jnp.zeros_like(keep) if pools is None else jnp.take_along_axis(pools[:, None], keep, axis=2)
            cache, kept, count = self._fill_blocks(layer, kept, count, order, 0 if high is None else high, kept_pool)
        kept_k, kept_v, kept_pos, kept_role, kept_tool, kept_score = kept
        n = keep.shape[-1] if self.blocks is None else kept_pos.shape[-1]
        if n > self.capacity:
            raise ValueError(f"keeping {n} prompt entries per head exceeds the group capacity {self.capacity}")
        live = jnp.arange(n) < count[..., None]  # [B, K, n]
        fmt = self.storage.slots
        put = lambda pool, new: pool.at[layer, :, :, :n].set(new.astype(pool.dtype))  # noqa: E731
        return dataclasses.replace(
            cache,
            k=jax.tree.map(put, self.k, quantize(kept_k.astype(self.k.codes.dtype if fmt.full else jnp.float32), fmt)),
            v=jax.tree.map(put, self.v, quantize(kept_v.astype(self.v.codes.dtype if fmt.full else jnp.float32), fmt)),
            pos=put(self.pos, jnp.where(live, kept_pos, -1)),
            role=put(self.role, kept_role),
            tool=put(self.tool, kept_tool),
            score=put(self.score, kept_score.astype(jnp.float32)),
            length=self.length.at[layer].set(count),
        )

    def _fill_blocks(
        self, layer: int, kept: list[jax.Array], count: jax.Array, order: jax.Array, high, pool: jax.Array
    ):
        """The block pools' share of a fill: the kept entries (each [B, K, n, ...]) lowest in `order` (f[B, K, n])
        first, of each pool's entries (`pool` i32[B, K, n]) whole blocks of all but `high` (i32[B, K]) of them into
        that pool -> (the cache, the entries left for the slots in that order, how many of them are real)."""
        n, block = kept[2].shape[-1], self.storage.block
        real = jnp.arange(n) < count[..., None]  # bool[B, K, n]: after the sort below too (padding sorts last)
        down_first = jnp.argsort(jnp.where(real, order, jnp.inf))
        kept, pool = [_take(x, down_first) for x in kept], _take(pool, down_first)
        in_block = jnp.zeros(pool.shape, bool)  # bool[B, K, n]: the entries that went into a block
        pools = []
        for p, blocks in enumerate(self.block_pools):
            mine = pool == p  # bool[B, K, n]
            whole = min(n // block, blocks.blocks)  # blocks the static shapes can fill
            filled = jnp.minimum(jnp.maximum(jnp.sum(mine & real, -1) - high, 0) // block, whole)  # i32[B, K]
            if whole:  # a prompt shorter than a block keeps it all in slots
                mine_first = jnp.argsort(~mine, axis=-1, stable=True)[..., : whole * block]  # in `order`
                blocks = blocks.fill(layer, *(_take(x, mine_first) for x in kept[:4]), filled)
            in_block |= mine & (jnp.cumsum(mine, axis=-1) <= (filled * block)[..., None])
            pools.append(blocks)
        rest = jnp.argsort(in_block, axis=-1, stable=True)[..., : min(n, self.capacity)]  # the others, in `order`
        return self.with_block_pools(pools), [_take(x, rest) for x in kept], count - in_block.sum(-1)

    def write(
        self,
        layer: int,
        k: jax.Array,  # f[B, K, H] the new token's key
        v: jax.Array,  # f[B, K, H]
        position: jax.Array,  # i32[B]
        role: jax.Array,  # i32[B]
        enter: jax.Array,  # bool[B, K] whether the token enters this (sequence, head)
        score: jax.Array | None = None,  # f32[B, K] its keep-priority
    ) -> GroupCache:
        """Append one token to the free slot `table[length]` of every (sequence, head) it enters."""
        length = self.length[layer]  # [B, K]
        full = length >= self.capacity
        slot = jnp.take_along_axis(self.table[layer], jnp.minimum(length, self.capacity - 1)[..., None], axis=-1)
        write = enter & ~full
        slot = jnp.where(write, slot[..., 0], self.capacity)  # out of range: the scatter drops it
        per_head = slot.shape  # (B, K)

        def store(pool: QuantizedBlock, x: jax.Array) -> QuantizedBlock:  # x f[B, K, H] -> the slot format
            new = quantize(x[:, :, None].astype(pool.codes.dtype if fmt.full else jnp.float32), fmt)
            return jax.tree.map(
                lambda p, n: _set_slots(p, layer, slot, n[:, :, 0].astype(p.dtype), self.axes), pool, new
            )

        fmt = self.storage.slots
        return dataclasses.replace(
            self,
            k=store(self.k, k),
            v=store(self.v, v),
            pos=_set_slots(
                self.pos, layer, slot, jnp.broadcast_to(position[:, None], per_head).astype(self.pos.dtype), self.axes
            ),
            role=_set_slots(
                self.role, layer, slot, jnp.broadcast_to(role[:, None], per_head).astype(jnp.int8), self.axes
            ),
            tool=_set_slots(self.tool, layer, slot, jnp.full(per_head, -1, jnp.int16), self.axes),  # generated
            score=self.score if score is None else _set_slots(self.score, layer, slot, score, self.axes),
            length=self.length.at[layer].add(write.astype(jnp.int32)),
            overflow=self.overflow | jnp.any(enter & full),
        )

    def evict(self, layer: int, slot: jax.Array, do: jax.Array) -> GroupCache:
        """Free `slot` (i32[B, K]) where `do` (bool[B, K]); it must be live. Swap-with-last keeps `table` valid."""
        table, length = self.table[layer], self.length[layer]  # [B, K, C], [B, K]
        do = do & (length > 0)
        index = jnp.argmax(table == slot[..., None], axis=-1)  # where the slot sits in the table
        last = length - 1
        last_slot = jnp.take_along_axis(table, jnp.maximum(last, 0)[..., None], axis=-1)[..., 0]
        drop = self.capacity  # out-of-range index: the scatter skips heads that do not evict
        table = _set_slots(self.table, layer, jnp.where(do, index, drop), last_slot, self.axes)
        table = _set_slots(table, layer, jnp.where(do, last, drop), slot, self.axes)
        return dataclasses.replace(
            self,
            table=table,
            length=self.length.at[layer].add(-do.astype(jnp.int32)),
            pos=_set_slots(
                self.pos, layer, jnp.where(do, slot, drop), jnp.full(slot.shape, -1, self.pos.dtype), self.axes
            ),
        )

    def take_down(
        self,
        layer: int,
        do: jax.Array,
        order: jax.Array | None = None,
        pool: jax.Array | None = None,
        forced: jax.Array | None = None,
    ) -> GroupCache:
        """Move the `block` live slot entries lowest in `order` (f32[B, K, C]; None: the oldest) of each (sequence,
        head) in `do` (bool[B, K]) into a free block of the block pool (keys re-quantized per channel over the
        block): KIVI's flush of its full-precision window. With two pools, `pool` (i32[B, K, C]; None: 0) says which
        pool each slot entry goes into, and the block is of the pool whose lowest entry is lowest among those with a
        block of live entries and a free block. Where no pool has both, nothing moves -- unless `forced` (bool[B, K]:
        the bytes are over) and the slots hold a block of live entries: then the lowest `block` of any pool go down
        into the last pool (the lowest precision) that has a free block, rather than anything leave the cache."""
        block = self.storage.block
        pos = self.pos[layer]  # [B, K, C]
        order = pos.astype(jnp.float32) if order is None else order
        ranked = jnp.where(pos >= 0, order, jnp.inf)  # f32[B, K, C]
        pool = jnp.zeros(pos.shape, jnp.int32) if pool is None else pool
        ready, lowest = [], []  # per pool, bool[B, K] and f32[B, K]
        for p, blocks in enumerate(self.block_pools):
            mine = (pool == p) & (pos >= 0)
            ready.append((mine.sum(-1) >= block) & (blocks.count[layer] < blocks.blocks))
            lowest.append(jnp.where(ready[-1], jnp.min(jnp.where(mine, ranked, jnp.inf), -1), jnp.inf))
        target = jnp.argmin(jnp.stack(lowest, -1), axis=-1)  # i32[B, K]: the pool the block goes into
        ready_at_target = jnp.take_along_axis(jnp.stack(ready, -1), target[..., None], axis=-1)[..., 0]
        last = self.block_pools[-1]
        mixed = (
            (False if forced is None else forced)
            & ~jnp.stack(ready, -1).any(-1)
            & ((pos >= 0).sum(-1) >= block)
            & (last.count[layer] < last.blocks)
        )  # bool[B, K]: a block of entries of both pools into the last one
        target = jnp.where(mixed, len(self.block_pools) - 1, target)
        do = do & (ready_at_target | mixed)
        going_here = mixed[..., None] | (pool == target[..., None])
        going = jnp.argsort(jnp.where(going_here, ranked, jnp.inf), axis=-1)[..., :block]  # i32[B, K, T]
        k, v = self.slot_kv(layer)
        picked = [jnp.take_along_axis(x, going[..., None], axis=2) for x in (k, v)]  # f[B, K, T, H]
        picked_pos, picked_role = (jnp.take_along_axis(x[layer], going, axis=2) for x in (self.pos, self.role))
        pools = [
            blocks.append(layer, *picked, picked_pos, picked_role.astype(jnp.int32), do & (target == p))
            for p, blocks in enumerate(self.block_pools)
        ]
        rows, heads = jnp.arange(pos.shape[0])[:, None, None], jnp.arange(pos.shape[1])[None, :, None]
        freed = self.pos.at[layer, rows, heads, jnp.where(do[..., None], going, self.capacity)].set(-1, mode="drop")
        # the table keeps its live slots first, in the order they entered: a stable sort on "freed"
        table = self.table[layer]
        order = jnp.argsort(jnp.take_along_axis(freed[layer], table, axis=-1) < 0, axis=-1, stable=True)
        table = jnp.where(do[..., None], jnp.take_along_axis(table, order, axis=-1), table)
        return dataclasses.replace(
            self,
            pos=freed,
            table=self.table.at[layer].set(table),
            length=self.length.at[layer].add(-block * do.astype(jnp.int32)),
        ).with_block_pools(pools)

    def insert_rows(self, other: GroupCache, rows: jax.Array) -> GroupCache:
        """Replace sequence rows `rows` (i32[b]) with `other`'s b rows (same layers, heads, capacity and storage), as
        a continuous batcher places freshly prefilled requests; a row index past the batch is skipped (padding)."""
        if other.pos.shape[0] != self.pos.shape[0] or other.pos.shape[2:] != self.pos.shape[2:]:
            raise ValueError(f"cannot insert rows of a {other.pos.shape} pool into a {self.pos.shape} one")
        if other.storage != self.storage:
            raise ValueError(f"cannot insert rows stored as {other.storage} into a cache stored as {self.storage}")

        def put(x: jax.Array, y: jax.Array) -> jax.Array:  # axis 1 is the sequence in every per-row array
            return x.at[:, rows].set(y, mode="drop")

        fields = ("k", "v", "pos", "role", "tool", "score", "table", "length", "blocks", "second_blocks")
        return dataclasses.replace(
            self,
            **{name: jax.tree.map(put, getattr(self, name), getattr(other, name)) for name in fields},
            overflow=self.overflow | other.overflow,
        ).constrain()

    def nbytes(self) -> int:
        return sum(math.prod(x.shape) * x.dtype.itemsize for x in jax.tree_util.tree_leaves(self))


def _take(x: jax.Array, index: jax.Array) -> jax.Array:
    """x[b, h, index[b, h, i], ...] for x [B, K, n, ...] and index i32[B, K, m] -> [B, K, m, ...]."""
    return jnp.take_along_axis(x, index.reshape(*index.shape, *([1] * (x.ndim - 3))), axis=2)
