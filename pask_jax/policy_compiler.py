"""Calibration statistics and the compiler that turns them into one persistence-policy table per budget (pure numpy).

It sits below `pask_jax.policy` (which compiles a table on load for a budget it was not compiled for) and needs no
JAX, model or calibration pass; `pask_jax.calibration` measures the statistics (`CalibrationStats`) and
`pask_jax.calibration.compiler.compile_policy` wraps the tables into a policy.

Presence compile (`compile_table`, the default: `CompileOptions.entry_bytes` is None):

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

Precision compile (`compile_action_table`: `entry_bytes` given and statistics with the LOW-precision measurements).
The cache holds an entry at HIGH precision (a bf16 slot, or a 4-bit block entry where the statistics carry HIGH
measurements too) or LOW precision (a 2-bit block entry, a fraction of the bytes), and the budget counts bytes
against a full bf16 cache. Each bucket gets one of three actions: RELEASE (evicted first), RETAIN_LOW (kept at LOW
precision) or RETAIN_HIGH (kept at HIGH precision).

1. Floor actions: the cheapest action whose task-error increase stays within `tolerance` (RELEASE if removing the
   bucket is harmless, else RETAIN_LOW if storing it at LOW precision is, else RETAIN_HIGH). If a group's floors
   cost more than `floor_share` of its share of the bytes, the floors with the least task error per byte saved step
   down first, one action at a time.
2. The remaining bytes: a multiple-choice knapsack over (bucket, action), value = the attention-output distortion
   an action removes relative to RELEASE (HIGH removes all of it, LOW what LOW precision does not add back; with
   `value="nll"` the gold tokens' NLL increase instead), cost =
   entry-layers x bytes of the action. Solved greedily over each bucket's upper convex hull of (cost, value) (a LOW
   worth less per byte than the step from LOW to HIGH is skipped: RELEASE goes to HIGH directly) in one order of
   incremental value per byte; actions are discrete, so an upgrade that does not fit whole is passed over for
   smaller ones. Layer groups are bounded as above, in bytes.
3. The table carries the actions; `retain` = not RELEASE, `floor` = 1 for retained buckets (the fraction floor of
   the presence compile for released ones), `priority` = the rank of the value per byte, and `group_fractions` the
   plan's bytes per group over the group's reference bytes.

Ablations (`CompileOptions.ablation`, `pask-jax calibrate --ablation`): `no_floors` (no fraction floors; floor actions
RELEASE); `no_distortion` (floors + uniform shares: every value 1 per entry-layer or per byte); `one_role` (structure
off: statistics pooled over roles, so every role of a group gets the same floor and priority); `one_group`
(statistics pooled over layer groups: one policy for all layers). Pooling is an entries-weighted mean; the cache keeps
its layer groups, only the policy loses the distinction.
"""

from __future__ import annotations

import copy
import dataclasses
import json
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from pask_jax.layers import layer_groups

GROUP_SHARE = 2.0  # a layer group keeps between budget / GROUP_SHARE and GROUP_SHARE x budget of its entries (bytes)
ABLATIONS = ("none", "no_floors", "no_distortion", "one_role", "one_group")
# What a precision-action compile's knapsack counts as an action's value: the attention-output distortion it removes
# (the paper's rule) or the increase in the gold tokens' NLL it removes (smoother on few calibration items).
ACTION_VALUES = ("distortion", "nll")
STATS_ARRAYS = (  # the array fields of CalibrationStats (and the calibration loop's running sums)
    "task_error",
    "task_error_strict",
    "nll_delta",
    "distortion",
    "distortion_per_entry",
    "entries",
    "present",
)
LOW_STATS_ARRAYS = (  # the optional LOW-precision array fields (running sums too, when calibrated with a LOW storage)
    "task_error_low",
    "task_error_strict_low",
    "nll_delta_low",
    "distortion_low",
)
HIGH_STATS_ARRAYS = tuple(name.replace("_low", "_high") for name in LOW_STATS_ARRAYS)  # HIGH lossy too: optional
RELEASE, RETAIN_LOW, RETAIN_HIGH = 0, 1, 2  # a bucket's action (`PolicyTable.action`), in order of bytes held
ACTION_NAMES = ("RELEASE", "RETAIN_LOW", "RETAIN_HIGH")


