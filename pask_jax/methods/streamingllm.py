"""StreamingLLM (Xiao et al., 2023, "Efficient Streaming Language Models with Attention Sinks").

Keeps the first `sinks` tokens (attention sinks; the paper uses 4) and the most recent window that the budget
allows; during decode the oldest non-sink entry leaves. Same positions in every layer and head.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp

from pask_jax.methods.base import KVMethod, PrefillContext, recency_priority


@dataclasses.dataclass(frozen=True)
class StreamingLLM(KVMethod):
    name: ClassVar[str] = "streamingllm"
    sinks: int = 4  # attention sinks (the paper's choice)

    def prefill_scores(self, observed: list, ctx: PrefillContext) -> list[jax.Array]:
        priority = recency_priority(ctx.positions, self.sinks)  # f32[B, T]
        return [jnp.broadcast_to(priority[:, None], (priority.shape[0], ctx.kv_heads, priority.shape[1]))] * len(
            observed
        )

    def eviction_priority(self, layer, scores, pos, role, position, prompt_len) -> jax.Array:
        return recency_priority(pos, self.sinks)
