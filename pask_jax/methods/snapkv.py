"""SnapKV (Li et al., 2024, "SnapKV: LLM Knows What You are Looking for Before Generation", arXiv 2404.14469).

Prefill: the observation window is the last `window` prompt tokens of each sequence (prompts are right-padded to
different lengths, so the window is gathered per sequence from `ctx.lengths`). Their softmax attention over the prompt
is summed over the window queries and the GQA group (one score per KV head, as the cache is shared by the group),
then max-pooled along the keys with `kernel` (stride 1, same padding; positions outside the prefix count as -inf, as
PyTorch's max_pool1d pads). The prefix entries with the highest pooled scores are kept; the window itself is always
kept (PROTECTED; if the quota is smaller than the window, its newest tokens first). Only one layer's
f32[B, K, G, window, T] block is materialised at a time.

Hyper-parameters: `window` = 32 (observation window), `kernel` = 7 (pooling kernel) and `pooling` = "max", the
SnapKV paper's values; "avg" is the authors' code's other choice (average pooling with zero padding, divided by the
kernel, as PyTorch's avg_pool1d with count_include_pad).

Decode rule (SnapKV only compresses the prompt; this keeps it under the running cap): every generated token enters;
when a (layer, sequence, KV head) is over its cap, the lowest-scored prompt entry leaves (non-window entries by
pooled score, then window entries oldest first); once no prompt entry is left, the oldest generated entry leaves.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp

from pask_jax.attention import attention_probs
from pask_jax.methods.base import PROTECTED, KVMethod, PrefillContext

POOLINGS = ("max", "avg")


def window_attention(q: jax.Array, keys: jax.Array, query_start: jax.Array | int, lengths: jax.Array, window: int):
    """The attention the observation window gives each key, summed over the window and the GQA group -> f32[B, K, T].

    q f[B, C, N, H]: prompt queries at positions query_start .. query_start + C - 1 (the whole prompt from 0, or a
    chunk); keys f[B, T, K, H]; lengths i32[B]. Only the window queries inside this chunk count, so the sum over a
    prompt's chunks is the one-pass value (each window query sees all its keys in the chunk it is in).
    """
    c, t = q.shape[1], keys.shape[1]
    qpos = lengths[:, None] - window + jnp.arange(window)  # i32[B, w] each sequence's window positions
    local = qpos - query_start  # the window queries' rows in this chunk
    here = (local >= 0) & (local < c) & (qpos >= 0)  # bool[B, w]; short prompts: fewer rows
    q_win = jnp.take_along_axis(q, jnp.clip(local, 0, c - 1)[:, :, None, None], axis=1)  # [B, w, N, H]
    mask = (jnp.arange(t)[None, None, :] <= qpos[:, :, None]) & here[:, :, None]  # causal
    return attention_probs(q_win, keys, mask).sum(axis=(2, 3))  # [B, K, T]


def window_scores(summed: jax.Array, lengths: jax.Array, window: int, kernel: int, pooling: str = "max") -> jax.Array:
    """SnapKV's scores of one layer from its `window_attention` f32[B, K, T] -> f32[B, K, T].

    Prefix entries get the pooled window attention (>= 0), window entries PROTECTED * (1 + small rank, newest
    highest), padding 0.
    """
    keys = jnp.arange(summed.shape[-1])
    start = jnp.maximum(lengths - window, 0)[:, None, None]  # first window position
    prefix = keys < start
    pooled = pool_keys(summed, prefix, kernel, pooling)
    in_window = (keys >= start) & (keys < lengths[:, None, None])
    protected = PROTECTED * (1.0 + 1e-3 * (keys - start + 1) / window)  # distinct in float32, newest highest
    return jnp.where(in_window, protected, jnp.where(prefix, pooled, 0.0)).astype(jnp.float32)


def pool_keys(scores: jax.Array, inside: jax.Array, kernel: int, pooling: str) -> jax.Array:
    """Pool f32[B, K, T] scores along the keys (stride 1, same padding) over the keys where `inside` holds.

    "max": positions outside count as -inf (PyTorch's max_pool1d padding); "avg": as 0, divided by the kernel
    (avg_pool1d with count_include_pad)."""
    padding = ((0, 0), (0, 0), (kernel // 2, (kernel - 1) // 2))
    if pooling == "max":
        return jax.lax.reduce_window(
            jnp.where(inside, scores, -jnp.inf), -jnp.inf, jax.lax.max, (1, 1, kernel), (1, 1, 1), padding
        )
    summed = jax.lax.reduce_window(jnp.where(inside, scores, 0.0), 0.0, jax.lax.add, (1, 1, kernel), (1, 1, 1), padding)
    return summed / kernel


def prompt_first_priority(scores: jax.Array, pos: jax.Array, prompt_len: jax.Array) -> jax.Array:
    """Decode rule of prefill-only methods: prompt entries leave first, lowest score first, then generated ones,
    oldest first. Prompt scores (>= 0) map to -1/score < 0 (order kept, full float32 precision, PROTECTED last);
    generated entries get their position (> 0)."""
    generated = pos >= prompt_len[:, None, None]
    return jnp.where(generated, pos.astype(jnp.float32), -1.0 / jnp.maximum(scores, 1e-30))


@dataclasses.dataclass(frozen=True)
class SnapKV(KVMethod):
    name: ClassVar[str] = "snapkv"
    needs_prefill_attention: ClassVar[bool] = True
    window: int = 32  # observation window (last prompt tokens)
    kernel: int = 7  # pooling kernel along the keys
    pooling: str = "max"  # or "avg"

    def __post_init__(self) -> None:
        if self.window < 1 or self.kernel < 1:
            raise ValueError(f"SnapKV window={self.window} and kernel={self.kernel} must be >= 1")
        if self.pooling not in POOLINGS:
            raise ValueError(f"SnapKV pooling={self.pooling!r} must be one of {POOLINGS}")

    def prefill_observe(self, layer, q, keys, query_start, ctx: PrefillContext) -> jax.Array:
        return window_attention(q, keys, query_start, ctx.lengths, self.window)

    def prefill_scores(self, observed: list, ctx: PrefillContext) -> list[jax.Array]:
        return [window_scores(s, ctx.lengths, self.window, self.kernel, self.pooling) for s in observed]

    def eviction_priority(self, layer, scores, pos, role, position, prompt_len) -> jax.Array:
        return prompt_first_priority(scores, pos, prompt_len)