class PolicyError(ValueError):
    """A policy that does not fit the model, taxonomy or budget asked for."""


@dataclasses.dataclass
class CalibrationStats:
    """Means over calibration items. Bucket arrays are [R, G] / [R, G, Λ]; a bucket absent from every item is 0
    (see `present`). Changes are variant minus baseline of the same item, averaged over items where the bucket is
    present; distortion is at keep level 0 (bucket removed), per entry = divided by the entries it hid. The LOW
    statistics (None when calibrated without a LOW precision) are the same changes with the bucket's entries stored
    at LOW precision instead of removed."""

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
    task_error_low: np.ndarray | None = None  # f64[R, G] as task_error[..., level 0.0], the bucket at LOW precision
    task_error_strict_low: np.ndarray | None = None  # f64[R, G] as task_error_strict[..., level 0.0]
    nll_delta_low: np.ndarray | None = None  # f64[R, G] as nll_delta[..., level 0.0]
    distortion_low: np.ndarray | None = None  # f64[R, G] as distortion
    low_storage: str | None = None  # the LOW precision measured (a storage preset such as "kivi2")
    task_error_high: np.ndarray | None = None  # f64[R, G] the LOW fields' twins at a lossy HIGH precision (None:
    task_error_strict_high: np.ndarray | None = None  # HIGH is full precision, which changes nothing)
    nll_delta_high: np.ndarray | None = None
    distortion_high: np.ndarray | None = None
    high_storage: str | None = None  # the HIGH precision measured ("kivi4"; `with_high_precision`)

    def to_json(self) -> str:
        # Absent LOW / HIGH statistics are left out: statistics without them keep the bytes of their file.
        optional = (*LOW_STATS_ARRAYS, "low_storage", *HIGH_STATS_ARRAYS, "high_storage")
        fields = {k: v for k, v in vars(self).items() if v is not None or k not in optional}
        return json.dumps({k: v.tolist() if isinstance(v, np.ndarray) else v for k, v in fields.items()})

    @classmethod
    def from_json(cls, text: str) -> CalibrationStats:
        d = json.loads(text)
        arrays = {k: np.asarray(d[k], np.int64 if k == "present" else np.float64) for k in STATS_ARRAYS}
        low = {k: np.asarray(d[k], np.float64) for k in (*LOW_STATS_ARRAYS, *HIGH_STATS_ARRAYS) if d.get(k) is not None}
        return cls(**(d | arrays | low | {"levels": tuple(d["levels"])}))

    def save(self, path: str | Path) -> None:
        Path(path).write_text(self.to_json())

    @classmethod
    def load(cls, path: str | Path) -> CalibrationStats:
        return cls.from_json(Path(path).read_text())


def with_high_precision(low: CalibrationStats, high: CalibrationStats) -> CalibrationStats:
    """`low`'s statistics with `high`'s LOW measurements as the HIGH ones: two calibrations of the same items, each
    with another LOW precision (`--low-storage kivi2`, then `kivi4`), become one whose RETAIN_HIGH is the second's
    block precision instead of full precision. ValueError for statistics that do not pair."""
    for name, stats in (("LOW", low), ("HIGH", high)):
        if stats.low_storage is None:
            raise ValueError(f"the {name} statistics were calibrated without a LOW precision (--low-storage)")
        if stats.high_storage is not None:
            raise ValueError(f"the {name} statistics already carry a HIGH precision ({stats.high_storage})")
    if low.low_storage == high.low_storage:
        raise ValueError(f"both statistics were measured at {low.low_storage}: give a second precision")
    for field in ("model", "num_layers", "groups", "taxonomy", "levels", "target", "item_ids"):
        same = sorted if field == "item_ids" else lambda x: x  # means over items: their order does not matter
        if same(getattr(low, field)) != same(getattr(high, field)):
            raise ValueError(
                f"the statistics differ in {field} ({getattr(low, field)!r} and {getattr(high, field)!r}): calibrate "
                "the same items at both precisions"
            )
    measured = {name.replace("_low", "_high"): getattr(high, name) for name in LOW_STATS_ARRAYS}
    return dataclasses.replace(low, **measured, high_storage=high.low_storage)


