"""PyramidKV (Cai et al., 2024, "PyramidKV: Dynamic KV Cache Compression based on Pyramidal Information Funneling",
arXiv 2406.02069).

SnapKV's scores and decode rule (this class subclasses `SnapKV`), with per-layer budgets shaped as a pyramid: lower
layers, whose attention is spread widely, keep more; upper layers keep less. With m layers and a total budget
k_total = b * m (in units of the full length), the paper's allocation is

    k_{m-1} = k_total / (beta * m),   k_0 = 2 * k_total / m - k_{m-1},   linear in between,

so layer l keeps the fraction f_l = f_0 + (f_{m-1} - f_0) * l / (m - 1) with f_{m-1} = b / beta and
f_0 = 2b - b / beta: the mean over layers is exactly b. When the pyramid is infeasible (f_0 > 1, i.e.
b > beta / (2 beta - 1)), every layer keeps b: plain SnapKV.

Where the observation window goes (`allotment`):
- "factory" (default), as the authors' KVCache-Factory code allots it: every layer keeps the window, and the pyramid
  shares what the budget leaves after it. At full length n with window w' = min(window, b * n), layer l may hold
  w' + (f_l / b) * (b * n - w') entries; the mean over layers is still b * n, and the top layers keep their window
  instead of a few entries.
- "pyramid": the window counts inside each layer's pyramid share f_l * n (the top layer keeps about b * n / beta).
Remaining differences from KVCache-Factory: it steps by (k_0 - k_{m-1}) // m (its top layer ends slightly above
k_{m-1}) and, when layer 0 would exceed the prompt, clips it instead of going uniform; here the interpolation ends at
k_{m-1} exactly, so the mean is the budget.

Hyper-parameters: `beta` = 20 (the paper's setting); `window` = 32, `kernel` = 7, `pooling` as SnapKV; `allotment`.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np

from pask_jax.methods.snapkv import SnapKV

ALLOTMENTS = ("factory", "pyramid")


def pyramid_fractions(num_layers: int, budget: float, beta: float) -> np.ndarray:
    """Per-layer keep fractions, layer 0 first; uniform `budget` when the pyramid would need a fraction above 1."""
    if num_layers == 1:
        return np.full(1, budget)
    top = budget / beta  # the last layer
    bottom = 2.0 * budget - top  # layer 0
    if bottom > 1.0:
        return np.full(num_layers, budget)
    return np.linspace(bottom, top, num_layers)


@dataclasses.dataclass(frozen=True)
class PyramidKV(SnapKV):
    name: ClassVar[str] = "pyramidkv"
    beta: float = 20.0  # ratio of the mean layer budget to the top layer's
    allotment: str = "factory"  # the window on top of each layer's pyramid share, or inside it ("pyramid")

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.beta < 1:
            raise ValueError(f"PyramidKV beta={self.beta} must be >= 1")
        if self.allotment not in ALLOTMENTS:
            raise ValueError(f"PyramidKV allotment={self.allotment!r}; choose from {', '.join(ALLOTMENTS)}")

    def layer_fractions(self, num_layers: int, budget: float) -> np.ndarray:
        return pyramid_fractions(num_layers, budget, self.beta)

    def keep_allowance(self, fraction: float, budget: float, full: jax.Array) -> jax.Array:
        if self.allotment == "pyramid":
            return fraction * full
        window = jnp.minimum(self.window, budget * full)  # the budget may not even hold the window
        return window + (fraction / budget) * (budget * full - window)
