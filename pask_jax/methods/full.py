"""Full KV: keep every prompt entry and every generated token (the uncompressed reference)."""

from __future__ import annotations

import jax

from pask_jax.methods.base import KVMethod, keep_all_valid


class FullKV(KVMethod):
    name = "full"

    def capacity(self, prompt_len: int, max_new_tokens: int, budget: float) -> int:
        return prompt_len + max_new_tokens

    def prefill_keep(
        self, layer: int, q: jax.Array, k: jax.Array, valid: jax.Array, capacity: int
    ) -> tuple[jax.Array, jax.Array]:
        return keep_all_valid(k, valid)