@dataclasses.dataclass(frozen=True, eq=False)  # holds arrays: compared by identity
class PolicyTable:
    """One budget's persistence table over (role, layer group) buckets (see `pask_jax.policy`)."""

    budget: float
    floor: np.ndarray  # f32[R, G]
    priority: np.ndarray  # f32[R, G] in [0, 1)
    retain: np.ndarray  # bool[R, G]
    group_fractions: np.ndarray  # f32[G]
    action: np.ndarray | None = None  # i8[R, G] RELEASE / RETAIN_LOW / RETAIN_HIGH (None: a presence-only table)

    def validate(self, roles: int, groups: int) -> None:
        bucket_arrays = ("floor", "priority", "retain") + (() if self.action is None else ("action",))
        for name in bucket_arrays:
            if getattr(self, name).shape != (roles, groups):
                raise PolicyError(f"policy {name} has shape {getattr(self, name).shape}, expected {(roles, groups)}")
        if self.group_fractions.shape != (groups,):
            raise PolicyError(f"group_fractions has shape {self.group_fractions.shape}, expected ({groups},)")
        if not ((self.floor >= 0) & (self.floor <= 1)).all() or not ((self.priority >= 0) & (self.priority < 1)).all():
            raise PolicyError("floors must lie in [0, 1] and priorities in [0, 1)")
        if not ((self.group_fractions > 0) & (self.group_fractions <= 1)).all():
            raise PolicyError(f"group fractions must lie in (0, 1]: {self.group_fractions}")
        if self.action is not None and not np.isin(self.action, (RELEASE, RETAIN_LOW, RETAIN_HIGH)).all():
            raise PolicyError(f"actions must be one of {', '.join(f'{i} ({n})' for i, n in enumerate(ACTION_NAMES))}")


@dataclasses.dataclass(frozen=True)
class CompileOptions:
    """How statistics become tables; a policy records them, so a budget compiled on load matches the others."""

    tolerance: float = 0.02  # task-error increase a floor may allow
    floor_share: float = 1.0  # fraction of a layer group's share of the budget its floors may take
    ablation: str = "none"
    # (full bf16, LOW, HIGH) bytes of one entry of one KV head of one layer. Given: compile precision actions (the
    # statistics must carry the LOW measurements); None: presence-only tables.
    entry_bytes: tuple[float, float, float] | None = None
    value: str = "distortion"  # precision actions: the knapsack's value, one of ACTION_VALUES
    # precision actions: bytes per layer (and KV head) the cache holds beside the plan's entries, set aside from each
    # group's share (a two-pool cache's full-precision window: its entries' bytes over their LOW bytes)
    window_bytes: float = 0.0

    def __post_init__(self) -> None:
        if self.ablation not in ABLATIONS:
            raise ValueError(f"unknown ablation {self.ablation!r}; choose one of {', '.join(ABLATIONS)}")
        if self.value not in ACTION_VALUES:
            raise ValueError(f"unknown action value {self.value!r}; choose one of {', '.join(ACTION_VALUES)}")
        if self.value != "distortion" and self.entry_bytes is None:
            raise ValueError(f"value={self.value!r} ranks precision actions: it needs entry_bytes")
        if self.window_bytes and self.entry_bytes is None:
            raise ValueError(
                f"window_bytes={self.window_bytes} sets bytes aside from precision actions: it needs entry_bytes"
            )
        if self.window_bytes < 0:
            raise ValueError(f"window_bytes={self.window_bytes} must be >= 0")
        if not 0.0 <= self.floor_share <= 1.0:
            raise ValueError(f"floor_share={self.floor_share} must be in [0, 1]")
        if self.entry_bytes is not None:
            entry_bytes = tuple(float(x) for x in self.entry_bytes)  # policy.json gives a list
            if len(entry_bytes) != 3 or min(entry_bytes) <= 0 or entry_bytes[1] >= entry_bytes[2]:
                raise ValueError(
                    f"entry_bytes={self.entry_bytes} must be three positive sizes (full bf16, LOW, HIGH), LOW < HIGH"
                )
            object.__setattr__(self, "entry_bytes", entry_bytes)


