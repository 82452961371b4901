"""Compile calibration statistics into a persistence policy, one table per target budget.

1. Floors from task-error sensitivity: `floor[r, g]` is the smallest calibrated keep level whose task-error increase
   stays within `tolerance` (1.0 if none does). Each bucket's floor is measured with every other bucket present, so
   floors add up: if a group's floors cost more than `floor_share` of its share of the budget, the floors of the
   least sensitive buckets per entry-layer are lowered first (a large bucket that barely matters, like tool
   descriptions, gives way before a small one that breaks calls, like tool names).
2. The remaining capacity is shared by attention-output distortion per removed entry: a fractional knapsack over
   buckets (value = distortion per entry, weight = entries x layers), solved greedily in order of value density,
   with each layer group's share bounded to [budget / 2, 2 x budget] of its entries (first every group reaches its
   lower bound, then all compete) so that no group is starved when one group's buckets all score higher.
   Greedy is exact for the linear relaxation, needs no tuning and is deterministic, which is why we use it rather
   than an optax-solved continuous relaxation: the two agree on a linear objective, and greedy is cheaper.
3. The online method sees the result as a per-group kept fraction and a priority order inside each group (higher
   distortion per entry is kept longer); buckets keeping >= half their entries RETAIN, the others RELEASE.

Ablations (`compile_policy(..., ablation=...)`, `pask-jax calibrate --ablation`): `no_floors`; `no_distortion`
(floors + uniform shares); `one_role` (structure off: statistics pooled over roles, so every role of a group gets
the same floor and priority); `one_group` (statistics pooled over layer groups: one policy for all layers). Pooling
is an entries-weighted mean; the cache keeps its layer groups, only the policy loses the distinction.
"""

from __future__ import annotations

import copy

import numpy as np

from pask_jax.layers import layer_groups
from pask_jax.policy import ModelFingerprint, PersistencePolicy, PolicyTable

GROUP_SHARE = 2.0  # a layer group keeps between budget / GROUP_SHARE and GROUP_SHARE x budget of its entries
ABLATIONS = ("none", "no_floors", "no_distortion", "one_role", "one_group")


def pooled_stats(stats, axis: int):
    """Statistics with task error and distortion per entry replaced by their entries-weighted mean over `axis`
    (0: roles, 1: groups), broadcast back; entries stay per bucket (they are the knapsack weights)."""
    weight = np.asarray(stats.entries, np.float64)

    def pool(x: np.ndarray) -> np.ndarray:
        w = weight.reshape(weight.shape + (1,) * (x.ndim - 2))
        mean = (x * w).sum(axis, keepdims=True) / np.maximum(w.sum(axis, keepdims=True), 1e-9)
        return np.broadcast_to(mean, x.shape).copy()

    pooled = copy.copy(stats)
    pooled.task_error = pool(np.asarray(stats.task_error, np.float64))
    pooled.distortion_per_entry = pool(np.asarray(stats.distortion_per_entry, np.float64))
    return pooled


def _fill_by_value(
    kept: np.ndarray,  # f64[R, G] entry-layers kept so far
    weight: np.ndarray,  # f64[R, G] entry-layers of each bucket
    value: np.ndarray,  # f64[R, G] value per entry
    group_cap: np.ndarray,  # f64[G] most entry-layers a group may keep
    amount: float,  # entry-layers to add
) -> np.ndarray:
    """`kept` plus up to `amount`, highest value first. Buckets of equal value form one class and share what is left
    in proportion to their room (so ties favour no group); no group goes above its cap."""
    kept = kept.copy()
    for v in np.unique(value)[::-1]:
        if amount <= 1e-9:
            break
        room = np.where(value == v, weight - kept, 0.0)
        group_room = np.maximum(group_cap - kept.sum(0), 0.0)
        room = np.minimum(room, group_room[None, :] * room / np.maximum(room.sum(0, keepdims=True), 1e-9))
        take = min(1.0, amount / max(room.sum(), 1e-9))
        kept += take * room
        amount -= take * room.sum()
    return kept


