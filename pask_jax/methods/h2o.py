"""H2O (Zhang et al., 2023, "H2O: Heavy-Hitter Oracle for Efficient Generative Inference of Large Language Models",
arXiv 2306.14048).

An entry's score is the attention it has received, accumulated over every query so far and summed over the GQA
group (older tokens accumulate more, as in the paper). Prefill: the column sums of the prompt's causal attention
(valid queries only). Decode (`needs_decode_attention`): each step adds the new query's attention weights; the new
token enters with 0 and accumulates from its own step on.

The budget is split between heavy hitters and a recent window (the paper's 50/50 split: `recent_fraction` = 0.5).
- Decode: the most recent floor(recent_fraction * kept) positions are protected (kept = the entries that stay after
  this step's eviction); among the others the lowest accumulated score leaves.
- Prefill: the engine keeps the top `quota` entries, and the quota is not visible to the method, so the window is
  folded into the ranking: the r-th most recent prompt token scores at least the accumulated score of the
  floor(r (1 - rho) / rho)-th heaviest one. For every quota this keeps ~rho of it as the most recent tokens and the
  rest as the heaviest (exactly H2O's split when the two sets are disjoint; when they overlap both sets extend, where
  H2O would only extend the heavy set). Those recent entries carry the raised score into decode.

Hyper-parameters: `recent_fraction` = 0.5 (the paper's equal heavy / recent budgets).
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp

from pask_jax import attention as attention_ops
from pask_jax.methods.base import PROTECTED, KVMethod, PrefillContext


def accumulated_attention(
    q: jax.Array, k: jax.Array, ctx: PrefillContext, query_start: jax.Array | int = 0
) -> jax.Array:
    """Column sums of causal attention over valid queries and the GQA group -> f32[B, K, T].

    q f[B, C, N, H]: prompt queries at positions query_start .. query_start + C - 1 (the whole prompt from 0, or a
    chunk of it); k f[B, T, K, H]: the prompt's keys. Summed over a prompt's chunks this is the one-pass value. In
    blocks of `attention_ops.QUERY_CHUNK` queries and keys, two passes per query block: the softmax's running max and
    denominator over the keys it sees, then its normalised weights summed into their key columns. Key blocks after a
    query block are skipped (causal): about half the logits of the prompt, and never more than one block's
    [B, K, G, c, c] weights at a time.
    """
    b, chunk, n, h = q.shape
    t, kv_heads = k.shape[1], k.shape[2]
    c = min(attention_ops.QUERY_CHUNK, chunk)
    cp, tp = -(-chunk // c) * c, -(-t // c) * c  # padded to whole blocks; padded keys invisible, queries weigh 0

    def pad(x: jax.Array, to: int) -> jax.Array:
        return jnp.pad(x, ((0, 0), (0, to - x.shape[1])) + ((0, 0),) * (x.ndim - 2))

    qt = jnp.transpose(pad(q, cp).reshape(b, cp, kv_heads, n // kv_heads, h), (0, 2, 3, 1, 4))  # [B, K, G, Cp, H]
    kt = jnp.transpose(pad(k, tp), (0, 2, 1, 3))  # [B, K, Tp, H]
    query_pos = query_start + jnp.arange(cp)  # i32[Cp]
    query_valid = (jnp.arange(cp) < chunk)[None] & (query_pos[None] < ctx.lengths[:, None])  # bool[B, Cp]
    key_pos, key_valid = jnp.arange(tp), pad(ctx.valid, tp)  # i32[Tp], bool[B, Tp]

    def block(x: jax.Array, i: jax.Array, axis: int) -> jax.Array:
        return jax.lax.dynamic_slice_in_dim(x, i * c, c, axis=axis)

    def logits(i: jax.Array, j: jax.Array) -> tuple[jax.Array, jax.Array]:  # -> f32[B, K, G, c, c], bool[B, c, c]
        visible = (block(query_pos, i, 0)[:, None] >= block(key_pos, j, 0)[None, :])[None] & block(key_valid, j, 1)[
            :, None, :
        ]
        return attention_ops.grouped_logits(block(qt, i, 3), block(kt, j, 2)), visible[:, None, None]

    def query_block(i: jax.Array, acc: jax.Array) -> jax.Array:
        seen = jnp.minimum((query_start + (i + 1) * c - 1) // c + 1, tp // c)  # key blocks up to the causal edge

        def normaliser(j, carry):  # online max and denominator over key block j
            row_max, denom = carry
            x, visible = logits(i, j)
            new_max = jnp.maximum(row_max, jnp.where(visible, x, -1e30).max(axis=-1))
            terms = jnp.where(visible, jnp.exp(x - new_max[..., None]), 0.0).sum(axis=-1)
            return new_max, denom * jnp.exp(row_max - new_max) + terms

        shape = (b, kv_heads, n // kv_heads, c)
        row_max, denom = jax.lax.fori_loop(0, seen, normaliser, (jnp.full(shape, -1e30), jnp.zeros(shape)))
        weight = block(query_valid, i, 1)[:, None, None].astype(jnp.float32) / jnp.maximum(denom, 1e-30)

        def columns(j, acc):  # key block j's share of query block i's weights, summed over queries and the group
            x, visible = logits(i, j)
            probs = jnp.where(visible, jnp.exp(x - row_max[..., None]), 0.0) * weight[..., None]
            return jax.lax.dynamic_update_slice_in_dim(acc, block(acc, j, 2) + probs.sum(axis=(2, 3)), j * c, axis=2)

        return jax.lax.fori_loop(0, seen, columns, acc)

    acc = jax.lax.fori_loop(0, cp // c, query_block, jnp.zeros((b, kv_heads, tp), jnp.float32))
    return acc[..., :t]


def fold_recent_window(acc: jax.Array, lengths: jax.Array, recent_fraction: float) -> jax.Array:
    """acc f32[B, K, T] -> ranking where any top-k holds ~recent_fraction of the most recent valid tokens."""
    t = acc.shape[-1]
    keys = jnp.arange(t)
    valid = keys < lengths[:, None, None]
    if recent_fraction == 0.0:
        return acc
    heaviest = -jnp.sort(jnp.where(valid, -acc, jnp.inf), axis=-1)  # descending, padding last
    recency = lengths[:, None, None] - 1 - keys  # 0 = the last prompt token
    level = jnp.floor(jnp.maximum(recency, 0) * (1.0 - recent_fraction) / recent_fraction).astype(jnp.int32)
    level = jnp.minimum(level, lengths[:, None, None] - 1)
    floor = jnp.take_along_axis(heaviest, jnp.broadcast_to(level, acc.shape), axis=-1)
    return jnp.where(valid, jnp.maximum(acc, floor), 0.0)


@dataclasses.dataclass(frozen=True)
class H2O(KVMethod):
    name: ClassVar[str] = "h2o"
    needs_decode_attention: ClassVar[bool] = True
    needs_prefill_attention: ClassVar[bool] = True
    recent_fraction: float = 0.5  # share of the kept entries reserved for the most recent tokens

    def __post_init__(self) -> None:
        if not 0.0 <= self.recent_fraction < 1.0:
            raise ValueError(f"H2O recent_fraction={self.recent_fraction} must be in [0, 1)")

    def prefill_observe(self, layer, q, keys, query_start, ctx: PrefillContext) -> jax.Array:
        return accumulated_attention(q, keys, ctx, query_start)

    def prefill_scores(self, observed: list, ctx: PrefillContext) -> list[jax.Array]:
        return [fold_recent_window(acc, ctx.lengths, self.recent_fraction) for acc in observed]

    def new_token_score(self, layer: int, position: jax.Array, role: jax.Array, kv_heads: int) -> jax.Array:
        return jnp.zeros((position.shape[0], kv_heads), jnp.float32)

    def update_scores(self, layer: int, scores: jax.Array, probs: jax.Array) -> jax.Array:
        return scores + probs.sum(axis=2)

    def eviction_priority(self, layer, scores, pos, role, position, prompt_len) -> jax.Array:
        kept = (pos >= 0).sum(axis=-1, keepdims=True) - 1  # entries that stay after this step's eviction
        recent = jnp.floor(self.recent_fraction * kept).astype(jnp.int32)
        protected = pos > position[:, None, None] - recent
        return jnp.where(protected, PROTECTED, scores)