def pooled_stats(stats, axis: int):
    """Statistics with task error and distortion replaced by their entries-weighted mean over `axis` (0: roles,
    1: groups), broadcast back (per entry; bucket totals as that mean x the bucket's entries); entries stay per
    bucket (they are the knapsack weights)."""
    weight = np.asarray(stats.entries, np.float64)

    def pool(x: np.ndarray) -> np.ndarray:
        w = weight.reshape(weight.shape + (1,) * (x.ndim - 2))
        mean = (x * w).sum(axis, keepdims=True) / np.maximum(w.sum(axis, keepdims=True), 1e-9)
        return np.broadcast_to(mean, x.shape).copy()

    pooled = copy.copy(stats)
    pooled.task_error = pool(np.asarray(stats.task_error, np.float64))
    pooled.distortion_per_entry = pool(np.asarray(stats.distortion_per_entry, np.float64))
    for name in ("task_error_low", "task_error_high"):  # the precision twins of task_error, where measured
        if getattr(stats, name, None) is not None:
            setattr(pooled, name, pool(np.asarray(getattr(stats, name), np.float64)))
    for name in ("distortion", "distortion_low", "distortion_high"):  # bucket totals: pooled per entry
        if getattr(stats, name, None) is not None:
            per_entry = np.asarray(getattr(stats, name), np.float64) / np.maximum(weight, 1e-9)
            setattr(pooled, name, pool(per_entry) * weight)
    return pooled


def _check_budget(budget: float, floor_share: float) -> None:
    if not 0.0 < budget <= 1.0:
        raise ValueError(f"budget={budget} must be in (0, 1]")
    if not 0.0 <= floor_share <= 1.0:
        raise ValueError(f"floor_share={floor_share} must be in [0, 1]")


