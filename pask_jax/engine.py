"""Batched generation: one jitted prefill per (batch, length bucket), then a jitted decode step per token.

Data flow per request batch:
  prompts -> right-padded to a length bucket -> prefill (full causal attention over the prompt; the
  method picks which prompt entries each layer's cache keeps) -> ragged KV cache -> decode steps.
Each decode step runs the model on one token per sequence, writes its K/V into the cache, attends to
the live slots, applies the host-supplied token mask (packed bits, as grammar engines write them),
and samples. The host loop only moves B token ids (and B kept-entry counts) per step.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from pask_jax.cache import GroupCache, layer_groups
from pask_jax.methods import FullKV, KVMethod
from pask_jax.models.qwen3 import Qwen3, attention

DEFAULT_LENGTH_BUCKETS = (64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768)
NEW_TOKEN_BUCKET = 64  # decode capacity grows in steps of this, so nearby max_new_tokens share a compile


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


@dataclasses.dataclass
class RequestStats:
    prompt_tokens: int
    generated_tokens: int = 0
    ttft_s: float = 0.0  # prefill + first token, seen on the host
    token_times_s: list[float] = dataclasses.field(default_factory=list)  # wall time of each decode step
    kept_ratios: list[float] = dataclasses.field(default_factory=list)  # kept/full KV entries after each step

    @property
    def kept_ratio_mean(self) -> float:
        return float(np.mean(self.kept_ratios)) if self.kept_ratios else 1.0

    @property
    def kept_ratio_max(self) -> float:
        return float(np.max(self.kept_ratios)) if self.kept_ratios else 1.0


@dataclasses.dataclass
class Generation:
    tokens: list[int]
    finish_reason: str  # "stop" | "length"
    stats: RequestStats


# The host side of constrained decoding (the grammar issue implements it): before each step it gives the
# allowed tokens as packed bits i32[B, ceil(V/32)]; after it, it is told the sampled tokens and returns their
# role ids i32[B] (stored with the cache entries).
class TokenConstraint:
    def mask(self) -> np.ndarray:
        raise NotImplementedError

    def advance(self, tokens: np.ndarray) -> np.ndarray:
        raise NotImplementedError


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
def _sample_masked(logits: jax.Array, bits: jax.Array, key: jax.Array, temperature: float, top_p: float) -> jax.Array:
    """Apply the packed token mask (i32[B, ceil(V/32)]) to f32[B, V] logits, then sample -> i32[B]."""
    return sample(jnp.where(unpack_mask(bits, logits.shape[-1]), logits, -jnp.inf), key, temperature, top_p)


def _bucket(n: int, buckets: Sequence[int], what: str) -> int:
    for b in buckets:
        if n <= b:
            return b
    raise ValueError(f"{what} of {n} tokens exceeds the largest length bucket {buckets[-1]}")


class Engine:
    """Batched prefill + jitted decode over a ragged, budget-sized KV cache.

    `method` decides what the cache keeps (Full KV by default); `num_groups` consecutive layer groups
    each own a slot pool; `use_kernel` switches decode attention from the XLA path to the Pallas kernel.
    """

    def __init__(
        self,
        model: Qwen3,
        *,
        method: KVMethod | None = None,
        budget: float = 1.0,
        num_groups: int = 4,
        use_kernel: bool = False,
        stop_token_ids: Sequence[int] = (),
        length_buckets: Sequence[int] = DEFAULT_LENGTH_BUCKETS,
        max_context: int | None = None,
    ):
        if not 0.0 < budget <= 1.0:
            raise ValueError(f"budget={budget} must be in (0, 1]")
        self.cfg = model.config
        self.graphdef, self.params = nnx.split(model)
        self.method = method or FullKV()
        self.budget = budget
        self.groups = layer_groups(self.cfg.num_layers, min(num_groups, self.cfg.num_layers))
        self.use_kernel = use_kernel
        self.stop_token_ids = frozenset(int(t) for t in stop_token_ids)
        self.length_buckets = tuple(sorted(length_buckets))
        self.max_context = max_context
        self.dtype = model.embed.embedding.dtype
        # One compiled function per static signature; the cache (argument 1) is donated to each step.
        self._prefill = jax.jit(self._prefill_fn, static_argnums=(4,))
        self._decode = jax.jit(self._decode_fn, static_argnums=(7, 8), donate_argnums=(1,))

    # ---- jitted bodies ----

    def _layer_slot(self, layer: int) -> tuple[int, int]:
        for g, (start, stop) in enumerate(self.groups):
            if start <= layer < stop:
                return g, layer - start
        raise IndexError(layer)

    def _prefill_fn(self, params, tokens, lengths, roles, capacity: int):
        """tokens i32[B, T], lengths i32[B], roles i32[B, T] -> last-token logits f32[B, V], caches."""
        model = nnx.merge(self.graphdef, params)
        b, t = tokens.shape
        positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
        valid = positions < lengths[:, None]
        mask = (positions[:, :, None] >= positions[:, None, :]) & valid[:, None, :]
        cfg = self.cfg
        caches = [
            GroupCache.empty(stop - start, b, cfg.num_kv_heads, capacity, cfg.head_dim, self.dtype)
            for start, stop in self.groups
        ]

        def attend(layer, q, k, v):
            g, li = self._layer_slot(layer)
            keep, count = self.method.prefill_keep(layer, q, k, valid, capacity)
            caches[g] = caches[g].fill(li, k, v, positions, roles, keep, count)
            return attention(q, k, v, mask)

        hidden = model.forward(tokens, positions, attend)
        last = hidden[jnp.arange(b), lengths - 1][:, None]  # only the last prompt token needs logits
        return model.logits(last)[:, 0], caches

    def _decode_fn(self, params, caches, tokens, positions, roles, mask_bits, key, temperature, top_p):
        """One token per sequence: write its K/V, attend to the cache, mask, sample."""
        model = nnx.merge(self.graphdef, params)
        b = tokens.shape[0]
        caches = list(caches)

        def attend(layer, q, k, v):
            g, li = self._layer_slot(layer)
            enter = jnp.ones((b, self.cfg.num_kv_heads), bool)
            caches[g] = caches[g].write(li, k[:, 0], v[:, 0], positions, roles, enter)
            return caches[g].attend(li, q[:, 0], self.use_kernel)[:, None]

        hidden = model.forward(tokens[:, None], positions[:, None], attend)
        logits = model.logits(hidden)[:, 0]
        next_tokens = _sample_masked(logits, mask_bits, key, temperature, top_p)
        kept = sum(c.length.sum(axis=(0, 2)) for c in caches)  # i32[B] over layers and heads
        overflow = jnp.stack([c.overflow for c in caches]).any()
        return next_tokens, caches, kept, overflow

    # ---- host loop ----

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        sampling: SamplingConfig = SamplingConfig(),
        *,
        prompt_roles: Sequence[Sequence[int]] | None = None,
        constraint: TokenConstraint | None = None,
        on_step: Callable[[int, np.ndarray], None] | None = None,
    ) -> list[Generation]:
        """Generate for a batch of token-id prompts; returns one Generation per prompt, in order."""
        if not prompts or any(len(p) == 0 for p in prompts):
            raise ValueError("every prompt needs at least one token")
        cfg = self.cfg
        n = len(prompts)
        lengths = np.array([len(p) for p in prompts], np.int32)
        longest = int(lengths.max())
        if self.max_context is not None and longest + sampling.max_new_tokens > self.max_context:
            raise ValueError(
                f"prompt of {longest} tokens + max_new_tokens={sampling.max_new_tokens} exceeds the context "
                f"limit {self.max_context}"
            )
        if any(t < 0 or t >= cfg.vocab_size for p in prompts for t in p):
            raise ValueError(f"prompt token ids must be in [0, {cfg.vocab_size})")
        t_bucket = _bucket(longest, self.length_buckets, "a prompt")
        b_bucket = 1 << (n - 1).bit_length()  # batch padded to a power of two: few compiles
        tokens = np.zeros((b_bucket, t_bucket), np.int32)
        roles = np.zeros((b_bucket, t_bucket), np.int32)
        for i, p in enumerate(prompts):
            tokens[i, : len(p)] = p
            if prompt_roles is not None:
                roles[i, : len(p)] = prompt_roles[i]
        all_lengths = np.ones(b_bucket, np.int32)
        all_lengths[:n] = lengths
        new_bucket = -(-sampling.max_new_tokens // NEW_TOKEN_BUCKET) * NEW_TOKEN_BUCKET
        capacity = self.method.capacity(t_bucket, new_bucket, self.budget)

        start = time.perf_counter()
        logits, caches = self._prefill(self.params, tokens, all_lengths, roles, capacity)
        no_constraint = jnp.full((b_bucket, -(-cfg.vocab_size // 32)), -1, jnp.int32)
        key = jax.random.key(sampling.seed)
        # The first token comes from the prefill logits: one decode step per later token.
        bits = no_constraint if constraint is None else _pad_rows(constraint.mask(), b_bucket)
        key, sub = jax.random.split(key)
        current = np.asarray(_sample_masked(logits, bits, sub, sampling.temperature, sampling.top_p))
        ttft = time.perf_counter() - start

        stats = [RequestStats(prompt_tokens=int(lengths[i]), ttft_s=ttft) for i in range(n)]
        outputs: list[list[int]] = [[] for _ in range(n)]
        done = np.zeros(b_bucket, bool)
        done[n:] = True
        finish = ["length"] * n
        full_per_token = cfg.num_layers * cfg.num_kv_heads
        positions = all_lengths.copy()
        for step in range(sampling.max_new_tokens):
            for i in np.flatnonzero(~done[:n]):
                outputs[i].append(int(current[i]))
                stats[i].generated_tokens += 1
                if int(current[i]) in self.stop_token_ids:
                    done[i], finish[i] = True, "stop"
            if on_step is not None:
                on_step(step, current[:n])
            step_roles = np.zeros(b_bucket, np.int32)
            if constraint is not None:
                step_roles[:n] = constraint.advance(current[:n])
            if done.all() or step == sampling.max_new_tokens - 1:
                break
            t0 = time.perf_counter()
            bits = no_constraint if constraint is None else _pad_rows(constraint.mask(), b_bucket)
            key, sub = jax.random.split(key)
            next_tokens, caches, kept, overflow = self._decode(
                self.params, caches, current, positions, step_roles, bits, sub, sampling.temperature, sampling.top_p
            )
            current, kept = np.asarray(next_tokens), np.asarray(kept)
            if bool(overflow):
                raise RuntimeError(f"KV cache overflow: method {self.method.name!r} exceeded capacity {capacity}")
            dt = time.perf_counter() - t0
            for i in np.flatnonzero(~done[:n]):
                stats[i].token_times_s.append(dt)
                stats[i].kept_ratios.append(kept[i] / (full_per_token * (positions[i] + 1)))
            positions += 1
        return [Generation(outputs[i], finish[i], stats[i]) for i in range(n)]


def _pad_rows(bits: np.ndarray, rows: int) -> np.ndarray:
    out = np.full((rows, bits.shape[1]), -1, np.int32)
    out[: bits.shape[0]] = bits
    return out
