"""The jitted decode step around one step-input pytree, and what is static about an engine's steps.

`StepInput` is everything a decode step reads per sequence row: the token fed, its position and role, the row's
prompt length, and `MethodInputs`, what only some methods read (the tool the call being written calls, for PASK's
release of the tools not called). `StepPlan` is everything static (model structure, method, budget, layer groups,
kernel switch, mesh): hashable, so engines with equal plans share compiled steps. A decode step writes each row's
new K/V into its group cache, attends to the cache (`pask_jax.attention`), keeps the method's running cap by
evicting the entry it ranks lowest, then masks and samples.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from pask_jax.attention import decode_attention, decode_attention_probs
from pask_jax.cache import GroupCache
from pask_jax.kernels import per_row_shards
from pask_jax.methods import KVMethod
from pask_jax.methods.base import PrefillContext
from pask_jax.models.decoder import ModelConfig
from pask_jax.models.sharding import cache_axes, mesh_context
from pask_jax.runtime.budget import ByteBudget, Kept, block_priority
from pask_jax.runtime.sampling import sample_masked
from pask_jax.runtime.shapes import PREFILL_CHUNK, Capacity, pool_sizes
from pask_jax.storage import Storage
from pask_jax.structure.roles import NO_TOOL


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class MethodInputs:
    """Per-row inputs only some methods read."""

    called: jax.Array  # i32[B] the offered tool the row's call being written calls (NO_TOOL: not known yet)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class StepInput:
    """What one decode step feeds each sequence row (numpy on the host, placed by `Engine.place`)."""

    tokens: jax.Array  # i32[B] the token fed
    positions: jax.Array  # i32[B] its position
    roles: jax.Array  # i32[B] its structural role
    prompt_lengths: jax.Array  # i32[B] the row's prompt length
    method_inputs: MethodInputs | None = None  # None: nothing a method reads besides the above

    @classmethod
    def first(cls, rows: int) -> StepInput:
        """What an empty row is fed: token 0 at position 0, a prompt of one token, no tool called."""
        zeros = lambda: np.zeros(rows, np.int32)  # noqa: E731 -- one array per field: rows are updated in place
        return cls(zeros(), zeros(), zeros(), np.ones(rows, np.int32), MethodInputs(np.full(rows, NO_TOOL, np.int32)))

    def called_tools(self) -> jax.Array:
        """i32[B]: the tool each row's call calls (all NO_TOOL without method inputs)."""
        if self.method_inputs is None:
            return jnp.full(self.tokens.shape, NO_TOOL, jnp.int32)
        return self.method_inputs.called


