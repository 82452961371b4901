"""Sampling under a grammar's packed token mask: greedy, or temperature with nucleus (top-p)."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class SamplingConfig:
    max_new_tokens: int = 64
    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0
    seed: int = 0

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens={self.max_new_tokens} must be >= 1")
        if self.temperature < 0 or not 0 < self.top_p <= 1:
            raise ValueError(f"temperature={self.temperature} must be >= 0 and top_p={self.top_p} in (0, 1]")


def mask_words(vocab_size: int) -> int:
    """Words per row of a packed token mask (i32[B, ceil(V/32)]): one bit per token id."""
    return -(-vocab_size // 32)


def unpack_mask(bits: jax.Array, vocab: int) -> jax.Array:
    """i32[B, ceil(V/32)] packed bits (bit j of word w = token 32w+j) -> bool[B, V]."""
    ids = jnp.arange(vocab)
    return (jnp.right_shift(bits[:, ids // 32], (ids % 32).astype(jnp.int32)) & 1).astype(bool)


def sample(logits: jax.Array, key: jax.Array, temperature: float, top_p: float) -> jax.Array:
    """f32[B, V] -> i32[B]: greedy when temperature == 0, else temperature + nucleus sampling."""
    if temperature == 0.0:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    logits = logits / temperature
    if top_p < 1.0:
        order = jnp.argsort(-logits, axis=-1)
        sorted_logits = jnp.take_along_axis(logits, order, axis=-1)
        probs = jax.nn.softmax(sorted_logits, axis=-1)
        # drop a token when the mass before it already reaches top_p (the top token always stays)
        drop_sorted = (jnp.cumsum(probs, axis=-1) - probs) >= top_p
        drop = jnp.zeros_like(drop_sorted).at[jnp.arange(logits.shape[0])[:, None], order].set(drop_sorted)
        logits = jnp.where(drop, -jnp.inf, logits)
    return jax.random.categorical(key, logits, axis=-1).astype(jnp.int32)


@functools.partial(jax.jit, static_argnums=(3, 4))
def sample_masked(logits: jax.Array, bits: jax.Array, key: jax.Array, temperature: float, top_p: float) -> jax.Array:
    """Apply the packed token mask (i32[B, ceil(V/32)]) to f32[B, V] logits, then sample -> i32[B]."""
    return sample(jnp.where(unpack_mask(bits, logits.shape[-1]), logits, -jnp.inf), key, temperature, top_p)
