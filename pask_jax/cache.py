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
    """Slot pool of one layer group."""

    k: jax.Array  # f[Lg, B, K, C, H]
    v: jax.Array  # f[Lg, B, K, C, H]
    pos: jax.Array  # i32[Lg, B, K, C]   original position of the slot's token, -1 if free
    role: jax.Array  # i32[Lg, B, K, C]  structural role id of the slot's token
    tool: jax.Array  # i32[Lg, B, K, C]  index of the offered tool the slot's prompt token describes, -1 if none
    score: jax.Array  # f32[Lg, B, K, C] the method's keep-priority of the slot's entry
    table: jax.Array  # i32[Lg, B, K, C] slot permutation: first `length` live, rest free
    length: jax.Array  # i32[Lg, B, K]    live slots
    overflow: jax.Array  # bool[]          a write found no free slot (the engine raises)
    # mesh axes of the sequence and KV-head dimensions (static: part of the tree structure)
    axes: tuple[str | None, str | None] = dataclasses.field(default=(None, None), metadata=dict(static=True))

    @property
    def capacity(self) -> int:
        return self.k.shape[3]

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
    ) -> GroupCache:
        shape = (layers, batch, kv_heads, capacity)
        return cls(
            k=jnp.zeros((*shape, head_dim), dtype),
            v=jnp.zeros((*shape, head_dim), dtype),
            pos=jnp.full(shape, -1, jnp.int32),
            role=jnp.zeros(shape, jnp.int32),
            tool=jnp.full(shape, -1, jnp.int32),
            score=jnp.zeros(shape, jnp.float32),
            table=jnp.broadcast_to(jnp.arange(capacity, dtype=jnp.int32), shape),
            length=jnp.zeros(shape[:-1], jnp.int32),
            overflow=jnp.zeros((), bool),
            axes=axes,
        ).constrain()

    def partition_specs(self) -> GroupCache:
        """The PartitionSpec of every array, as a GroupCache (sequence and KV-head dimensions per `axes`)."""
        rows = (None, *self.axes)  # [Lg, B, K]
        return dataclasses.replace(
            self,
            k=P(*rows, None, None),
            v=P(*rows, None, None),
            pos=P(*rows, None),
            role=P(*rows, None),
            tool=P(*rows, None),
            score=P(*rows, None),
            table=P(*rows, None),
            length=P(*rows),
            overflow=P(),
        )

    def constrain(self) -> GroupCache:
        """Every array constrained to its `partition_specs` while a mesh is active (tracing); else unchanged."""
        if jax.sharding.get_abstract_mesh().empty:
            return self
        return jax.tree.map(
            jax.lax.with_sharding_constraint, self, self.partition_specs(), is_leaf=lambda x: isinstance(x, P)
        )

    def fill(
        self,
        layer: int,
        k: jax.Array,  # f[B, P, K, H] the prompt's keys for this layer
        v: jax.Array,  # f[B, P, K, H]
        positions: jax.Array,  # i32[B, P]
        roles: jax.Array,  # i32[B, P]
        keep: jax.Array,  # i32[B, K, n] prompt indices to keep, n <= C
        count: jax.Array,  # i32[B, K] how many of `keep` are real (the rest is padding)
        scores: jax.Array | None = None,  # f32[B, K, P] the method's prefill scores
        tools: jax.Array | None = None,  # i32[B, P] the tool each prompt token describes (None: none)
    ) -> GroupCache:
        """Load the kept prompt entries of one layer into slots 0..count-1 (the cache must be empty)."""
        n = keep.shape[-1]
        if n > self.capacity:
            raise ValueError(f"keeping {n} prompt entries per head exceeds the group capacity {self.capacity}")
        kept_k = jnp.take_along_axis(k.transpose(0, 2, 1, 3), keep[..., None], axis=2)  # [B, K, n, H]
        kept_v = jnp.take_along_axis(v.transpose(0, 2, 1, 3), keep[..., None], axis=2)
        live = jnp.arange(n) < count[..., None]  # [B, K, n]
        kept_pos = jnp.where(live, jnp.take_along_axis(positions[:, None], keep, axis=2), -1)
        kept_role = jnp.take_along_axis(roles[:, None], keep, axis=2)
        kept_tool = (
            jnp.full(keep.shape, -1, jnp.int32) if tools is None else jnp.take_along_axis(tools[:, None], keep, 2)
        )
        kept_score = jnp.zeros(keep.shape, jnp.float32) if scores is None else jnp.take_along_axis(scores, keep, axis=2)
        return dataclasses.replace(
            self,
            k=self.k.at[layer, :, :, :n].set(kept_k.astype(self.k.dtype)),
            v=self.v.at[layer, :, :, :n].set(kept_v.astype(self.v.dtype)),
            pos=self.pos.at[layer, :, :, :n].set(kept_pos),
            role=self.role.at[layer, :, :, :n].set(kept_role),
            tool=self.tool.at[layer, :, :, :n].set(kept_tool),
            score=self.score.at[layer, :, :, :n].set(kept_score.astype(jnp.float32)),
            length=self.length.at[layer].set(count),
        )

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
        return dataclasses.replace(
            self,
            k=_set_slots(self.k, layer, slot, k.astype(self.k.dtype), self.axes),
            v=_set_slots(self.v, layer, slot, v.astype(self.v.dtype), self.axes),
            pos=_set_slots(self.pos, layer, slot, jnp.broadcast_to(position[:, None], per_head), self.axes),
            role=_set_slots(self.role, layer, slot, jnp.broadcast_to(role[:, None], per_head), self.axes),
            tool=_set_slots(self.tool, layer, slot, jnp.full(per_head, -1, jnp.int32), self.axes),  # generated
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
            pos=_set_slots(self.pos, layer, jnp.where(do, slot, drop), jnp.full(slot.shape, -1, jnp.int32), self.axes),
        )

    def insert_rows(self, other: GroupCache, rows: jax.Array) -> GroupCache:
        """Replace sequence rows `rows` (i32[b]) with `other`'s b rows (same layers, heads and capacity), as a
        continuous batcher places freshly prefilled requests; a row index past the batch is skipped (padding)."""
        if other.k.shape[0] != self.k.shape[0] or other.k.shape[2:] != self.k.shape[2:]:
            raise ValueError(f"cannot insert rows of a {other.k.shape} pool into a {self.k.shape} one")

        def put(x: jax.Array, y: jax.Array) -> jax.Array:  # axis 1 is the sequence in every per-row array
            return x.at[:, rows].set(y, mode="drop")

        fields = ("k", "v", "pos", "role", "tool", "score", "table", "length")
        return dataclasses.replace(
            self,
            **{name: put(getattr(self, name), getattr(other, name)) for name in fields},
            overflow=self.overflow | other.overflow,
        ).constrain()

    def nbytes(self) -> int:
        return sum(math.prod(x.shape) * x.dtype.itemsize for x in jax.tree_util.tree_leaves(self))