@dataclasses.dataclass(frozen=True)
class StepPlan:
    """Everything static about an engine's jitted prefill and decode step.

    Hashable, so engines with the same model structure, method and budget share compiled functions.
    """

    graphdef: nnx.GraphDef
    cfg: ModelConfig
    method: KVMethod
    groups: tuple[tuple[int, int], ...]
    budget: float
    fractions: tuple[float, ...]  # per layer: the share of the full length it may keep
    use_kernel: bool
    dtype: jnp.dtype
    mesh: Mesh | None = None  # the device mesh its steps run on (None: one device)
    prefill_chunk: int = PREFILL_CHUNK  # prompt positions per prefill chunk at most (`prefill_plans`)
    storage: Storage = Storage()  # how the caches store K/V (`pask_jax.storage`)

    @property
    def bytes(self) -> ByteBudget:
        return ByteBudget(self.storage, self.cfg.head_dim, capped=self.budget < 1.0 and min(self.fractions) < 1.0)

    def _layer_slot(self, layer: int) -> tuple[int, int]:
        for g, (start, stop) in enumerate(self.groups):
            if start <= layer < stop:
                return g, layer - start
        raise IndexError(layer)

    def capacities(self, prompt_bucket: int, new_tokens: int) -> tuple[Capacity, ...]:
        """Per layer group, the largest need among its layers: slots per (layer, sequence, KV head), or with block
        pools (slots, blocks of each pool)."""
        full = prompt_bucket + new_tokens  # the allowance grows with the full length: its end bounds every step
        budget = self.bytes

        def need(start: int, stop: int) -> Capacity:
            allowances = [self.allowance(layer, np.float64(full)) for layer in range(start, stop)]
            slots = max(budget.slot_capacity(a, full) for a in allowances)
            if self.storage.blocks is None:
                return slots
            pools = range(len(self.storage.block_pools))
            return (slots, *(max(budget.block_capacity(a, full, p) for a in allowances) for p in pools))

        return tuple(need(start, stop) for start, stop in self.groups)

    def allowance(self, layer: int, full):
        """The method's allowance for `layer` at full length `full` (before the floor)."""
        return self.method.keep_allowance(self.fractions[layer], self.budget, full)

    def empty_caches(self, batch: int, capacities: tuple[Capacity, ...]) -> list[GroupCache]:
        """One empty cache per layer group at `capacities[g]` (slots, or slots and blocks)."""
        cfg = self.cfg
        axes = (None, None) if self.mesh is None else cache_axes(cfg.num_kv_heads, self.mesh.shape)
        caches = []
        for (start, stop), capacity in zip(self.groups, capacities, strict=True):
            slots, blocks = pool_sizes(capacity)
            layers = stop - start
            caches.append(
                GroupCache.empty(
                    layers, batch, cfg.num_kv_heads, slots, cfg.head_dim, self.dtype, axes, self.storage, blocks
                )
            )
        return caches

    def kept(self, caches: list[GroupCache]) -> Kept:
        """Entries and bytes each row holds, over layers and KV heads."""
        entries = sum(c.length.sum(axis=(0, 2)) for c in caches)  # i32[B]
        held = sum(self.bytes.held(c.length, *(pool.count for pool in c.block_pools)).sum(axis=(0, 2)) for c in caches)
        for c in caches:
            for pool in c.block_pools:
                entries += (pool.pos >= 0).sum(axis=(0, 2, 3, 4))
        return Kept(entries, jnp.asarray(held, jnp.float32))

    def fill(self, kv, scores, ctx: PrefillContext, capacities: tuple[Capacity, ...]):
        """Keep each layer's best-scored prompt entries (up to its quota) in fresh caches -> caches, `Kept`."""
        t = ctx.tokens.shape[1]
        caches = self.empty_caches(ctx.tokens.shape[0], capacities)
        for layer, (k, v) in enumerate(kv):
            g, li = self._layer_slot(layer)
            slots, blocks = pool_sizes(capacities[g])
            n_keep = min(t, slots + sum(blocks) * self.storage.block)
            down = high = pools = None
            if self.storage.blocks is not None:  # which kept entries stay at full precision
                high = self.method.prefill_high(layer, scores[layer], ctx.valid)  # i32[B, K] or None
                shape = scores[layer].shape  # (B, K, T)
                down = self.method.down_priority(
                    layer,
                    scores[layer],
                    jnp.broadcast_to(ctx.positions[:, None], shape),
                    jnp.broadcast_to(ctx.roles[:, None], shape),
                    ctx.lengths,
                    ctx.lengths,
                )
            allowance, available = self.allowance(layer, ctx.lengths)[:, None], ctx.lengths[:, None]  # [B, 1]
            ranked = jnp.where(ctx.valid[:, None], scores[layer], -jnp.inf)  # padding never kept
            best = per_row_shards(lambda r, n=n_keep: jax.lax.top_k(r, n)[1].astype(jnp.int32), caches[g].axes)
            keep = best(ranked)  # [B, K, n_keep], best first (on a mesh: each device ranks its own rows)
            retained = None
            if high is not None:  # the entries above the release line: all of them go down before one leaves
                above = scores[layer] >= self.method.release_line(layer)
                retained = jnp.sum(ctx.valid[:, None] & above, axis=-1, dtype=jnp.int32)  # i32[B, K]
            if self.storage.second_blocks is not None:  # what the bytes hold depends on each kept entry's pool
                if high is not None:
                    raise ValueError(f"{self.method.name}: entries kept at full precision need a single block pool")
                pools = self.method.block_pool(layer, ctx.roles)  # i32[B, T]
                kept_pools = jnp.take_along_axis(pools[:, None], keep, axis=2)  # i32[B, K, n_keep], best first
                quota = jnp.maximum(self.bytes.tagged_prefill_count(allowance, available, kept_pools), 1)
            else:
                quota = jnp.maximum(self.bytes.prefill_count(allowance, available, high, retained), 1)  # [B, K or 1]
            if high is not None:
                high = self.bytes.prefill_slots(allowance, available, high, retained)  # what the slots hold
            count = jnp.broadcast_to(jnp.minimum(quota, n_keep), keep.shape[:2])
            filled = caches[g].fill(
                li, k, v, ctx.positions, ctx.roles, keep, count, scores[layer], ctx.tools, down, high, pools
            )
            caches[g] = filled.constrain()
        return caches, self.kept(caches)

    def decode(self, params, caches, step: StepInput, mask_bits, key, temperature, top_p):
        """One token per sequence: write its K/V, attend to the cache, enforce the running cap, mask, sample."""
        logits, caches, kept, overflow = self.decode_logits(params, caches, step)
        next_tokens = sample_masked(logits, mask_bits, key, temperature, top_p)
        return next_tokens, caches, kept, overflow

    def decode_logits(self, params, caches, step: StepInput):
        """`decode` before the mask and the sampler -> (logits f32[B, V], caches, `Kept`, overflow bool[])."""
        with mesh_context(self.mesh):
            model = nnx.merge(self.graphdef, params)
            b = step.tokens.shape[0]
            kv_heads = self.cfg.num_kv_heads
            caches = list(caches)
            method = self.method
            positions, roles = step.positions, step.roles

            def attend(layer, q, k, v):
                g, li = self._layer_slot(layer)
                cache = caches[g].write(
                    li,
                    k[:, 0],
                    v[:, 0],
                    positions,
                    roles,
                    jnp.ones((b, kv_heads), bool),
                    method.new_token_score(layer, positions, roles, kv_heads),
                )
                if method.needs_decode_attention:
                    out, probs = decode_attention_probs(q[:, 0], cache, li)
                    cache = dataclasses.replace(
                        cache, score=cache.score.at[li].set(method.update_scores(layer, cache.score[li], probs))
                    )
                else:
                    out = decode_attention(q[:, 0], cache, li, use_kernel=self.use_kernel)
                caches[g] = self.keep_cap(layer, cache, li, step).constrain()
                return out[:, None]

            hidden = model.forward(step.tokens[:, None], positions[:, None], attend)
            logits = model.logits(hidden)[:, 0]
            overflow = jnp.stack([c.overflow for c in caches]).any()
            return logits, caches, self.kept(caches), overflow

    def keep_cap(self, layer: int, cache: GroupCache, li: int, step: StepInput) -> GroupCache:
        """After this step's token: hold at most the allowance at full length P + t + 1 (`runtime.budget`), by
        evicting the live entry the method ranks lowest -- with a block pool, after letting an entry below the
        method's release line go and taking the slot entries it ranks lowest for going down (`down_priority`: the
        oldest by default) down a block (when the window is full, or the bytes are over); a whole block leaves when
        it ranks lowest."""
        method, budget, positions = self.method, self.bytes, step.positions
        allowance = self.allowance(layer, positions + 1)[:, None]  # f[B, 1]: reference entries
        priority = method.eviction_priority(
            layer, cache.score[li], cache.pos[li], cache.role[li].astype(jnp.int32), positions, step.prompt_lengths
        )
        priority = method.release_unchosen_tools(
            layer, priority, cache.pos[li], cache.tool[li].astype(jnp.int32), step.called_tools()
        )
        priority = jnp.where(cache.pos[li] >= 0, priority, jnp.inf)
        lowest = jnp.argmin(priority, axis=-1).astype(jnp.int32)  # i32[B, K]
        if cache.blocks is None:
            return cache.evict(li, lowest, cache.length[li] > budget.slot_cap(allowance))
        limit = allowance * budget.full_bytes if budget.capped else jnp.inf
        over = budget.cache_held(cache, li) > limit  # bool[B, K]
        if method.release_line(layer) > -math.inf:  # a released entry leaves before anything goes down
            released = jnp.min(priority, axis=-1) < method.release_line(layer)
            cache = cache.evict(li, lowest, over & released)
            priority = jnp.where(cache.pos[li] >= 0, priority, jnp.inf)
            over = budget.cache_held(cache, li) > limit
        window_full = cache.length[li] >= self.storage.window + self.storage.block
        role = cache.role[li].astype(jnp.int32)
        down = method.down_priority(layer, cache.score[li], cache.pos[li], role, positions, step.prompt_lengths)
        cache = cache.take_down(li, window_full | over, down, method.block_pool(layer, role), forced=over)
        over = budget.cache_held(cache, li) > limit
        priority = jnp.where(cache.pos[li] >= 0, priority, jnp.inf)  # the entries taken down are no candidates
        # the lowest candidate leaves: a slot entry, or a whole block of a pool (a tie keeps the blocks)
        ranked = [
            block_priority(
                method,
                layer,
                pool.pos[li],
                pool.role[li],
                positions,
                step.prompt_lengths,
                jnp.arange(pool.blocks) < pool.count[li][..., None],
            )
            for pool in cache.block_pools
        ]  # f32[B, K, NB] per pool
        leaving = jnp.argmin(jnp.stack([jnp.min(r, axis=-1) for r in [priority, *ranked]], -1), axis=-1)  # i32[B, K]
        cache = cache.evict(li, jnp.argmin(priority, axis=-1).astype(jnp.int32), over & (leaving == 0))
        released = [
            pool.release(li, jnp.argmin(r, axis=-1).astype(jnp.int32), over & (leaving == p + 1))
            for p, (pool, r) in enumerate(zip(cache.block_pools, ranked, strict=True))
        ]
        return cache.with_block_pools(released)


# One compiled function per static signature (plan, capacities / sampling); the caches are donated to each step.
decode_jit = jax.jit(StepPlan.decode, static_argnums=(0, 6, 7), donate_argnums=(2,))
decode_logits_jit = jax.jit(StepPlan.decode_logits, static_argnums=(0,), donate_argnums=(2,))
empty_caches_jit = jax.jit(StepPlan.empty_caches, static_argnums=(0, 1, 2))


@functools.partial(jax.jit, donate_argnums=(0,))
def insert_rows_jit(caches: list[GroupCache], new: list[GroupCache], rows: jax.Array) -> list[GroupCache]:
    """Every group cache's rows `rows` (i32[b], past the batch: skipped) replaced by `new`'s b rows."""
    return [cache.insert_rows(fresh, rows) for cache, fresh in zip(caches, new, strict=True)]