def _bucket_weights(stats, group_layers: np.ndarray | None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(layers f64[G], weight f64[R, G] = entry-layers of each bucket, total f64[G] = entry-layers of each group)."""
    entries = np.asarray(stats.entries, np.float64)  # mean entries per item, per bucket
    layers = np.ones(entries.shape[1]) if group_layers is None else np.asarray(group_layers, np.float64)
    return layers, entries * layers[None, :], entries.sum(0) * layers


def _fraction_floors(
    stats, budget: float, tolerance: float, floor_share: float, weight: np.ndarray, total_per_group: np.ndarray
) -> np.ndarray:
    """f64[R, G] the smallest keep level within tolerance of the baseline task error per bucket, lowered (least
    sensitive per entry-layer first) until each group's floors take at most floor_share of its share of the budget."""
    levels = np.asarray(stats.levels, np.float64)
    within = np.asarray(stats.task_error) <= tolerance  # [R, G, Λ]
    first_ok = np.where(within.any(-1), levels[np.argmax(within, -1)], 1.0)
    floor = np.where(np.asarray(stats.entries) > 0, first_ok, 0.0)
    # Error increase when the bucket is removed, per entry-layer it would cost to keep.
    sensitivity = np.asarray(stats.task_error)[..., 0] / np.maximum(weight, 1e-9)
    for g in range(floor.shape[1]):
        share = floor_share * budget * total_per_group[g]
        for r in np.argsort(sensitivity[:, g], kind="stable"):  # least sensitive floors give way first
            excess = (floor[:, g] * weight[:, g]).sum() - share
            if excess <= 0:
                break
            floor[r, g] = max(0.0, floor[r, g] - excess / max(weight[r, g], 1e-9))
    return floor


def _dense_rank(value: np.ndarray) -> np.ndarray:
    """The rank of each value among the distinct values (equal values share it), scaled into [0, 1)."""
    distinct = np.unique(value)
    return np.searchsorted(distinct, value) / len(distinct)


def _within_budget(fractions: np.ndarray, budget: float, layers: np.ndarray) -> np.ndarray:
    """`fractions` scaled down where their layer-weighted mean exceeds the budget (float rounding never lifts it)."""
    return fractions * min(1.0, budget * layers.sum() / (fractions * layers).sum())


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
    """One budget's presence table from `CalibrationStats` (task_error[R, G, Λ], distortion_per_entry[R, G],
    entries[R, G])."""
    _check_budget(budget, floor_share)
    layers, weight, total_per_group = _bucket_weights(stats, group_layers)
    roles, groups = weight.shape
    capacity = budget * total_per_group.sum()

    # 1. Floors: smallest keep level within tolerance of the baseline task error.
    floor = np.zeros((roles, groups))
    if use_floors:
        floor = _fraction_floors(stats, budget, tolerance, floor_share, weight, total_per_group)

    # 2. Residual capacity by distortion per entry (fractional knapsack, greedy by value density). Every group first
    #    reaches budget / GROUP_SHARE (its own best buckets first), then all compete, no group above GROUP_SHARE x
    #    budget: without the bounds a group whose buckets all score higher takes everything and starves the rest.
    kept = floor * weight
    value = np.asarray(stats.distortion_per_entry, np.float64) if use_distortion else np.ones((roles, groups))
    low, high = budget / GROUP_SHARE * total_per_group, min(1.0, GROUP_SHARE * budget) * total_per_group
    # With the lower bounds as caps and their total deficit as the amount, every group fills exactly its own deficit.
    kept = _fill_by_value(kept, weight, value, low, np.maximum(low - kept.sum(0), 0.0).sum())
    kept = _fill_by_value(kept, weight, value, high, capacity - kept.sum())
    fractions = _within_budget(kept.sum(0) / np.maximum(total_per_group, 1e-9), budget, layers)
    kept_fraction = np.where(weight > 0, kept / np.maximum(weight, 1e-9), 0.0)
    # Priority: the rank of the bucket's value (dense: equal values share a priority), scaled into [0, 1).
    priority = _dense_rank(value) if use_distortion else np.zeros((roles, groups))
    return PolicyTable(
        budget=float(budget),
        floor=floor.astype(np.float32),
        priority=priority.astype(np.float32),
        retain=kept_fraction >= 0.5,
        group_fractions=fractions.astype(np.float32),
    )


def _held(per_action: np.ndarray, action: np.ndarray) -> np.ndarray:
    """f64[R, G] the entry of `per_action` (f64[R, G, 3]) at each bucket's action."""
    return np.take_along_axis(per_action, action[..., None].astype(np.intp), -1)[..., 0]


def _step_floors_down(
    action: np.ndarray,  # i[R, G] floor actions
    error: np.ndarray,  # f64[R, G, 3] task-error increase under each action
    cost: np.ndarray,  # f64[R, G, 3] bytes of each action
    share: np.ndarray,  # f64[G] most bytes a group's floors may take
    slack: float,  # bytes of float rounding to ignore
) -> np.ndarray:
    """Floor actions lowered one step at a time, the step adding the least task error per byte saved first (ties: the
    lowest role id), until each group's floors fit its share."""
    action = action.copy()
    for g in range(action.shape[1]):
        while _held(cost, action)[:, g].sum() > share[g] + slack:
            lowerable = np.nonzero((action[:, g] > RELEASE) & (cost[:, g, RETAIN_HIGH] > 0))[0]
            a = action[lowerable, g]
            saved = cost[lowerable, g, a] - cost[lowerable, g, a - 1]
            worse = np.maximum(error[lowerable, g, a - 1] - error[lowerable, g, a], 0.0)
            action[lowerable[np.argmin(worse / saved)], g] -= 1
    return action


def _hull_steps(start: np.ndarray, cost: np.ndarray, value: np.ndarray) -> list[tuple[float, int, int, int, int]]:
    """Every upgrade of a bucket with entries from its floor action `start` along the upper convex hull of its
    (cost, value) points, as (incremental value per byte, from, to, role, group), in the order the greedy takes
    them: most value per byte first, then cheaper targets (a bucket's LOW before its HIGH when both are worth the
    same per byte), then role and group."""
    steps = []
    for r, g in zip(*np.nonzero(cost[..., RETAIN_HIGH] > 0), strict=True):
        c, v = cost[r, g], value[r, g]
        points = list(range(start[r, g], RETAIN_HIGH + 1))
        # LOW lies under the hull when the step LOW -> HIGH is worth more per byte than the step to LOW (slopes
        # compared cross-multiplied: RELEASE costs nothing, LOW less than HIGH).
        to_low, low_to_high = v[RETAIN_LOW] - v[RELEASE], v[RETAIN_HIGH] - v[RETAIN_LOW]
        if len(points) == 3 and to_low * (c[RETAIN_HIGH] - c[RETAIN_LOW]) < low_to_high * c[RETAIN_LOW]:
            points = [RELEASE, RETAIN_HIGH]
        for a, b in zip(points, points[1:], strict=False):
            steps.append((float((v[b] - v[a]) / (c[b] - c[a])), a, b, int(r), int(g)))
    return sorted(steps, key=lambda s: (-s[0], s[2], s[3], s[4]))


def _take_upgrades(
    action: np.ndarray,  # i[R, G]
    steps: list[tuple[float, int, int, int, int]],  # from `_hull_steps`
    cost: np.ndarray,  # f64[R, G, 3]
    group_cap: np.ndarray,  # f64[G] most bytes a group may hold
    capacity: float,  # most bytes the plan may hold
    slack: float,
) -> np.ndarray:
    """`action` with the upgrades of `steps` taken in order wherever one fits whole (the bucket at its `from` action,
    its group within its cap, the plan within capacity); one that does not fit is passed over for smaller ones."""
    action = action.copy()
    spent = _held(cost, action).sum(0)  # f64[G]
    for _, a, b, r, g in steps:
        extra = cost[r, g, b] - cost[r, g, a]
        if action[r, g] == a and extra <= min(group_cap[g] - spent[g], capacity - spent.sum()) + slack:
            action[r, g] = b
            spent[g] += extra
    return action


def compile_action_table(
    stats,
    budget: float,
    entry_bytes: tuple[float, float, float],
    *,
    tolerance: float = 0.02,
    use_floors: bool = True,
    use_distortion: bool = True,
    floor_share: float = 1.0,
    group_layers: np.ndarray | None = None,  # i[G] layers per group (default: equal)
    value: str = "distortion",  # one of ACTION_VALUES
    window_bytes: float = 0.0,  # bytes per layer held beside the plan (CompileOptions.window_bytes)
) -> PolicyTable:
    """One budget's table with precision actions from `CalibrationStats` carrying the LOW statistics (task_error[R,
    G, Λ], task_error_low, distortion, distortion_low, entries[R, G]). `entry_bytes` = (full bf16, LOW, HIGH) bytes
    of one entry of one KV head of one layer; the budget is bytes held over the bytes of a full bf16 cache."""
    _check_budget(budget, floor_share)
    full, low_bytes, high_bytes = entry_bytes
    layers, weight, total_per_group = _bucket_weights(stats, group_layers)
    roles, groups = weight.shape
    cost = weight[..., None] * np.array([0.0, low_bytes, high_bytes])  # f64[R, G, 3] bytes of each action
    reference = full * total_per_group  # f64[G] bytes of each group at full bf16 KV
    reserved = window_bytes * layers  # f64[G] held beside the plan in every layer of the group
    capacity = max(budget * reference.sum() - reserved.sum(), 0.0)
    slack = 1e-9 * reference.sum()  # byte sums that agree up to float rounding fit
    present = weight > 0

    # 1. Floor actions: the cheapest action within tolerance (HIGH is the best there is: its floor where none is).
    removed = np.asarray(stats.task_error, np.float64)[..., list(stats.levels).index(0.0)]
    lossy_high = getattr(stats, "high_storage", None) is not None  # else full precision: no error, no distortion
    error_high = np.asarray(stats.task_error_high, np.float64) if lossy_high else np.zeros_like(removed)
    error = np.stack([removed, np.asarray(stats.task_error_low, np.float64), error_high], -1)
    start = np.full((roles, groups), RELEASE)
    if use_floors:
        low_ok = np.where(error[..., RETAIN_LOW] <= tolerance, RETAIN_LOW, RETAIN_HIGH)
        start = np.where(removed <= tolerance, RELEASE, low_ok)
    start[~present] = RETAIN_LOW  # nothing measured and nothing to pay for: neither dropped nor full precision
    start = _step_floors_down(start, error, cost, np.maximum(floor_share * budget * reference - reserved, 0.0), slack)

    # 2. The remaining bytes: multiple-choice knapsack over (bucket, action), value = the damage of RELEASE that the
    #    action removes. Distortion is a norm ratio over the group's layers: like the presence compile (value per
    #    entry-layer), each layer of the group counts, so a bucket's value per byte does not depend on its group's
    #    size. The NLL change is already the whole group's (the bucket left out of all its layers); a negative mean
    #    change (noise) is worth nothing. Group bounds as in the presence compile, in bytes.
    if use_distortion:
        if value == "nll":
            damage = np.clip(np.asarray(stats.nll_delta, np.float64)[..., list(stats.levels).index(0.0)], 0.0, None)
            damage_low = np.asarray(stats.nll_delta_low, np.float64)
            damage_high = np.asarray(stats.nll_delta_high, np.float64) if lossy_high else None
        else:
            damage = np.asarray(stats.distortion, np.float64) * layers
            damage_low = np.asarray(stats.distortion_low, np.float64) * layers
            damage_high = np.asarray(stats.distortion_high, np.float64) * layers if lossy_high else None
        low_value = np.clip(damage - damage_low, 0.0, damage)
        # a lossy HIGH removes what its own damage leaves, never less than LOW does (measurement noise)
        high_value = damage if damage_high is None else np.clip(damage - damage_high, low_value, damage)
        values = np.stack([np.zeros_like(damage), low_value, high_value], -1)  # f64[R, G, 3]
    else:
        values = cost  # every byte worth the same
    steps = _hull_steps(start, cost, values)
    low, high = (
        np.maximum(share * reference - reserved, 0.0)
        for share in (budget / GROUP_SHARE, min(1.0, GROUP_SHARE * budget))
    )
    action = _take_upgrades(start, steps, cost, low, capacity, slack)  # every group its own lower bound first
    action = _take_upgrades(action, steps, cost, high, capacity, slack)

    # 3. The table. Priority: the rank of the value per byte of the action held (of the first upgrade for RELEASE).
    held = _held(cost, action)
    density = np.where(held > 0, _held(values, action) / np.maximum(held, 1e-30), 0.0)
    for d, a, _, r, g in steps:
        if a == RELEASE and action[r, g] == RELEASE:
            density[r, g] = d
    priority = _dense_rank(density) if use_distortion else np.zeros((roles, groups))
    fraction_floor = np.zeros((roles, groups))
    if use_floors:
        fraction_floor = _fraction_floors(stats, budget, tolerance, floor_share, weight, total_per_group)
    floor = np.where(action == RELEASE, fraction_floor, 1.0)  # retained buckets are not released: all are kept
    fractions = (held.sum(0) + reserved) / np.maximum(reference, 1e-9)
    fractions = _within_budget(np.clip(fractions, budget / GROUP_SHARE, min(1.0, GROUP_SHARE * budget)), budget, layers)
    return PolicyTable(
        budget=float(budget),
        floor=floor.astype(np.float32),
        priority=priority.astype(np.float32),
        retain=action != RELEASE,
        group_fractions=fractions.astype(np.float32),
        action=action.astype(np.int8),
    )


def compile_tables(
    stats, budgets: Sequence[float], options: CompileOptions = CompileOptions()
) -> tuple[PolicyTable, ...]:
    """One table per budget from `stats` under `options` (the ablation pools the statistics or switches a stage
    off); layer groups are weighted by their layer counts. With `options.entry_bytes`, precision actions
    (`compile_action_table`: PolicyError if the statistics lack the LOW measurements), else presence tables."""
    if options.entry_bytes is not None:
        measured = (*LOW_STATS_ARRAYS, *(HIGH_STATS_ARRAYS if getattr(stats, "high_storage", None) else ()))
        missing = [name for name in measured if getattr(stats, name, None) is None]
        if missing:
            raise PolicyError(
                f"entry_bytes={options.entry_bytes} compiles precision actions, which need every bucket measured at "
                f"LOW precision, and these statistics lack {', '.join(missing)}: calibrate with a LOW precision "
                "(`low_storage`, e.g. 'kivi2'), or compile presence-only tables (no entry_bytes)"
            )
    if options.ablation in ("one_role", "one_group"):
        stats = pooled_stats(stats, axis=0 if options.ablation == "one_role" else 1)
    off = {"no_floors": {"use_floors": False}, "no_distortion": {"use_distortion": False}}.get(options.ablation, {})
    group_layers = np.asarray([b - a for a, b in layer_groups(stats.num_layers, stats.groups)])
    common = {"tolerance": options.tolerance, "floor_share": options.floor_share, "group_layers": group_layers} | off
    if options.entry_bytes is None:
        return tuple(compile_table(stats, budget, **common) for budget in budgets)
    common |= {"value": options.value, "window_bytes": options.window_bytes}
    return tuple(compile_action_table(stats, budget, options.entry_bytes, **common) for budget in budgets)
