"""The interface every KV-compression method implements (kvpress-style: a method scores, the engine applies).

A method answers three questions, all inside jitted code with static shapes:
- `capacity`: how many slots per (layer, sequence, KV head) the cache needs (sized from the budget);
- `prefill_keep`: which prompt entries of one layer to keep, as indices per (sequence, KV head);
- `decode_enter` / `decode_evict`: whether a new token enters and which entry leaves (running cap).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp


class KVMethod:
    name = "base"

    def capacity(self, prompt_len: int, max_new_tokens: int, budget: float) -> int:
        """Slots per (layer, sequence, KV head) for prompts up to `prompt_len` plus `max_new_tokens`."""
        raise NotImplementedError

    def prefill_keep(
        self,
        layer: int,
        q: jax.Array,  # f[B, P, N, H] the prompt's queries (RoPE applied)
        k: jax.Array,  # f[B, P, K, H]
        valid: jax.Array,  # bool[B, P]
        capacity: int,
    ) -> tuple[jax.Array, jax.Array]:  # keep i32[B, K, n <= capacity], count i32[B, K]
        raise NotImplementedError


def keep_all_valid(k: jax.Array, valid: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Indices 0..P-1 for every head and the count of valid prompt tokens: the full-KV selection."""
    b, p, kv_heads, _ = k.shape
    keep = jnp.broadcast_to(jnp.arange(p, dtype=jnp.int32), (b, kv_heads, p))
    count = jnp.broadcast_to(valid.sum(-1, dtype=jnp.int32)[:, None], (b, kv_heads))
    return keep, count


SLACK = 1  # the token being written: every method's running cap is kept(t) <= b * full(t) + SLACK per (layer, head)


def budget_capacity(prompt_len: int, max_new_tokens: int, budget: float) -> int:
    """Slots per (layer, sequence, KV head) that a uniform share of budget b needs at the last step."""
    if not 0.0 < budget <= 1.0:
        raise ValueError(f"budget={budget} must be in (0, 1]")
    return math.ceil(round(budget * (prompt_len + max_new_tokens), 6)) + SLACK
