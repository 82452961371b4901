"""The interface every KV-compression method implements (kvpress-style: a method scores, the engine applies).

A method is a small object whose hooks run inside the engine's jitted prefill and decode step:

- `layer_fractions`: the share of the current full length each layer may keep (mean over layers = budget b), and
  `keep_allowance`, the entries that share allows at a full length n (default `fraction_l * n`; PyramidKV's
  KVCache-Factory allotment adds the window on top). The engine sizes each layer group's capacity from it and
  enforces, per (layer, sequence, KV head), the running cap `kept_l(t) <= floor(allowance_l(P + t))` after every
  step; the token being written is the only slack.
- `prefill_observe` (per layer and prompt chunk, during the prompt pass, only if `needs_prefill_attention`) and
  `prefill_scores` (after it): a score per prompt entry, f32[B, K, P]; the engine keeps the top
  `floor(fraction_l * P)` entries of each (sequence, KV head). A long prompt is prefilled in chunks, each attending
  to the keys written before it; what `prefill_observe` returns per chunk is summed over the chunks, so a method
  whose statistic is a sum over queries (attention mass) gets the same scores as from one pass over the prompt.
- `new_token_score`, `update_scores` (with the step's attention weights, only if `needs_decode_attention`) and
  `eviction_priority`: when a step's new token pushes a (layer, sequence, head) over its cap, the live entry with the
  lowest priority leaves; `release_unchosen_tools` may then lower the entries of the offered tools the call being
  written does not call (the parser names the called tool once the function name is written).
- With a block pool (`storage`: KIVI, PASK with precision actions), `prefill_high` (prompt entries that stay at full
  precision in the slot pool at prefill), `down_priority` (which slot entries go down to the block pool first),
  `release_line` (slot entries ranked below it leave before anything goes down) and `block_entry_priority` (what a
  block's entries are worth, a block leaving whole); with two block pools (TriAxialKV), `block_pool` (which pool an
  entry goes down into).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np

from pask_jax.storage import Storage

SLACK = 1  # the token being written: the running cap is kept(t) <= b * full(t) + SLACK per (layer, head)
PROTECTED = 1e30  # priority of entries a method never evicts while others remain


@dataclasses.dataclass
class PrefillContext:
    """What a method may look at when scoring the prompt."""

    tokens: jax.Array  # i32[B, T] right-padded prompts
    positions: jax.Array  # i32[B, T]
    valid: jax.Array  # bool[B, T]
    lengths: jax.Array  # i32[B] prompt lengths P_b
    roles: jax.Array  # i32[B, T] prompt role ids
    kv_heads: int
    # Run extra tokens (i32[B, N] at positions i32[B, N]) after the prompt, causally, without touching the cache;
    # returns per layer the attention mass they give each prompt key, summed over the N queries: f32[B, K, T].
    extra_query_scores: Callable[[jax.Array, jax.Array], list[jax.Array]]
    tools: jax.Array | None = None  # i32[B, T] the offered tool each prompt token describes (-1, NO_TOOL: none)


@dataclasses.dataclass(frozen=True)
class KVMethod:
    """Full-KV defaults; subclasses override what they change.

    Methods are frozen dataclasses: their fields are the hyper-parameters (overridable from a config file), and
    equal methods hash equal, so engines built with them share compiled steps.
    """

    name: ClassVar[str] = "base"
    needs_decode_attention: ClassVar[bool] = False  # True: decode computes attention weights for `update_scores`
    needs_roles: ClassVar[bool] = False  # True: token roles decide what it keeps (generation without any is an error)
    needs_prefill_attention: ClassVar[bool] = False  # True: `prefill_observe` sees each prompt chunk's queries, keys

    def storage(self, budget: float, head_dim: int) -> Storage | None:
        """The storage this method needs at `budget` (KIVI: its block pool), or None: any the engine is given."""
        return None

    def layer_fractions(self, num_layers: int, budget: float) -> np.ndarray:
        return np.full(num_layers, budget)

    def keep_allowance(self, fraction: float, budget: float, full: jax.Array) -> jax.Array:
        """Entries a layer with keep `fraction` may hold at full length `full` (any shape), before the floor.

        Non-decreasing in `full`; its mean over layers is `budget * full`."""
        return fraction * full

    def prefill_observe(
        self, layer: int, q: jax.Array, keys: jax.Array, query_start: jax.Array, ctx: PrefillContext
    ) -> jax.Array:
        """One layer's share of one prompt chunk -> f32[B, K, T], summed over the chunks into `prefill_scores`.

        q f[B, C, N, H]: the chunk's queries, at prompt positions query_start .. query_start + C - 1 (i32[]; the
        whole prompt is one chunk from 0); keys f[B, T, K, H]: the prompt's keys, those after the chunk not written
        yet (zeros, and causally invisible to it)."""
        raise NotImplementedError(f"{self.name} sets needs_prefill_attention and must define prefill_observe")

    def prefill_scores(self, observed: list[jax.Array | None], ctx: PrefillContext) -> list[jax.Array]:
        """Per layer f32[B, K, T]: higher is kept first. `observed`: per layer the sum of `prefill_observe` over the
        chunks (None without `needs_prefill_attention`). Default: the observed sums, else recency."""
        b, t = ctx.tokens.shape
        recency = jnp.broadcast_to(ctx.positions[:, None].astype(jnp.float32), (b, ctx.kv_heads, t))
        return [recency if o is None else o for o in observed]

    def new_token_score(self, layer: int, position: jax.Array, role: jax.Array, kv_heads: int) -> jax.Array:
        """i32[B], i32[B] -> f32[B, K]: the score a generated token enters with."""
        return jnp.broadcast_to(position[:, None].astype(jnp.float32), (position.shape[0], kv_heads))

    def update_scores(self, layer: int, scores: jax.Array, probs: jax.Array) -> jax.Array:
        """scores f32[B, K, C], probs f32[B, K, G, C] (this step's attention) -> new scores."""
        return scores

    def eviction_priority(
        self,
        layer: int,
        scores: jax.Array,  # f32[B, K, C]
        pos: jax.Array,  # i32[B, K, C] (-1: free)
        role: jax.Array,  # i32[B, K, C]
        position: jax.Array,  # i32[B] the position being written
        prompt_len: jax.Array,  # i32[B]
    ) -> jax.Array:  # f32[B, K, C]: the lowest live entry leaves
        return scores

    def down_priority(
        self,
        layer: int,
        scores: jax.Array,  # f32[B, K, C] (at prefill: the kept prompt entries' prefill scores)
        pos: jax.Array,  # i32[B, K, C] (-1: free)
        role: jax.Array,  # i32[B, K, C]
        position: jax.Array,  # i32[B] the position being written
        prompt_len: jax.Array,  # i32[B]
    ) -> jax.Array:  # f32[B, K, C]: the lowest slot entries go down to the block pool first
        """With a block pool, the order in which slot entries go down a block at a time. Default: the oldest first
        (KIVI's full-precision window of the newest tokens)."""
        return pos.astype(jnp.float32)

    def prefill_high(self, layer: int, scores: jax.Array, valid: jax.Array) -> jax.Array | None:
        """i32[B, K]: of the prompt entries (scores f32[B, K, T], valid bool[B, T]), how many the method wants at full
        precision in the slot pool after prefill (the window permitting), the rest going into whole blocks. Default
        None: as many whole blocks as the bytes allow, the remainder staying in slots (KIVI)."""
        return None

    def block_pool(self, layer: int, role: jax.Array) -> jax.Array:
        """i32 (the shape of `role`): the block pool (its index in `Storage.block_pools`) an entry of each role goes
        down into in `layer`. Default: the first."""
        return jnp.zeros(role.shape, jnp.int32)

    def release_line(self, layer: int) -> float:
        """Slot entries whose eviction priority is below this leave the cache before any entry goes down to the block
        pool (a released bucket); default none."""
        return -math.inf

    def block_entry_priority(self, layer, pos, role, position, prompt_len) -> jax.Array:
        """f32[B, K, N]: the eviction priority of block-pool entries (i32 pos, role [B, K, N]), which keep no score.
        Default: `eviction_priority` with zero scores."""
        return self.eviction_priority(layer, jnp.zeros(pos.shape, jnp.float32), pos, role, position, prompt_len)

    def release_unchosen_tools(
        self,
        layer: int,
        priority: jax.Array,  # f32[B, K, C] from `eviction_priority`
        pos: jax.Array,  # i32[B, K, C] (-1: free)
        tool: jax.Array,  # i32[B, K, C] the tool each entry describes (NO_TOOL: none)
        called: jax.Array,  # i32[B] the tool the call being written calls (NO_TOOL: not known yet)
    ) -> jax.Array:  # f32[B, K, C]
        """The eviction priority once the parser knows which tool is called: unchanged unless a method uses it."""
        return priority


def budget_capacity(prompt_len: int, max_new_tokens: int, fraction: float) -> int:
    """Slots per (layer, sequence, KV head) that a layer keeping `fraction` of the full length needs at the end."""
    if not 0.0 < fraction <= 1.0:
        raise ValueError(f"budget={fraction} must be in (0, 1]")
    return allowance_capacity(fraction * (prompt_len + max_new_tokens), prompt_len + max_new_tokens)


def allowance_capacity(allowance: float, full: int) -> int:
    """Slots for a layer allowed `allowance` entries at its final full length `full`, plus the token being written."""
    return min(math.ceil(round(float(allowance), 6)), full) + SLACK


def recency_priority(pos: jax.Array, sinks: int = 0) -> jax.Array:
    """Older entries leave first; the first `sinks` positions (attention sinks) never leave while others remain."""
    return jnp.where(pos < sinks, PROTECTED, pos.astype(jnp.float32))
