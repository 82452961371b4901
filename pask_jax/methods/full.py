"""Full KV: keep every prompt entry and every generated token (the uncompressed reference)."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import numpy as np

from pask_jax.methods.base import KVMethod


@dataclasses.dataclass(frozen=True)
class FullKV(KVMethod):
    name: ClassVar[str] = "full"

    def layer_fractions(self, num_layers: int, budget: float) -> np.ndarray:
        return np.ones(num_layers)  # full KV ignores the budget
