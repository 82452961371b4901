"""Layer groups: consecutive layer ranges that share one slot pool and one column of a persistence policy.

Pure numpy, so the policy compiler and the policy loader need no JAX or Pallas import.
"""

from __future__ import annotations

import numpy as np


def layer_groups(num_layers: int, num_groups: int) -> tuple[tuple[int, int], ...]:
    """Consecutive layer ranges [start, stop), as equal as possible (earlier groups get the extra layer)."""
    if not 1 <= num_groups <= num_layers:
        raise ValueError(f"num_groups={num_groups} must be between 1 and num_layers={num_layers}")
    bounds = np.cumsum([0] + [len(a) for a in np.array_split(np.arange(num_layers), num_groups)])
    return tuple((int(a), int(b)) for a, b in zip(bounds[:-1], bounds[1:], strict=True))
