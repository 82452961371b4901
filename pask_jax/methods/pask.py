"""PASK: parser-aware structural KV persistence, online side (arXiv 2608.28276).

Every cache entry carries its structural role (prompt roles from lexing the tools JSON, generated roles from the
grammar's parser state). A compiled `PersistencePolicy` gives, per (role, layer group) bucket, a protection floor,
a priority and a RETAIN / RELEASE action; the method turns them into one integer-valued score per entry:

    score = level * 2**16 + position,   level = tier * 65 + round(64 * priority)

so the lowest level leaves first and, within a level, the oldest entry. Tiers: 2 = generated tokens of RETAIN
buckets (the call written so far), 1 = floor-protected prompt entries (the most recent ceil(floor * n) entries of
each prompt bucket: the recency rule calibration measured floors with), 0 = the rest. Generated RETAIN entries rank
above floors because calibration measured every floor with the whole generated call present: a floor is only valid
while the call stays (evicting it instead sends the model into repetition loops). RELEASE buckets' generated entries
fall to the bottom once they are more than `release_window` tokens old. The decode step does one table lookup per
token: no attention statistics. Scores stay exact in float32 (< 2**24) for positions below 2**16.

Hyper-parameters:
- `sinks`: first positions kept, as StreamingLLM's attention sinks (1 here, the SINK role).
- `rank`: how prompt entries are ordered once the policy has placed them. "dapq_tier" (default): inside a tier, by
  DapQ's position-aware pseudo-query scores alone (the prompt part the coming call attends to): the policy's floors
  still protect their entries, and DapQ, not the calibrated priority, orders the rest of the prompt. "dapq": inside
  a level, by DapQ's scores instead of position. "recency": inside a level, by position (the first PASK's rule).
  The query-aware order needs no grammar, so free-text answers keep it too.
- `pooling`: "max" (default), "avg" or "none": DapQ's scores pooled along the keys (SnapKV's kernel of 7) before
  they order entries (the long-prompt dev choice).
- `query`: whose attention the query-aware order reads. "pseudo" (default): DapQ's pseudo queries placed where the
  call will be written; "window": SnapKV's observation window (the prompt's last 32 tokens: the question when it
  comes last), pooled as `pooling` says; "both": an entry ranks by the higher of its two ranks (ties by the pseudo
  queries' rank), so what either query attends to stays.
- `granularity`: what the query-aware order ranks. "entry" (default): each prompt entry by its own score. "tool":
  the entries of one offered tool's definition rank together, at the score of the tool's best entry (then by their
  own), so the budget keeps whole tools, the one the query attends to most first, instead of fragments of every
  tool; entries outside tool definitions keep their own score. Needs a query-aware `rank` and the prompt's tool
  indices (without them it ranks entries).
- `floor_order`: which of a role's entries its floor protects when the floor is a fraction. "recency" (default):
  the most recent ceil(floor * n), the rule calibration measured floors with. "query": the ceil(floor * n) that the
  query-aware order ranks highest (needs a DapQ `rank`). On a long request at a small budget the recent tail alone
  can outnumber what a layer keeps, so an earlier passage the answer needs sits below all of it.
- `system_as_request`: score a system message's text as REQUEST_TEXT (the request's floor, priority and action),
  default on. A system message either states the task or holds the request itself (a request placed before the
  tools); calibration items carry a fixed instruction there, which would give SYSTEM_TEXT nothing.
- `schema_release`: schema-conditioned release. Once the parser has read the function name of the call being
  written, the prompt entries of every other offered tool's definition fall below every level (oldest first), so
  the running cap takes them before the request or the called tool's schema; when the next parallel call starts,
  nothing is released until its name is read. Structure only the parser knows: no attention statistic gives it.
Without a policy (`PaskKV()`), every bucket is equal: the order alone decides, with sinks.

Precision actions. A policy compiled with them (`PolicyTable.action`) gives each bucket RELEASE, RETAIN_LOW or
RETAIN_HIGH, and the cache gets two precisions (`storage`): a slot pool at full precision (HIGH, at most
`high_window` entries and a block) and a block pool at `low_storage` (LOW: KIVI's 2-bit blocks, keys per channel).
Tiers then follow the actions: 0 RELEASE (floor-protected entries 1), 1 RETAIN_LOW, 2 RETAIN_HIGH prompt entries,
3 RETAIN_HIGH generated entries (generated RETAIN_LOW ones 1, RELEASE ones released as above). At prefill the prompt
entries of tier >= 2 stay in slots (the window and the bytes permitting; with `fill_window` the highest-ranked
entries of any tier), the rest go down into blocks, lowest first;
at each step the running byte cap takes the lowest slot entries down a block (also when the slots are full), then
releases the lowest entry or block, tier 0 first (with `release_first`, a tier-0 entry leaves before anything goes
down). So the call being written and the structure the call needs stay at full precision, the rest at 2 bits, and
what the policy releases leaves first when something must.

With `high_storage` a block format (a policy compiled from statistics measured at both precisions,
`pask-jax calibrate --high-stats`), HIGH is a second block pool instead of full-precision slots -- RETAIN_HIGH
buckets at 4 bits, RETAIN_LOW and RELEASE ones at 2 bits (TriAxialKV's two pools, chosen per bucket and layer group)
-- and the slots are KIVI's full-precision window of the newest `high_window` to `high_window + low_group` entries,
going down a block at a time, oldest first, each entry into the pool of its bucket. Prefill keeps the best-ranked
prompt entries whose blocks fit the bytes (RELEASE tiers first out), the running cap as above.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np

from pask_jax.layers import layer_groups
from pask_jax.methods.base import PROTECTED, KVMethod, PrefillContext
from pask_jax.methods.dapq import DapQ
from pask_jax.methods.snapkv import SnapKV
from pask_jax.policy import PersistencePolicy
from pask_jax.policy_compiler import RELEASE, RETAIN_HIGH
from pask_jax.storage import BLOCK_FORMATS, Storage
from pask_jax.structure.roles import NO_TOOL, Role, num_roles

POSITION_RANGE = 2**16
PRIORITY_LEVELS = 64
TIER = PRIORITY_LEVELS + 1  # levels per tier: 0 unprotected, 1 floor-protected prompt, 2 retained generated
RANKS = ("recency", "dapq", "dapq_tier")
POOLINGS = ("none", "max", "avg")
FLOOR_ORDERS = ("recency", "query")
QUERIES = ("pseudo", "window", "both")
GRANULARITIES = ("entry", "tool")
GENERATED_TIER = (0, 1, 3)  # a generated entry's tier by its bucket's action (RELEASE, RETAIN_LOW, RETAIN_HIGH)
HIGH_TIER = 2  # prompt entries of this tier and above stay at full precision at prefill

Table = tuple[tuple[float, ...], ...]  # [R][G]


@dataclasses.dataclass(frozen=True)
class PaskKV(KVMethod):
    name: ClassVar[str] = "pask"
    needs_roles: ClassVar[bool] = True
    floor: Table = ()  # [R][G]; empty: no policy (every bucket equal)
    priority: Table = ()  # [R][G] in [0, 1)
    retain: tuple[tuple[bool, ...], ...] = ()  # [R][G]
    group_fractions: tuple[float, ...] = ()  # [G]
    layer_group: tuple[int, ...] = ()  # [L] group of each layer
    budget: float | None = None  # the budget the tables were compiled for (None: no policy)
    release_window: int = 8
    sinks: int = 1
    rank: str = "dapq_tier"  # or "dapq" / "recency"
    pooling: str = "max"  # of the DapQ scores that order entries: or "none" / "avg"
    floor_order: str = "recency"  # or "query"
    query: str = "pseudo"  # or "window" / "both"
    granularity: str = "entry"  # or "tool"
    system_as_request: bool = True
    schema_release: bool = False
    action: tuple[tuple[int, ...], ...] = ()  # [R][G] RELEASE / RETAIN_LOW / RETAIN_HIGH; empty: presence only
    high_window: int = 128  # with actions: full-precision slot entries at most (and one block going down)
    low_storage: str = "kivi2"  # with actions: the block pool's format (LOW)
    high_storage: str = "bf16"  # with actions: HIGH's format: full-precision slots, or a second block pool (kivi4)
    low_group: int = 32  # with actions: tokens per LOW block (its keys' channel groups; channels per value group)
    release_first: bool = False  # with actions: RELEASE entries leave before anything goes down (default: go down)
    fill_window: bool = False  # with actions: prefill leaves the highest-ranked entries of any tier in the window

    def __post_init__(self) -> None:
        for table in ("floor", "priority", "retain", "action"):  # lists (a policy's, a method config's): hashable rows
            object.__setattr__(self, table, tuple(map(tuple, getattr(self, table))))
        if self.rank not in RANKS:
            raise ValueError(f"PASK rank must be one of {RANKS}, not {self.rank!r}")
        if self.pooling not in POOLINGS:
            raise ValueError(f"PASK pooling must be one of {POOLINGS}, not {self.pooling!r}")
        if self.floor_order not in FLOOR_ORDERS:
            raise ValueError(f"PASK floor_order must be one of {FLOOR_ORDERS}, not {self.floor_order!r}")
        if self.query not in QUERIES:
            raise ValueError(f"PASK query must be one of {QUERIES}, not {self.query!r}")
        if self.granularity not in GRANULARITIES:
            raise ValueError(f"PASK granularity must be one of {GRANULARITIES}, not {self.granularity!r}")
        if self.granularity == "tool" and self.rank == "recency":
            raise ValueError('PASK granularity="tool" needs a query-aware rank ("dapq" or "dapq_tier"), not "recency"')
        if self.floor_order == "query" and self.rank == "recency":
            raise ValueError('PASK floor_order="query" needs a query-aware rank ("dapq" or "dapq_tier"), not "recency"')
        if self.low_storage not in BLOCK_FORMATS:
            raise ValueError(f"PASK low_storage must be one of {list(BLOCK_FORMATS)}, not {self.low_storage!r}")
        if self.high_window < 1 or self.low_group < 1:
            raise ValueError(f"PASK needs high_window, low_group >= 1, got {self.high_window}, {self.low_group}")
        if self.high_storage not in ("bf16", *BLOCK_FORMATS) or self.high_storage == self.low_storage:
            raise ValueError(
                f"PASK high_storage must be bf16 or a block format other than low_storage ({self.low_storage}), not "
                f"{self.high_storage!r}"
            )
        if self.two_pools and self.high_window < self.low_group:
            raise ValueError(f"PASK with two block pools needs high_window >= low_group, got {self.high_window}")

    @property
    def two_pools(self) -> bool:
        """Whether HIGH is a block pool (`high_storage`), not full-precision slots."""
        return self.high_storage != "bf16"

    @classmethod
    def from_policy(cls, policy: PersistencePolicy, budget: float, **overrides) -> PaskKV:
        """The method under `policy`'s table for `budget`; its precisions (LOW, HIGH) those the policy's statistics
        were measured at, unless `overrides` name them (or replace a table: a dev variant's own `action`)."""
        t = policy.table(budget)
        groups = layer_groups(policy.num_layers, policy.groups)
        measured = {}  # the precisions the actions were compiled for
        if t.action is not None and policy.stats is not None:
            high = getattr(policy.stats, "high_storage", None) or "bf16"  # statistics older than HIGH measurements
            measured = {"low_storage": policy.stats.low_storage, "high_storage": high}
        tables = dict(  # [R][G] rows as lists: `__post_init__` makes them tuples
            floor=t.floor.tolist(),
            priority=t.priority.tolist(),
            retain=t.retain.tolist(),
            group_fractions=tuple(t.group_fractions.tolist()),
            layer_group=tuple(g for g, (a, b) in enumerate(groups) for _ in range(a, b)),
            budget=t.budget,
            release_window=policy.release_window,
            action=() if t.action is None else t.action.tolist(),
        )
        return cls(**tables | measured | overrides)  # an `action` table in `overrides` replaces the policy's

    def storage(self, budget: float, head_dim: int) -> Storage | None:
        """With actions: full-precision slots (HIGH) and a block pool at `low_storage` (LOW); with `two_pools`, a
        block pool at `high_storage` (HIGH), one at `low_storage` (LOW) and the full-precision window."""
        if not self.action:
            return None
        return Storage.for_actions(self.low_storage, self.high_storage, head_dim, self.low_group, self.high_window)

    def _actions(self, layer: int) -> jax.Array:  # i32[R]
        return jnp.asarray(self.action, jnp.int32)[:, self.layer_group[layer]]

    def _bucket_tables(self, layer: int) -> tuple[jax.Array, jax.Array, jax.Array]:
        """This layer's group column of the tables: floor f32[R], priority f32[R], retain bool[R]."""
        if not self.floor:
            r = num_roles()
            return jnp.zeros(r), jnp.zeros(r), jnp.ones(r, bool)
        g = self.layer_group[layer]
        return (
            jnp.asarray(self.floor)[:, g],
            jnp.asarray(self.priority)[:, g],
            jnp.asarray(self.retain)[:, g],
        )

    def layer_fractions(self, num_layers: int, budget: float) -> np.ndarray:
        if not self.group_fractions:
            return np.full(num_layers, budget)
        if len(self.layer_group) != num_layers:
            raise ValueError(f"PASK policy covers {len(self.layer_group)} layers, the model has {num_layers}")
        if self.budget is not None and abs(self.budget - budget) > 1e-9:
            raise ValueError(f"PASK's policy table was compiled for budget {self.budget}, the engine runs at {budget}")
        return np.asarray([self.group_fractions[g] for g in self.layer_group])

    def _score(self, priority: jax.Array, roles: jax.Array, tier: jax.Array, positions: jax.Array) -> jax.Array:
        level = TIER * tier + jnp.round(PRIORITY_LEVELS * priority[roles])
        return level * POSITION_RANGE + jnp.minimum(positions, POSITION_RANGE - 1)

    def role_scores(self, layer: int, ctx: PrefillContext, order: jax.Array | None = None) -> jax.Array:
        """The prompt entries' levels from their roles, position inside a level -> f32[B, K, T]. A role's floor
        protects its entries highest in `order` (f32[B, K, T]; None: the most recent)."""
        floor, priority, _ = self._bucket_tables(layer)
        roles = ctx.roles  # i32[B, T]
        if self.system_as_request:
            roles = jnp.where(roles == int(Role.SYSTEM_TEXT), int(Role.REQUEST_TEXT), roles)
        roles = jnp.where(ctx.positions < self.sinks, int(Role.SINK), roles)
        b, t = roles.shape
        if order is None:  # the most recent first: the same for every KV head, so sorted once
            order = ctx.positions[:, None].astype(jnp.float32)  # f32[B, 1, T]
        protected = floor_protected(roles, ctx.valid, order, floor)  # bool[B, K or 1, T]
        tier = 1 * protected
        if self.action:  # RELEASE: 0, or 1 while floor-protected; RETAIN_LOW 1; RETAIN_HIGH 2
            action = self._actions(layer)[roles][:, None]  # i32[B, 1, T]
            tier = jnp.where(action == RELEASE, tier, action)
        score = self._score(priority, roles[:, None], tier, ctx.positions[:, None])
        score = jnp.where((ctx.positions < self.sinks)[:, None], PROTECTED, score)
        return jnp.broadcast_to(score, (b, ctx.kv_heads, t)).astype(jnp.float32)

    @property
    def needs_prefill_attention(self) -> bool:  # the observation window's attention, for a window query
        return self.rank != "recency" and self.query != "pseudo"

    def prefill_observe(self, layer, q, keys, query_start, ctx: PrefillContext) -> jax.Array:
        return SnapKV().prefill_observe(layer, q, keys, query_start, ctx)  # its window at SnapKV's defaults

    def query_order(self, observed: list, ctx: PrefillContext) -> list[jax.Array]:
        """Per layer, the prompt entries' rank under the query-aware order -> i32[B, K, T] (distinct per row,
        padding lowest)."""

        def rank(scores: jax.Array) -> jax.Array:
            scores = jnp.where(ctx.valid[:, None], scores, -jnp.inf)
            if self.granularity == "tool" and ctx.tools is not None:
                return rank_by_tool(scores, ctx.tools)
            return jnp.argsort(jnp.argsort(scores, axis=-1), axis=-1)

        pseudo = window = None
        if self.query != "window":
            pseudo = [rank(d) for d in DapQ(pooling=self.pooling).prefill_scores(observed, ctx)]
        if self.query != "pseudo":
            scores = observed if self.pooling == "none" else SnapKV(pooling=self.pooling).prefill_scores(observed, ctx)
            window = [rank(s) for s in scores]
        if window is None or pseudo is None:
            return window or pseudo
        # by the higher rank, then the pseudo queries' (padding is lowest in both); exact in int32 below 46k tokens
        t = ctx.valid.shape[-1]
        both = [jnp.maximum(p, w) * t + p for p, w in zip(pseudo, window, strict=True)]
        return [jnp.argsort(jnp.argsort(b, axis=-1), axis=-1) for b in both]

    def prefill_scores(self, observed: list, ctx: PrefillContext) -> list[jax.Array]:
        if self.rank == "recency":
            return [self.role_scores(layer, ctx) for layer in range(len(observed))]
        # Inside a level (or a tier), order prompt entries by the query-aware rank: it replaces the position (and,
        # for "dapq_tier", the priority).
        ranked = []
        for layer, order in enumerate(self.query_order(observed, ctx)):
            order = order.astype(jnp.float32)
            score = self.role_scores(layer, ctx, order if self.floor_order == "query" else None)
            level = jnp.floor(score / POSITION_RANGE)
            if self.rank == "dapq_tier":
                level = TIER * jnp.floor(level / TIER)
            ranked.append(jnp.where(score >= PROTECTED, score, level * POSITION_RANGE + order))
        return ranked

    def _generated_tier(self, layer: int, role: jax.Array) -> jax.Array:
        """A generated entry's tier (any shape of roles): 2 if retained (3 for RETAIN_HIGH with actions), else 0."""
        if self.action:
            return jnp.asarray(GENERATED_TIER)[self._actions(layer)[role]]
        return 2 * self._bucket_tables(layer)[2][role]

    def new_token_score(self, layer: int, position: jax.Array, role: jax.Array, kv_heads: int) -> jax.Array:
        _, priority, _ = self._bucket_tables(layer)
        score = self._score(priority, role, self._generated_tier(layer, role), position).astype(jnp.float32)
        return jnp.broadcast_to(score[:, None], (score.shape[0], kv_heads))

    def prefill_high(self, layer: int, scores: jax.Array, valid: jax.Array) -> jax.Array | None:
        if not self.action or self.two_pools:  # two pools: the window holds the newest entries, as KIVI's
            return None
        # fill_window: the bytes the HIGH entries leave pay for LOW entries at full precision until decode needs them
        high = valid[:, None] if self.fill_window else valid[:, None] & (scores >= HIGH_TIER * TIER * POSITION_RANGE)
        return jnp.sum(high, axis=-1, dtype=jnp.int32)

    def down_priority(self, layer, scores, pos, role, position, prompt_len) -> jax.Array:
        if not self.action or self.two_pools:  # two pools: the oldest first (KIVI's window)
            return super().down_priority(layer, scores, pos, role, position, prompt_len)
        return self.eviction_priority(layer, scores, pos, role, position, prompt_len)  # tiers: LOW before HIGH

    def block_pool(self, layer: int, role: jax.Array) -> jax.Array:
        if not self.two_pools:
            return super().block_pool(layer, role)
        return jnp.where(self._actions(layer)[role] == RETAIN_HIGH, 0, 1).astype(jnp.int32)  # HIGH: the first pool

    def release_line(self, layer: int) -> float:
        if self.action and self.release_first:
            return TIER * POSITION_RANGE  # tier 0 leaves first
        return super().release_line(layer)

    def block_entry_priority(self, layer, pos, role, position, prompt_len) -> jax.Array:
        if not self.action:
            return super().block_entry_priority(layer, pos, role, position, prompt_len)
        action = self._actions(layer)[role]
        generated = pos >= prompt_len[:, None, None]
        tier = jnp.where(generated, self._generated_tier(layer, role), jnp.where(action == RELEASE, 0, action))
        score = self._score(self._bucket_tables(layer)[1], role, tier, pos)
        score = jnp.where(pos < self.sinks, PROTECTED, score)
        return self.eviction_priority(layer, score, pos, role, position, prompt_len)

    def eviction_priority(self, layer, scores, pos, role, position, prompt_len) -> jax.Array:
        _, _, retain = self._bucket_tables(layer)
        released = (
            (pos >= prompt_len[:, None, None]) & ~retain[role] & (pos < position[:, None, None] - self.release_window)
        )
        return jnp.where(released, pos.astype(jnp.float32), scores)

    def release_unchosen_tools(self, layer, priority, pos, tool, called) -> jax.Array:
        if not self.schema_release:
            return priority
        called = called[:, None, None]
        unchosen = (tool != NO_TOOL) & (called != NO_TOOL) & (tool != called)
        return jnp.where(unchosen, pos.astype(jnp.float32) - POSITION_RANGE, priority)  # below every level (>= 0)


def rank_by_tool(scores: jax.Array, tools: jax.Array) -> jax.Array:
    """i32[B, K, T]: the entries' rank (distinct per row) by their tool's best score, then their own; scores
    f32[B, K, T], tools i32[B, T] (NO_TOOL: an entry outside every tool definition, ranked by its own score)."""
    b, k, t = scores.shape
    slot = jnp.broadcast_to(jnp.where(tools == NO_TOOL, t, tools)[:, None], scores.shape)  # i32[B, K, T]; t: none
    rows, heads = jnp.arange(b)[:, None, None], jnp.arange(k)[None, :, None]
    best = jnp.full((b, k, t + 1), -jnp.inf).at[rows, heads, slot].max(scores)  # f32[B, K, T + 1] per tool
    unit = jnp.where(slot < t, jnp.take_along_axis(best, slot, -1), scores)
    return jnp.argsort(jnp.lexsort((scores, unit), axis=-1), axis=-1)


def floor_protected(roles: jax.Array, valid: jax.Array, order: jax.Array, floor: jax.Array) -> jax.Array:
    """bool[B, K, T]: per sequence, KV head and role, the ceil(floor * n) valid entries of the role (n of them)
    highest in `order` (f32[B, K, T], distinct values per row; K may be 1); roles i32[B, T], valid bool[B, T],
    floor f32[R]."""
    r = num_roles()
    group = jnp.broadcast_to(jnp.where(valid, roles, r)[:, None], order.shape)  # padding sorts after every role
    place = jnp.argsort(jnp.lexsort((-order, group), axis=-1), axis=-1)  # by role, then highest order first
    count = jax.nn.one_hot(group, r + 1, dtype=jnp.int32).sum(-2)  # i32[B, K, R + 1]
    start = jnp.cumsum(count, -1) - count  # where each role's run begins
    rank = place - jnp.take_along_axis(start, group, -1)  # place inside the role's run
    quota = jnp.ceil(floor[jnp.minimum(group, r - 1)] * jnp.take_along_axis(count, group, -1))
    return (group < r) & (rank < quota)