def compile_table(
    stats,
    budget: float,
    *,
    tolerance: float = 0.02,
    use_floors: bool = True,
    use_distortion: bool = True,
    floor_share: float = 1.0,
    group_layers: np.ndarray | None = None,  # i[G] layers per group (default: equal)
) -> PolicyTable:
    """One budget's table from `CalibrationStats` (task_error[R, G, Λ], distortion_per_entry[R, G], entries[R, G])."""
    if not 0.0 < budget <= 1.0:
        raise ValueError(f"budget={budget} must be in (0, 1]")
    if not 0.0 <= floor_share <= 1.0:
        raise ValueError(f"floor_share={floor_share} must be in [0, 1]")
    entries = np.asarray(stats.entries, np.float64)  # mean entries per item, per bucket
    roles, groups = entries.shape
    layers = np.ones(groups) if group_layers is None else np.asarray(group_layers, np.float64)
    weight = entries * layers[None, :]  # entry-layers of each bucket
    total_per_group = entries.sum(0) * layers  # entry-layers of each group at full KV
    capacity = budget * total_per_group.sum()

    # 1. Floors: smallest keep level within tolerance of the baseline task error.
    levels = np.asarray(stats.levels, np.float64)
    floor = np.zeros((roles, groups))
    if use_floors:
        within = np.asarray(stats.task_error) <= tolerance  # [R, G, Λ]
        first_ok = np.where(within.any(-1), levels[np.argmax(within, -1)], 1.0)
        floor = np.where(entries > 0, first_ok, 0.0)
        # Error increase when the bucket is removed, per entry-layer it would cost to keep.
        sensitivity = np.asarray(stats.task_error)[..., 0] / np.maximum(weight, 1e-9)
        for g in range(groups):
            share = floor_share * budget * total_per_group[g]
            for r in np.argsort(sensitivity[:, g], kind="stable"):  # least sensitive floors give way first
                excess = (floor[:, g] * weight[:, g]).sum() - share
                if excess <= 0:
                    break
                floor[r, g] = max(0.0, floor[r, g] - excess / max(weight[r, g], 1e-9))

    # 2. Residual capacity by distortion per entry (fractional knapsack, greedy by value density). Every group first
    #    reaches budget / GROUP_SHARE (its own best buckets first), then all compete, no group above GROUP_SHARE x
    #    budget: without the bounds a group whose buckets all score higher takes everything and starves the rest.
    kept = floor * weight
    value = np.asarray(stats.distortion_per_entry, np.float64) if use_distortion else np.ones((roles, groups))
    low, high = budget / GROUP_SHARE * total_per_group, min(1.0, GROUP_SHARE * budget) * total_per_group
    # With the lower bounds as caps and their total deficit as the amount, every group fills exactly its own deficit.
    kept = _fill_by_value(kept, weight, value, low, np.maximum(low - kept.sum(0), 0.0).sum())
    kept = _fill_by_value(kept, weight, value, high, capacity - kept.sum())
    fractions = kept.sum(0) / np.maximum(total_per_group, 1e-9)
    fractions *= min(1.0, budget * layers.sum() / (fractions * layers).sum())  # float rounding never lifts the cap
    kept_fraction = np.where(weight > 0, kept / np.maximum(weight, 1e-9), 0.0)
    # Priority: the rank of the bucket's value (dense: equal values share a priority), scaled into [0, 1).
    distinct = np.unique(value)
    priority = np.searchsorted(distinct, value) / len(distinct) if use_distortion else np.zeros((roles, groups))
    return PolicyTable(
        budget=float(budget),
        floor=floor.astype(np.float32),
        priority=priority.astype(np.float32),
        retain=kept_fraction >= 0.5,
        group_fractions=fractions.astype(np.float32),
    )


def compile_policy(
    stats,
    budgets: list[float],
    *,
    release_window: int = 8,
    notes: str = "",
    ablation: str = "none",
    fits: ModelFingerprint | None = None,
    **options,
) -> PersistencePolicy:
    """A policy over several budgets, carrying the calibration's model, layer count, groups and item ids, and the
    fingerprint of the model it fits (`fits`: without one, the policy cannot be used with a model)."""
    if ablation not in ABLATIONS:
        raise ValueError(f"unknown ablation {ablation!r}; choose one of {', '.join(ABLATIONS)}")
    options |= {"no_floors": {"use_floors": False}, "no_distortion": {"use_distortion": False}}.get(ablation, {})
    if ablation in ("one_role", "one_group"):
        stats = pooled_stats(stats, axis=0 if ablation == "one_role" else 1)
    group_layers = np.asarray([b - a for a, b in layer_groups(stats.num_layers, stats.groups)])
    return PersistencePolicy(
        model=stats.model,
        num_layers=stats.num_layers,
        groups=stats.groups,
        tables=tuple(compile_table(stats, b, group_layers=group_layers, **options) for b in budgets),
        release_window=release_window,
        taxonomy=stats.taxonomy,
        calibration_items=tuple(stats.item_ids),
        notes=notes,
        fits=fits,
    )
