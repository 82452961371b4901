"""Compile calibration statistics into a persistence policy, one table per target budget.

The compiler itself (floors from task error, residual capacity by distortion, ablations) is
`pask_jax.policy_compiler`, below `pask_jax.policy`, so that a loaded policy compiles a budget it was not compiled
for from the statistics it carries. This module wraps its tables into a `PersistencePolicy`.
"""

from __future__ import annotations

from collections.abc import Sequence

from pask_jax.policy import ModelFingerprint, PersistencePolicy
from pask_jax.policy_compiler import ABLATIONS, ACTION_VALUES, CompileOptions, compile_tables

__all__ = ["ABLATIONS", "ACTION_VALUES", "compile_policy"]  # the choices of `pask-jax calibrate --ablation`, `--value`


def compile_policy(
    stats,
    budgets: Sequence[float],
    *,
    release_window: int = 8,
    notes: str = "",
    ablation: str = "none",
    fits: ModelFingerprint | None = None,
    tolerance: float = 0.02,
    floor_share: float = 1.0,
    entry_bytes: tuple[float, float, float] | None = None,  # (full bf16, LOW, HIGH): precision actions (CompileOptions)
    value: str = "distortion",  # precision actions: the knapsack's value (CompileOptions.value)
    window_bytes: float = 0.0,  # precision actions: bytes per layer held beside the plan (CompileOptions)
) -> PersistencePolicy:
    """A policy over several budgets, carrying the calibration's model, layer count, groups and item ids, the
    statistics and compile options (so it answers any other budget too), and the fingerprint of the model it fits
    (`fits`: without one, the policy cannot be used with a model). Statistics of a model with another layer count
    are refused: their layer groups are not that model's."""
    if fits is not None and fits.num_layers != stats.num_layers:
        raise ValueError(
            f"the statistics were calibrated on {stats.model} ({stats.num_layers} layers); the model has "
            f"{fits.num_layers}: calibrate this model (`pask-jax calibrate --model ...`)"
        )
    options = CompileOptions(
        tolerance=tolerance,
        floor_share=floor_share,
        ablation=ablation,
        entry_bytes=entry_bytes,
        value=value,
        window_bytes=window_bytes,
    )
    return PersistencePolicy(
        model=stats.model,
        num_layers=stats.num_layers,
        groups=stats.groups,
        tables=compile_tables(stats, budgets, options),
        release_window=release_window,
        taxonomy=stats.taxonomy,
        calibration_items=tuple(stats.item_ids),
        notes=notes,
        fits=fits,
        stats=stats,
        compile_options=options,
    )
