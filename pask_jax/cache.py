"""Statically shaped ragged KV cache.

Layers are split into G consecutive layer groups; each group owns a slot pool of fixed capacity C_g
per (layer, sequence, KV head), sized from the budget, so memory shrinks with the budget and shapes
never depend on data. Which slots are live is ragged per (layer, sequence, KV head):

- `table` is a permutation of the C slots: its first `length` entries are the live slots (in the
  order they entered), the rest are free. Writing takes `table[length]`; evicting swaps the evicted
  slot with the last live one. Both are O(1) and static-shape, and `table` / `length` are exactly
  the index table the Pallas gather-attention kernel reads.
- `pos` holds each slot's original token position (-1 when free), so the XLA path can attend over
  the whole pool with a mask instead of gathering, and methods can reason about recency.
- `role` holds each entry's structural role id (prompt or generated), for structure-aware methods.
- `score` holds the method's keep-priority of each entry (attention mass, recency, policy priority...);
  the engine evicts the live entry the method ranks lowest.

Every array carries a leading layer axis Lg (the group's layers); `layer` arguments index it.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

from pask_jax.kernels import gather_attention, masked_softmax


def pool_attention_probs(
    q: jax.Array,  # f[B, K, G, H]
    k: jax.Array,  # f[B, K, C, H]
    live: jax.Array,  # bool[B, K, C]
) -> jax.Array:  # f32[B, K, G, C], zeros on free slots
    logits = jnp.einsum("BKGH,BKCH->BKGC", q, k, preferred_element_type=jnp.float32) / math.sqrt(q.shape[-1])
    return masked_softmax(logits, live[:, :, None])


def pool_attention(
    q: jax.Array,  # f[B, K, G, H]
    k: jax.Array,  # f[B, K, C, H]
    v: jax.Array,  # f[B, K, C, H]
    live: jax.Array,  # bool[B, K, C]
) -> jax.Array:  # f[B, K, G, H]; zeros where no slot is live
    probs = pool_attention_probs(q, k, live)
    return jnp.einsum("BKGC,BKCH->BKGH", probs.astype(v.dtype), v).astype(q.dtype)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class GroupCache:
    """Slot pool of one layer group."""

    k: jax.Array  # f[Lg, B, K, C, H]
    v: jax.Array  # f[Lg, B, K, C, H]
    pos: jax.Array  # i32[Lg, B, K, C]   original position of the slot's token, -1 if free
    role: jax.Array  # i32[Lg, B, K, C]  structural role id of the slot's token
    score: jax.Array  # f32[Lg, B, K, C] the method's keep-priority of the slot's entry
    table: jax.Array  # i32[Lg, B, K, C] slot permutation: first `length` live, rest free
    length: jax.Array  # i32[Lg, B, K]    live slots
    overflow: jax.Array  # bool[]          a write found no free slot (the engine raises)

    @property
    def capacity(self) -> int:
        return self.k.shape[3]

    @classmethod
    def empty(cls, layers: int, batch: int, kv_heads: int, capacity: int, head_dim: int, dtype) -> GroupCache:
        shape = (layers, batch, kv_heads, capacity)
        return cls(
            k=jnp.zeros((*shape, head_dim), dtype),
            v=jnp.zeros((*shape, head_dim), dtype),
            pos=jnp.full(shape, -1, jnp.int32),
            role=jnp.zeros(shape, jnp.int32),
            score=jnp.zeros(shape, jnp.float32),
            table=jnp.broadcast_to(jnp.arange(capacity, dtype=jnp.int32), shape),
            length=jnp.zeros(shape[:-1], jnp.int32),
            overflow=jnp.zeros((), bool),
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
        kept_score = jnp.zeros(keep.shape, jnp.float32) if scores is None else jnp.take_along_axis(scores, keep, axis=2)
        return dataclasses.replace(
            self,
            k=self.k.at[layer, :, :, :n].set(kept_k.astype(self.k.dtype)),
            v=self.v.at[layer, :, :, :n].set(kept_v.astype(self.v.dtype)),
            pos=self.pos.at[layer, :, :, :n].set(kept_pos),
            role=self.role.at[layer, :, :, :n].set(kept_role),
            score=self.score.at[layer, :, :, :n].set(kept_score.astype(jnp.float32)),
            length=self.length.at[layer].set(count),
        )

    def _heads(self) -> tuple[jax.Array, jax.Array]:
        """Index grids (i32[B, 1], i32[1, K]) for scattering one value per (sequence, head)."""
        _, b, h, _ = self.pos.shape
        return jnp.arange(b)[:, None], jnp.arange(h)[None, :]

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
        bi, hi = self._heads()
        return dataclasses.replace(
            self,
            k=self.k.at[layer, bi, hi, slot].set(k.astype(self.k.dtype), mode="drop"),
            v=self.v.at[layer, bi, hi, slot].set(v.astype(self.v.dtype), mode="drop"),
            pos=self.pos.at[layer, bi, hi, slot].set(position[:, None], mode="drop"),
            role=self.role.at[layer, bi, hi, slot].set(role[:, None], mode="drop"),
            score=self.score if score is None else self.score.at[layer, bi, hi, slot].set(score, mode="drop"),
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
        bi, hi = self._heads()
        table = self.table.at[layer, bi, hi, jnp.where(do, index, drop)].set(last_slot, mode="drop")
        table = table.at[layer, bi, hi, jnp.where(do, last, drop)].set(slot, mode="drop")
        return dataclasses.replace(
            self,
            table=table,
            length=self.length.at[layer].add(-do.astype(jnp.int32)),
            pos=self.pos.at[layer, bi, hi, jnp.where(do, slot, drop)].set(-1, mode="drop"),
        )

    def attend(self, layer: int, q: jax.Array, use_kernel: bool = False) -> jax.Array:
        """Decode attention of q (f[B, N, H], RoPE applied) to the live slots of one layer -> f[B, N, H].

        `use_kernel`: the Pallas kernel of `jax.default_backend()` through `pask_jax.kernels.gather_attention` (on
        CPU the TPU kernel, interpreted); otherwise XLA attention over the whole pool.
        For methods that need the attention weights (H2O), use `pool_attention_probs` on the XLA path.
        """
        b, n, h = q.shape
        kv_heads = self.k.shape[2]
        qg = q.reshape(b, kv_heads, n // kv_heads, h)  # [B, K, G, H]
        if use_kernel:  # Pallas: the backend's kernel gathers the live slots named by the table
            out = gather_attention(
                qg, self.k[layer], self.v[layer], self.table[layer], self.length[layer], use_kernel=True
            )
        else:  # XLA: attend over the whole pool with the live mask, no gather
            out = pool_attention(qg, self.k[layer], self.v[layer], self.pos[layer] >= 0)
        return out.reshape(b, n, h)

    def attend_probs(self, layer: int, q: jax.Array) -> tuple[jax.Array, jax.Array]:
        """XLA-path decode attention that also returns the weights: f[B, N, H], f32[B, K, G, C]."""
        b, n, h = q.shape
        kv_heads = self.k.shape[2]
        probs = pool_attention_probs(q.reshape(b, kv_heads, n // kv_heads, h), self.k[layer], self.pos[layer] >= 0)
        out = jnp.einsum("BKGC,BKCH->BKGH", probs.astype(self.v.dtype), self.v[layer]).astype(q.dtype)
        return out.reshape(b, n, h), probs

    def nbytes(self) -> int:
        return sum(math.prod(x.shape) * x.dtype.itemsize for x in jax.tree_util.tree_leaves(self))
