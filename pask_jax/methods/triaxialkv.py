"""TriAxialKV (Shen et al., 2026, "TriAxialKV: Toward Extreme Low-Precision KV-Cache Quantization for Agentic
Inference Tasks", arXiv 2605.17170): KIVI at a bit width chosen per token tag.

Every token carries a tag. The paper's tag is temporal recency x modality x semantic role; we have text only, and our
role ids already tell the prompt (the tools JSON, the messages) from the turn being generated (the call's roles), so
a tag here is the role id: recency x role. Each tag is stored at INT4 or INT2 in KIVI's format (keys per channel over
blocks of `group` tokens, values per token over groups of channels), each bit width in its own block pool of the
cache (`Storage.second_blocks`). As in KIVI the newest tokens stay at full precision (`residual` to `residual +
group` of them), and the window's oldest entries go down a block at a time into the pool of their tag (a block holds
one pool's entries); at prefill each pool takes whole blocks of its oldest prompt entries, the leftovers staying in
the window. Nothing is evicted while the byte cap holds everything; where it cannot (a budget below what the table was
compiled for, or the window's bytes), the window goes down early, then the oldest entries leave, a whole block at a
time, the first `sinks` positions last -- KIVI's rule.

`int4` names the tags stored at INT4; every other tag is stored at INT2 (no table: KIVI-2). The table is compiled
offline from calibrated attention-output distortion under the budget (`pask_jax.triaxial_table`) and given as the
method's hyper-parameter, in a method config section (`[triaxialkv]` or `["triaxialkv:LABEL"]`).
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp

from pask_jax.methods.base import KVMethod, PrefillContext
from pask_jax.methods.kivi import KIVI, kivi_formats
from pask_jax.storage import Storage
from pask_jax.structure.roles import role_names

INT4, INT2 = 4, 2


@dataclasses.dataclass(frozen=True)
class TriAxialKV(KVMethod):
    name: ClassVar[str] = "triaxialkv"
    needs_roles: ClassVar[bool] = True
    int4: tuple[str, ...] = ()  # tags (role names) stored at INT4; the others at INT2
    group: int = 32  # tokens per key group (channels per value group, at most head_dim)
    residual: int = 128  # newest tokens kept at full precision (KIVI's residual length R)
    sinks: int = 4  # positions that leave last when the cap bites

    def __post_init__(self) -> None:
        object.__setattr__(self, "int4", tuple(self.int4))  # a method config gives a list
        unknown = sorted(set(self.int4) - set(role_names()))
        if unknown:
            raise ValueError(f"triaxialkv int4: unknown tag(s) {unknown}; the tags are the roles {role_names()}")
        if self.group < 1 or self.residual < self.group:
            raise ValueError(
                f"triaxialkv needs group >= 1 and a residual window of at least a group, got {self.group}, "
                f"{self.residual}"
            )

    @property
    def bits(self) -> tuple[int, ...]:
        """[R]: each tag's bit width, by role id."""
        return tuple(INT4 if name in self.int4 else INT2 for name in role_names())

    @property
    def pool_bits(self) -> tuple[int, ...]:
        """The bit width of each block pool of the cache: INT4 then INT2, each only if some tag takes it."""
        return tuple(bits for bits in (INT4, INT2) if bits in self.bits)

    def storage(self, budget: float, head_dim: int) -> Storage:
        blocks, *second = (kivi_formats(bits, self.group, head_dim) for bits in self.pool_bits)
        return Storage(blocks=blocks, second_blocks=second[0] if second else None, window=self.residual)

    def block_pool(self, layer: int, role: jax.Array) -> jax.Array:  # the same in every layer
        pool_of_role = jnp.asarray([self.pool_bits.index(bits) for bits in self.bits], jnp.int32)  # i32[R]
        return pool_of_role[role]

    def prefill_scores(self, observed: list, ctx: PrefillContext) -> list[jax.Array]:
        return KIVI(sinks=self.sinks).prefill_scores(observed, ctx)  # recency: the oldest leave first

    def eviction_priority(self, layer, scores, pos, role, position, prompt_len) -> jax.Array:
        return KIVI(sinks=self.sinks).eviction_priority(layer, scores, pos, role, position, prompt_len)
