"""KIVI (Liu et al., 2024, "KIVI: A Tuning-Free Asymmetric 2bit Quantization for KV Cache", arXiv 2402.02750).

Every entry stays; what shrinks is its precision. Keys are quantized per channel over groups of `group` tokens (a
channel's outliers get their own scale), values per token over groups of `group` channels, both at `bits` bits with
an f16 scale and zero per group; the newest tokens -- at least `residual` of them, at most `residual + group` -- stay
at full precision, and the oldest `group` of them go down a group at a time (the cache's block pool,
`pask_jax.block_pool`). The prompt goes down at prefill in whole groups, its last `P mod group` tokens staying.

The budget is the one knob: `bits=0` (the default) takes 4 bits where a 4-bit entry fits the budget, else 2
(`widest_bits`; the full-precision window is not counted in the choice). Where even that does not fit -- a low budget,
or the window's bytes -- the window shrinks first (the cap takes the oldest full-precision entries down early), then
the oldest entries leave, a whole group at a time, the first `sinks` positions last (as StreamingLLM's sinks).
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp

from pask_jax.kernels.quantize import KVFormat
from pask_jax.methods.base import KVMethod, PrefillContext, recency_priority
from pask_jax.storage import Storage, full_entry_bytes

BITS = (4, 2)  # widest first


def kivi_formats(bits: int, group: int, head_dim: int) -> tuple[KVFormat, KVFormat]:
    """(key, value) formats at `bits`: keys per channel over `group` tokens, values per token over `group` channels
    (at most head_dim)."""
    return KVFormat(bits, "int", "channel", group), KVFormat(bits, "int", "token", min(group, head_dim))


@dataclasses.dataclass(frozen=True)
class KIVI(KVMethod):
    name: ClassVar[str] = "kivi"
    bits: int = 0  # 2 or 4; 0: the widest the budget pays for
    group: int = 32  # tokens per key group (channels per value group, at most head_dim)
    residual: int = 128  # newest tokens kept at full precision (KIVI's residual length R)
    sinks: int = 4  # positions that leave last when the cap bites

    def __post_init__(self) -> None:
        if self.bits not in (0, *BITS):
            raise ValueError(f"kivi bits must be 2 or 4 (0: chosen by the budget), got {self.bits}")
        if self.group < 1 or self.residual < 0:
            raise ValueError(f"kivi needs group >= 1 and residual >= 0, got {self.group}, {self.residual}")

    def formats(self, bits: int, head_dim: int) -> tuple[KVFormat, KVFormat]:
        return kivi_formats(bits, self.group, head_dim)

    def widest_bits(self, budget: float, head_dim: int) -> int:
        """The most bits whose entries, metadata included, fit `budget` of the bf16 reference (2 if none does)."""
        for bits in BITS:
            entry = Storage(blocks=self.formats(bits, head_dim)).block_entry_bytes(head_dim)
            if entry <= budget * full_entry_bytes(head_dim):
                return bits
        return BITS[-1]

    def storage(self, budget: float, head_dim: int) -> Storage:
        bits = self.bits or self.widest_bits(budget, head_dim)
        return Storage(blocks=self.formats(bits, head_dim), window=self.residual)

    def prefill_scores(self, observed: list, ctx: PrefillContext) -> list[jax.Array]:
        priority = recency_priority(ctx.positions, self.sinks)  # f32[B, T]: what a tight cap keeps first
        b, t = priority.shape
        return [jnp.broadcast_to(priority[:, None], (b, ctx.kv_heads, t))] * len(observed)

    def eviction_priority(self, layer, scores, pos, role, position, prompt_len) -> jax.Array:
        return recency_priority(pos, self.sinks)
