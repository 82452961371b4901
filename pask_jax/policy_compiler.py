"""Calibration statistics and the compiler that turns them into one persistence-policy table per budget (pure numpy).

It sits below `pask_jax.policy` (which compiles a table on load for a budget it was not compiled for) and needs no
JAX, model or calibration pass; `pask_jax.calibration` measures the statistics (`CalibrationStats`) and
`pask_jax.calibration.compiler.compile_policy` wraps the tables into a policy.

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

Ablations (`CompileOptions.ablation`, `pask-jax calibrate --ablation`): `no_floors`; `no_distortion` (floors +
uniform shares); `one_role` (structure off: statistics pooled over roles, so every role of a group gets the same floor
and priority); `one_group` (statistics pooled over layer groups: one policy for all layers). Pooling is an
entries-weighted mean; the cache keeps its layer groups, only the policy loses the distinction.
"""

from __future__ import annotations

import copy
import dataclasses
import json
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from pask_jax.layers import layer_groups

GROUP_SHARE = 2.0  # a layer group keeps between budget / GROUP_SHARE and GROUP_SHARE x budget of its entries
ABLATIONS = ("none", "no_floors", "no_distortion", "one_role", "one_group")
STATS_ARRAYS = (  # the array fields of CalibrationStats (and the calibration loop's running sums)
    "task_error",
    "task_error_strict",
    "nll_delta",
    "distortion",
    "distortion_per_entry",
    "entries",
    "present",
)


class PolicyError(ValueError):
    """A policy that does not fit the model, taxonomy or budget asked for."""


@dataclasses.dataclass
class CalibrationStats:
    """Means over calibration items. Bucket arrays are [R, G] / [R, G, Λ]; a bucket absent from every item is 0
    (see `present`). Changes are variant minus baseline of the same item, averaged over items where the bucket is
    present; distortion is at keep level 0 (bucket removed), per entry = divided by the entries it hid."""

    task_error: np.ndarray  # f64[R, G, Λ] increase in P(call wrong): greedy constrained decoding leaves the gold text
    task_error_strict: np.ndarray  # f64[R, G, Λ] the same, token-exact and with the end-of-turn token
    nll_delta: np.ndarray  # f64[R, G, Λ] increase in mean NLL of the gold tokens
    distortion: np.ndarray  # f64[R, G] ||o - o_base|| / ||o_base|| over the group's layers and the fed queries
    distortion_per_entry: np.ndarray  # f64[R, G]
    entries: np.ndarray  # f64[R, G] mean entries (tokens) of role r per item (prompt + fed gold tokens)
    present: np.ndarray  # i64[R, G] items where the role had entries
    baseline_error: float
    baseline_error_strict: float
    baseline_nll: float
    n_items: int
    model: str
    num_layers: int
    groups: int
    levels: tuple[float, ...]
    taxonomy: str
    item_ids: list[str]
    skipped: dict[str, str]  # item id -> why it was not calibrated
    wall_s: float
    target: str = "canonical"  # "own" (the model's own full-KV call) or "canonical"; older statistics are canonical

    def to_json(self) -> str:
        return json.dumps({k: v.tolist() if isinstance(v, np.ndarray) else v for k, v in vars(self).items()})

    @classmethod
    def from_json(cls, text: str) -> CalibrationStats:
        d = json.loads(text)
        arrays = {k: np.asarray(d[k], np.int64 if k == "present" else np.float64) for k in STATS_ARRAYS}
        return cls(**(d | arrays | {"levels": tuple(d["levels"])}))

    def save(self, path: str | Path) -> None:
        Path(path).write_text(self.to_json())

    @classmethod
    def load(cls, path: str | Path) -> CalibrationStats:
        return cls.from_json(Path(path).read_text())


@dataclasses.dataclass(frozen=True, eq=False)  # holds arrays: compared by identity
class PolicyTable:
    """One budget's persistence table over (role, layer group) buckets (see `pask_jax.policy`)."""

    budget: float
    floor: np.ndarray  # f32[R, G]
    priority: np.ndarray  # f32[R, G] in [0, 1)
    retain: np.ndarray  # bool[R, G]
    group_fractions: np.ndarray  # f32[G]

    def validate(self, roles: int, groups: int) -> None:
        for name, shape in (("floor", (roles, groups)), ("priority", (roles, groups)), ("retain", (roles, groups))):
            if getattr(self, name).shape != shape:
                raise PolicyError(f"policy {name} has shape {getattr(self, name).shape}, expected {shape}")
        if self.group_fractions.shape != (groups,):
            raise PolicyError(f"group_fractions has shape {self.group_fractions.shape}, expected ({groups},)")
        if not ((self.floor >= 0) & (self.floor <= 1)).all() or not ((self.priority >= 0) & (self.priority < 1)).all():
            raise PolicyError("floors must lie in [0, 1] and priorities in [0, 1)")
        if not ((self.group_fractions > 0) & (self.group_fractions <= 1)).all():
            raise PolicyError(f"group fractions must lie in (0, 1]: {self.group_fractions}")


@dataclasses.dataclass(frozen=True)
class CompileOptions:
    """How statistics become tables; a policy records them, so a budget compiled on load matches the others."""

    tolerance: float = 0.02  # task-error increase a floor may allow
    floor_share: float = 1.0  # fraction of a layer group's share of the budget its floors may take
    ablation: str = "none"

    def __post_init__(self) -> None:
        if self.ablation not in ABLATIONS:
            raise ValueError(f"unknown ablation {self.ablation!r}; choose one of {', '.join(ABLATIONS)}")
        if not 0.0 <= self.floor_share <= 1.0:
            raise ValueError(f"floor_share={self.floor_share} must be in [0, 1]")


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


def compile_tables(
    stats, budgets: Sequence[float], options: CompileOptions = CompileOptions()
) -> tuple[PolicyTable, ...]:
    """One table per budget from `stats` under `options` (the ablation pools the statistics or switches a stage
    off); layer groups are weighted by their layer counts."""
    if options.ablation in ("one_role", "one_group"):
        stats = pooled_stats(stats, axis=0 if options.ablation == "one_role" else 1)
    off = {"no_floors": {"use_floors": False}, "no_distortion": {"use_distortion": False}}.get(options.ablation, {})
    group_layers = np.asarray([b - a for a, b in layer_groups(stats.num_layers, stats.groups)])
    return tuple(
        compile_table(
            stats,
            budget,
            tolerance=options.tolerance,
            floor_share=options.floor_share,
            group_layers=group_layers,
            **off,
        )
        for budget in budgets
    )
