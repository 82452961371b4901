"""DapQ (arXiv 2603.11564, "Where Matters More Than What: Decoding-aligned KV Cache Compression via Position-aware
Pseudo Queries").

Prefill: after the prompt, `num_pseudo` pseudo tokens per sequence are run through the model causally at the
positions the first generated tokens will occupy, P_b + `position_offset` .. P_b + `position_offset` + N - 1
(`ctx.extra_query_scores`). Each prompt key is scored by the softmax attention the pseudo queries give it, summed over
the N queries and the GQA group, per layer and KV head; the top entries are kept. The pseudo tokens' own KV never
reaches the cache, and decoding starts at position P_b.

Hyper-parameters (the paper's defaults, its appendix settings; its ablations: shifting the
positions hurts, the content matters little):
- `num_pseudo` N = 32 pseudo tokens.
- `content`: what the pseudo tokens are. "first_last" (default): the prompt's first `first` = 4 and last N - 4 = 28
  tokens; "last": its last N tokens; "random": N prompt tokens drawn uniformly with `seed` (same draw for every
  sequence, so a batch scores each sequence as it would alone). Short prompts repeat tokens (indices are clipped).
- `position_offset` = 0: extra shift of the pseudo positions (ablation only).
- `pooling` = "none": the raw scores, as the paper describes; "max" / "avg" pool them along the keys with `kernel`
  = 7 as SnapKV does (the pooling a SnapKV-derived implementation may add; tuned on dev like every option).

Decode rule: SnapKV's (`prompt_first_priority`): generated tokens enter, the lowest-scored prompt entry leaves, and
once no prompt entry is left the oldest generated entry.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp

from pask_jax.methods.base import KVMethod, PrefillContext
from pask_jax.methods.snapkv import POOLINGS, pool_keys, prompt_first_priority

CONTENTS = ("first_last", "last", "random")


@dataclasses.dataclass(frozen=True)
class DapQ(KVMethod):
    name: ClassVar[str] = "dapq"
    num_pseudo: int = 32  # N pseudo queries
    content: str = "first_last"  # "first_last" | "last" | "random"
    first: int = 4  # "first_last": how many of the N come from the prompt's start
    position_offset: int = 0  # pseudo positions start at P_b + offset
    seed: int = 0  # "random" content
    pooling: str = "none"  # or "max" / "avg" along the keys
    kernel: int = 7

    def __post_init__(self) -> None:
        if self.content not in CONTENTS:
            raise ValueError(f"DapQ content={self.content!r} must be one of {CONTENTS}")
        if self.num_pseudo < 1 or not 0 <= self.first <= self.num_pseudo:
            raise ValueError(f"DapQ needs num_pseudo >= 1 and 0 <= first <= num_pseudo, got {self}")
        if self.pooling not in ("none", *POOLINGS):
            raise ValueError(f"DapQ pooling={self.pooling!r} must be 'none' or one of {POOLINGS}")

    def pseudo_queries(self, tokens: jax.Array, lengths: jax.Array) -> tuple[jax.Array, jax.Array]:
        """tokens i32[B, T] right-padded prompts, lengths i32[B] -> pseudo tokens and positions, i32[B, N] each."""
        n = self.num_pseudo
        i = jnp.arange(n)
        p = lengths[:, None]
        if self.content == "first_last":
            index = jnp.where(i < self.first, i, p - (n - i))
        elif self.content == "last":
            index = p - (n - i)
        else:
            u = jax.vmap(lambda j: jax.random.uniform(jax.random.fold_in(jax.random.key(self.seed), j)))(i)
            index = jnp.floor(u * p).astype(jnp.int32)
        index = jnp.clip(index, 0, p - 1)
        return jnp.take_along_axis(tokens, index, axis=1), p + self.position_offset + i

    def prefill_scores(self, observed: list, ctx: PrefillContext) -> list[jax.Array]:
        scores = ctx.extra_query_scores(*self.pseudo_queries(ctx.tokens, ctx.lengths))
        if self.pooling == "none":
            return list(scores)
        prompt = (jnp.arange(ctx.tokens.shape[1]) < ctx.lengths[:, None])[:, None]  # bool[B, 1, T]
        return [jnp.where(prompt, pool_keys(s, prompt, self.kernel, self.pooling), 0.0) for s in scores]

    def eviction_priority(self, layer, scores, pos, role, position, prompt_len) -> jax.Array:
        return prompt_first_priority(scores, pos, prompt_len)
