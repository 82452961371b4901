"""Random: keep a seeded random subset of the prompt; during decode a random live entry leaves.

The floor every method must beat. Scores are a hash of (seed, layer, position), so runs are reproducible and a
batch gives each sequence the same choices it would get alone.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp

from pask_jax.methods.base import KVMethod, PrefillContext


def position_noise(seed: int, layer: int, positions: jax.Array, kv_heads: int) -> jax.Array:
    """Uniform [0, 1) per (KV head, position): i32[B, ...] -> f32[B, K, ...]; a pure function of its inputs."""
    key = jax.random.fold_in(jax.random.key(seed), layer)
    head_keys = jax.vmap(lambda h: jax.random.fold_in(key, h))(jnp.arange(kv_heads))

    def one(head_key, p):
        return jax.random.uniform(jax.random.fold_in(head_key, p))

    per_head = jax.vmap(lambda hk: jax.vmap(one, in_axes=(None, 0))(hk, positions.reshape(-1)))(head_keys)
    return jnp.moveaxis(per_head.reshape(kv_heads, *positions.shape), 0, 1)


@dataclasses.dataclass(frozen=True)
class RandomKV(KVMethod):
    name: ClassVar[str] = "random"
    seed: int = 0

    def prefill_scores(self, observed: list, ctx: PrefillContext) -> list[jax.Array]:
        return [position_noise(self.seed, layer, ctx.positions, ctx.kv_heads) for layer in range(len(observed))]

    def new_token_score(self, layer: int, position: jax.Array, role: jax.Array, kv_heads: int) -> jax.Array:
        return position_noise(self.seed, layer, position, kv_heads)
