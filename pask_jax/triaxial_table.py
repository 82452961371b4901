"""TriAxialKV's tag table: which tags (roles) its cache stores at INT4, the others at INT2 (numpy, no model).

Two calibrations measure every bucket (role, layer group) with its entries read at a LOW precision instead of removed
(`pask-jax calibrate --low-storage kivi2`, then `kivi4`; `CalibrationStats.distortion_low`). The allocation is a
knapsack over tags, in bytes:

- per tag, pooled over layer groups (entries-weighted, as the compiler's `one_group` ablation pools): value = the
  attention-output distortion at INT2 minus the distortion at INT4, cost = the extra bytes of the tag's entries at
  INT4 over INT2 (its tokens per item, from the INT2 statistics, times the difference of a KIVI-4 and a KIVI-2 block
  entry, scales, zeros and metadata included);
- the bytes: every token of an average item as a KIVI-2 block entry, the full-precision window (`residual + group`
  entries at most, the most the window holds) as slot entries, against `budget` of the bf16 reference -- per layer
  and KV head, as the cache counts them (`pask_jax.storage`);
- greedy by value per byte: a tag goes up to INT4 where its cost still fits (one that does not fit is passed over
  for cheaper ones); a tag whose value is not positive, or that calibration never saw, stays at INT2. Where even
  INT2 everywhere does not fit, the table is INT2 everywhere (the running cap then takes the oldest entries).

The method takes the table as its hyper-parameter `int4` (`pask_jax.methods.triaxialkv`), in a method config section
that `triaxial_config` writes (`pask-jax triaxial-table --int2 STATS --int4 STATS --budget B --head-dim H --out
FILE.toml`, then `pask-jax run --method triaxialkv --method-config FILE.toml`).
"""

from __future__ import annotations

import json

import numpy as np

from pask_jax.methods.kivi import kivi_formats
from pask_jax.policy_compiler import CalibrationStats
from pask_jax.storage import Storage, full_entry_bytes
from pask_jax.structure.roles import role_names


def pooled_low_distortion(stats: CalibrationStats) -> np.ndarray:  # f64[R]
    """Each role's distortion at the statistics' LOW precision, pooled over layer groups weighted by entries."""
    weights = stats.entries.sum(axis=1)
    total = (stats.distortion_low * stats.entries).sum(axis=1)
    return np.divide(total, weights, out=np.zeros_like(total), where=weights > 0)


def _check(stats: CalibrationStats, low_storage: str, what: str) -> None:
    if stats.distortion_low is None or stats.low_storage != low_storage:
        measured = "no LOW precision" if stats.distortion_low is None else stats.low_storage
        raise ValueError(f"{what}: statistics calibrated with --low-storage {low_storage} are needed, not {measured}")
    if stats.entries.shape[0] != len(role_names()):
        raise ValueError(f"{what}: {stats.entries.shape[0]} roles, the taxonomy has {len(role_names())}")


def compile_triaxial_bits(
    stats_int2: CalibrationStats,
    stats_int4: CalibrationStats,
    budget: float,
    head_dim: int,
    group: int = 32,
    residual: int = 128,
) -> tuple[str, ...]:
    """The tags (role names) TriAxialKV stores at INT4 at `budget`, in the order the greedy took them (the highest
    distortion removed per byte first); () is INT2 everywhere. ValueError for statistics that do not fit."""
    if not 0.0 < budget <= 1.0:
        raise ValueError(f"budget={budget} must be in (0, 1]")
    _check(stats_int2, "kivi2", "the INT2 statistics")
    _check(stats_int4, "kivi4", "the INT4 statistics")
    for field in ("model", "taxonomy", "groups"):
        if getattr(stats_int2, field) != getattr(stats_int4, field):
            raise ValueError(
                f"the INT2 and INT4 statistics differ in {field}: "
                f"{getattr(stats_int2, field)!r} and {getattr(stats_int4, field)!r}"
            )
    int2, int4 = (Storage(blocks=kivi_formats(bits, group, head_dim)) for bits in (2, 4))
    entry2, entry4 = int2.block_entry_bytes(head_dim), int4.block_entry_bytes(head_dim)
    tokens = stats_int2.entries.mean(axis=1)  # f64[R] a role's tokens per item (the same in every layer group)
    window = min(residual + group, tokens.sum())
    limit = budget * tokens.sum() * full_entry_bytes(head_dim)
    spent = tokens.sum() * entry2 + window * (int2.slot_entry_bytes(head_dim) - entry2)
    if spent > limit:
        return ()
    value = pooled_low_distortion(stats_int2) - pooled_low_distortion(stats_int4)  # f64[R]
    cost = tokens * (entry4 - entry2)  # f64[R]
    candidates = [r for r in range(len(tokens)) if tokens[r] > 0 and value[r] > 0]
    chosen = []
    for r in sorted(candidates, key=lambda r: -value[r] / cost[r]):  # stable: ties by role id
        if spent + cost[r] <= limit:
            chosen.append(role_names()[r])
            spent += cost[r]
    return tuple(chosen)


def triaxial_config(
    int4: tuple[str, ...], label: str = "", note: str = "", group: int = 32, residual: int = 128
) -> str:
    """A method config section (TOML) giving TriAxialKV its table and the block and window it was compiled for:
    `[triaxialkv]`, or `["triaxialkv:LABEL"]`."""
    section = f'["triaxialkv:{label}"]' if label else "[triaxialkv]"
    comment = f"# {note}\n" if note else ""
    table = json.dumps(list(int4))  # a JSON list of strings is a TOML array
    return f"{comment}{section}\nint4 = {table}\ngroup = {group}\nresidual = {residual}\n"
