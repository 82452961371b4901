"""Batched generation: one jitted prefill per (batch, length bucket), then a jitted decode step per token.

Data flow per request batch:
  prompts -> right-padded to a length bucket -> prefill (full causal attention over the prompt; the
  method picks which prompt entries each layer's cache keeps) -> ragged KV cache -> decode steps.
Each decode step runs the model on one token per sequence, writes its K/V into the cache, attends to
the live slots, applies the host-supplied token mask (packed bits, as grammar engines write them),
and samples. The host loop only moves B token ids (and B kept-entry counts) per step.

On a device mesh (`Engine(..., mesh=make_mesh(data, model))`, `pask_jax.models.sharding`): parameters lie as the
sharding table says, batch rows and every per-sequence cache array are split over `data` (batches are padded to a
multiple of its size), KV heads over `model` where they divide it; scores, top-k selection and eviction are per
(sequence, KV head), so they run where their rows lie and give the tokens one device gives.

`generate_shared` runs several engines over one model on the same prompts: prefill attention is uncompressed for
every method, so one forward serves them all and each method fills its own cache from it (method sweeps).

For measuring (the benchmarks): `Engine.batch_shape` is the shape a generate call compiles for (prompt bucket, padded
batch, new-token bucket, cache capacities), `Engine.cache_bytes` the bytes its caches take, `Engine.lower` its
prefill and decode step lowered for XLA's memory analysis or HLO, and `generate(..., on_step=)` reports each step's
wall time.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from pask_jax.cache import GroupCache, per_row_shards
from pask_jax.decoding import DecodeRows, Generation, SamplingConfig, StepCallback, StepTiming, mask_words
from pask_jax.layers import layer_groups
from pask_jax.methods import FullKV, KVMethod
from pask_jax.methods.base import PrefillContext, allowance_capacity
from pask_jax.models.qwen3 import ModelConfig, Qwen3, attention, attention_probs
from pask_jax.models.sharding import DATA, cache_axes, check_mesh, constrain, mesh_context, shard_model
from pask_jax.structure.constraint import TokenConstraint
from pask_jax.structure.roles import NO_TOOL

# Prompt length buckets: steps of 1.5x keep padding under a third while bounding the number of compiles.
DEFAULT_LENGTH_BUCKETS = (
    64,
    128,
    192,
    256,
    384,
    512,
    768,
    1024,
    1536,
    2048,
    3072,
    4096,
    6144,
    8192,
    12288,
    16384,
    24576,
    32768,
)
# Prompt positions per prefill chunk: longer prompts run in chunks, so prefill holds one chunk's activations at a time.
PREFILL_CHUNK = 2048
# Plans one shared prefill compiles together: each adds its scoring and fill to the executable, and XLA:CPU ran out of
# memory compiling 27 at a 1024-position bucket, so a larger sweep runs one forward per group of this many.
PLANS_PER_PREFILL = 9
NEW_TOKEN_BUCKET = 64  # decode capacity grows in steps of this, so nearby max_new_tokens share a compile


def unpack_mask(bits: jax.Array, vocab: int) -> jax.Array:
    """i32[B, ceil(V/32)] packed bits (bit j of word w = token 32w+j) -> bool[B, V]."""
    ids = jnp.arange(vocab)
    return (jnp.right_shift(bits[:, ids // 32], (ids % 32).astype(jnp.int32)) & 1).astype(bool)


def sample(logits: jax.Array, key: jax.Array, temperature: float, top_p: float) -> jax.Array:
    """f32[B, V] -> i32[B]: greedy when temperature == 0, else temperature + nucleus sampling."""
    if temperature == 0.0:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    logits = logits / temperature
    if top_p < 1.0:
        order = jnp.argsort(-logits, axis=-1)
        sorted_logits = jnp.take_along_axis(logits, order, axis=-1)
        probs = jax.nn.softmax(sorted_logits, axis=-1)
        # drop a token when the mass before it already reaches top_p (the top token always stays)
        drop_sorted = (jnp.cumsum(probs, axis=-1) - probs) >= top_p
        drop = jnp.zeros_like(drop_sorted).at[jnp.arange(logits.shape[0])[:, None], order].set(drop_sorted)
        logits = jnp.where(drop, -jnp.inf, logits)
    return jax.random.categorical(key, logits, axis=-1).astype(jnp.int32)


@functools.partial(jax.jit, static_argnums=(3, 4))
def _sample_masked(logits: jax.Array, bits: jax.Array, key: jax.Array, temperature: float, top_p: float) -> jax.Array:
    """Apply the packed token mask (i32[B, ceil(V/32)]) to f32[B, V] logits, then sample -> i32[B]."""
    return sample(jnp.where(unpack_mask(bits, logits.shape[-1]), logits, -jnp.inf), key, temperature, top_p)


def length_bucket(n: int, buckets: Sequence[int] = DEFAULT_LENGTH_BUCKETS) -> int:
    """The smallest of the sorted `buckets` that holds a prompt of `n` tokens (what prefill pads to)."""
    for b in buckets:
        if n <= b:
            return b
    raise ValueError(f"a prompt of {n} tokens exceeds the largest length bucket {buckets[-1]}")


def padded_batch(rows: int, multiple: int = 1) -> int:
    """The batch the arrays of `rows` sequences have: padded to a power of two, so few batch sizes compile, and then
    to a multiple of `multiple` (a mesh's `data` size, so that every device holds whole rows)."""
    return -(-(1 << (rows - 1).bit_length()) // multiple) * multiple


def new_token_bucket(max_new_tokens: int) -> int:
    """Decode capacity sized for `max_new_tokens`: rounded up to NEW_TOKEN_BUCKET, so nearby values share a compile."""
    return -(-max_new_tokens // NEW_TOKEN_BUCKET) * NEW_TOKEN_BUCKET


@dataclasses.dataclass(frozen=True)
class BatchShape:
    """The static shapes of one generate call: what its prefill and decode steps are compiled for.

    From `Engine.batch_shape`; equal shapes mean the same compiled steps (and the same cache bytes).
    """

    rows: int  # real sequences
    padded_rows: int  # rows of every array: `padded_batch(rows, data size)`
    prompt_bucket: int  # prompt positions: the longest prompt's `length_bucket`
    new_token_bucket: int  # new tokens the caches are sized for: `new_token_bucket(max_new_tokens)`
    capacities: tuple[int, ...]  # slots per (layer, sequence, KV head) of each layer group

    def pad(
        self, prompts: Sequence[Sequence[int]], prompt_roles: Sequence[Sequence[int]] | None = None
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Right-pad prompts (and their roles) to this shape -> tokens i32[B, T], lengths i32[B], roles i32[B, T].

        Padding rows get length 1 (a valid position, so their attention is defined); their output is dropped.
        """
        if len(prompts) != self.rows or (prompt_roles is not None and len(prompt_roles) != self.rows):
            raise ValueError(f"this shape holds {self.rows} prompts (and as many role lists), not {len(prompts)}")
        tokens = np.zeros((self.padded_rows, self.prompt_bucket), np.int32)
        roles = np.zeros((self.padded_rows, self.prompt_bucket), np.int32)
        lengths = np.ones(self.padded_rows, np.int32)
        for i, p in enumerate(prompts):
            if not 0 < len(p) <= self.prompt_bucket:
                raise ValueError(f"prompt {i} has {len(p)} tokens; this shape holds 1..{self.prompt_bucket}")
            tokens[i, : len(p)] = p
            lengths[i] = len(p)
            if prompt_roles is not None:
                roles[i, : len(p)] = prompt_roles[i]
        return tokens, lengths, roles

    def pad_tools(self, prompt_tools: Sequence[Sequence[int] | None] | None) -> np.ndarray:
        """The tool each prompt token describes, right-padded with NO_TOOL to this shape -> i32[B, T] (a None row:
        describes no tool)."""
        tools = np.full((self.padded_rows, self.prompt_bucket), NO_TOOL, np.int32)
        if prompt_tools is None:
            return tools
        if len(prompt_tools) != self.rows:
            raise ValueError(f"this shape holds {self.rows} prompts and as many tool lists, not {len(prompt_tools)}")
        for i, row in enumerate(prompt_tools):
            if row is not None:
                tools[i, : len(row)] = row
        return tools


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

    def _layer_slot(self, layer: int) -> tuple[int, int]:
        for g, (start, stop) in enumerate(self.groups):
            if start <= layer < stop:
                return g, layer - start
        raise IndexError(layer)

    def capacities(self, prompt_bucket: int, new_tokens: int) -> tuple[int, ...]:
        """Slots per (layer, sequence, KV head) of each layer group: the largest need among its layers."""
        full = prompt_bucket + new_tokens  # the allowance grows with the full length: its end bounds every step
        return tuple(
            max(allowance_capacity(self.allowance(layer, np.float64(full)), full) for layer in range(start, stop))
            for start, stop in self.groups
        )

    def allowance(self, layer: int, full):
        """The method's allowance for `layer` at full length `full` (before the floor)."""
        return self.method.keep_allowance(self.fractions[layer], self.budget, full)

    def empty_caches(self, batch: int, capacities: tuple[int, ...]) -> list[GroupCache]:
        """One empty cache per layer group, `capacities[g]` slots per (layer, sequence, KV head)."""
        cfg = self.cfg
        axes = (None, None) if self.mesh is None else cache_axes(cfg.num_kv_heads, self.mesh.shape)
        return [
            GroupCache.empty(stop - start, batch, cfg.num_kv_heads, capacity, cfg.head_dim, self.dtype, axes)
            for (start, stop), capacity in zip(self.groups, capacities, strict=True)
        ]

    def fill(self, kv, scores, ctx: PrefillContext, capacities: tuple[int, ...]):
        """Keep each layer's best-scored prompt entries (up to its quota) in fresh caches -> caches, kept i32[B]."""
        t = ctx.tokens.shape[1]
        caches = self.empty_caches(ctx.tokens.shape[0], capacities)
        for layer, (k, v) in enumerate(kv):
            g, li = self._layer_slot(layer)
            n_keep = min(t, capacities[g])
            quota = jnp.maximum(jnp.floor(self.allowance(layer, ctx.lengths)).astype(jnp.int32), 1)  # i32[B]
            ranked = jnp.where(ctx.valid[:, None], scores[layer], -jnp.inf)  # padding never kept
            best = per_row_shards(lambda r, n=n_keep: jax.lax.top_k(r, n)[1].astype(jnp.int32), caches[g].axes)
            keep = best(ranked)  # [B, K, n_keep], best first (on a mesh: each device ranks its own rows)
            count = jnp.broadcast_to(jnp.minimum(quota, n_keep)[:, None], keep.shape[:2])
            filled = caches[g].fill(li, k, v, ctx.positions, ctx.roles, keep, count, scores[layer], ctx.tools)
            caches[g] = filled.constrain()
        kept = sum(c.length.sum(axis=(0, 2)) for c in caches)  # i32[B]
        return caches, kept

    def decode(
        self, params, caches, tokens, positions, roles, prompt_lengths, called, mask_bits, key, temperature, top_p
    ):
        """One token per sequence: write its K/V, attend to the cache, enforce the running cap, mask, sample."""
        logits, caches, kept, overflow = self.decode_logits(
            params, caches, tokens, positions, roles, prompt_lengths, called
        )
        next_tokens = _sample_masked(logits, mask_bits, key, temperature, top_p)
        return next_tokens, caches, kept, overflow

    def decode_logits(self, params, caches, tokens, positions, roles, prompt_lengths, called):
        """`decode` before the mask and the sampler -> (logits f32[B, V], caches, kept i32[B], overflow bool[]).

        `called` i32[B]: the tool each row's call being written calls (NO_TOOL: not known yet)."""
        with mesh_context(self.mesh):
            model = nnx.merge(self.graphdef, params)
            b = tokens.shape[0]
            kv_heads = self.cfg.num_kv_heads
            caches = list(caches)
            method = self.method

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
                    out, probs = cache.attend_probs(li, q[:, 0])
                    cache = dataclasses.replace(
                        cache, score=cache.score.at[li].set(method.update_scores(layer, cache.score[li], probs))
                    )
                else:
                    out = cache.attend(li, q[:, 0], self.use_kernel)
                # Running cap after this token: floor(allowance(P + t)) entries per (layer, sequence, head).
                cap = jnp.floor(self.allowance(layer, positions + 1)).astype(jnp.int32)  # i32[B]
                over = cache.length[li] > cap[:, None]
                priority = method.eviction_priority(
                    layer, cache.score[li], cache.pos[li], cache.role[li], positions, prompt_lengths
                )
                priority = method.release_unchosen_tools(layer, priority, cache.pos[li], cache.tool[li], called)
                priority = jnp.where(cache.pos[li] >= 0, priority, jnp.inf)
                caches[g] = cache.evict(li, jnp.argmin(priority, axis=-1).astype(jnp.int32), over).constrain()
                return out[:, None]

            hidden = model.forward(tokens[:, None], positions[:, None], attend)
            logits = model.logits(hidden)[:, 0]
            kept = sum(c.length.sum(axis=(0, 2)) for c in caches)  # i32[B] over layers and heads
            overflow = jnp.stack([c.overflow for c in caches]).any()
            return logits, caches, kept, overflow


def prefill_chunks(positions: int, chunk: int) -> int:
    """How many equal chunks a prefill over `positions` runs in: the fewest of at most `chunk` positions each that
    split it evenly (every default length bucket above 2048 splits into chunks of 1536 or 2048)."""
    n = -(-positions // chunk)
    while positions % n:
        n += 1
    return n


def prefill_plans(
    plans: tuple[StepPlan, ...], params, tokens, lengths, roles, tools, capacities: tuple[tuple[int, ...], ...]
):
    """A causal forward over the prompts, then every plan's method picks what its own caches keep.

    tokens i32[B, T], lengths i32[B], roles i32[B, T], tools i32[B, T] (the offered tool each token describes) ->
    last-token logits f32[B, V], per plan (caches, kept i32[B]).
    Prompts longer than the plan's `prefill_chunk` run in equal chunks under one loop, each chunk attending to the
    keys the chunks before it wrote (per-layer K/V buffers of the whole prompt), so the activations held at once are
    a chunk's, not the prompt's; methods that observe the prompt's attention add up their share per chunk.
    Prefill attention is uncompressed for every method, so plans over one model share the forward; only the
    scoring and the fill are per plan (how a method sweep runs many methods and budgets for one prefill).
    """
    with mesh_context(plans[0].mesh):
        base = plans[0]
        cfg = base.cfg
        model = nnx.merge(base.graphdef, params)
        b, t = tokens.shape
        positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
        valid = positions < lengths[:, None]
        kv: list[tuple[jax.Array, jax.Array]] = []  # per layer the prompt's keys and values, once the pass is done
        observing = [plan.method.needs_prefill_attention for plan in plans]

        def extra_query_scores(extra_tokens, extra_positions):
            """Attention mass that extra tokens, run after the prompt, give each prompt key (per layer)."""
            n = extra_tokens.shape[1]
            extra_mask = jnp.concatenate(
                [
                    jnp.broadcast_to(valid[:, None], (b, n, t)),
                    jnp.broadcast_to(jnp.tril(jnp.ones((n, n), bool)), (b, n, n)),
                ],
                axis=-1,
            )
            scores = []

            def attend_extra(layer, q, k, v):
                keys = jnp.concatenate([kv[layer][0], k], axis=1)
                values = jnp.concatenate([kv[layer][1], v], axis=1)
                probs = attention_probs(q, keys, extra_mask)  # [B, K, G, N, T + N]
                scores.append(probs[..., :t].sum(axis=(2, 3)))
                out = jnp.einsum("BKGTS,BSKH->BTKGH", probs.astype(values.dtype), values)
                return out.reshape(q.shape)

            model.forward(extra_tokens, extra_positions, attend_extra)
            return scores

        ctx = PrefillContext(tokens, positions, valid, lengths, roles, cfg.num_kv_heads, extra_query_scores, tools)

        def chunk_pass(start, chunk_tokens, buffers: list, sums: list[list]):
            """One chunk at prompt positions start.. through the layers -> hidden f[B, C, D], buffers, sums.

            buffers: per layer the whole prompt's (keys, values), this chunk's written at `start` (None: the chunk is
            the whole prompt, its keys are the layer's); sums: per plan and layer its observed scores so far (None:
            nothing yet, or a method that observes nothing)."""
            chunk_positions = jnp.broadcast_to(
                start + jnp.arange(chunk_tokens.shape[1], dtype=jnp.int32), chunk_tokens.shape
            )
            buffers, sums = list(buffers), [list(row) for row in sums]

            def attend(layer, q, k, v):
                if buffers[layer] is None:
                    keys, values = k, v
                else:
                    keys, values = (
                        jax.lax.dynamic_update_slice_in_dim(buffer, x, start, 1)
                        for buffer, x in zip(buffers[layer], (k, v), strict=True)
                    )
                buffers[layer] = (keys, values)
                for plan, row, observes in zip(plans, sums, observing, strict=True):
                    if observes:
                        share = plan.method.prefill_observe(layer, q, keys, start, ctx)
                        row[layer] = share if row[layer] is None else row[layer] + share
                return attention(q, keys, values, causal=True, key_valid=valid, query_start=start)  # mask per block

            return model.forward(chunk_tokens, chunk_positions, attend), buffers, sums

        layers = cfg.num_layers
        n = prefill_chunks(t, base.prefill_chunk)
        if n == 1:
            hidden, buffers, sums = chunk_pass(0, tokens, [None] * layers, [[None] * layers for _ in plans])
            last = hidden[jnp.arange(b), lengths - 1]  # only the last prompt token needs logits
        else:
            c = t // n

            def run_chunk(i, carry):
                buffers, sums, last = carry
                start = i * c
                hidden, buffers, sums = chunk_pass(
                    start, jax.lax.dynamic_slice_in_dim(tokens, start, c, 1), buffers, sums
                )
                row = lengths - 1 - start  # i32[B]: the last prompt token's row in this chunk
                here = (row >= 0) & (row < c)
                last = jnp.where(here[:, None], hidden[jnp.arange(b), jnp.clip(row, 0, c - 1)], last)
                return buffers, sums, last

            empty = constrain(
                jnp.zeros((b, t, cfg.num_kv_heads, cfg.head_dim), base.dtype), "batch", None, "kv_heads", None
            )
            zero = jnp.zeros((b, cfg.num_kv_heads, t), jnp.float32)
            carry = (
                [(empty, empty)] * layers,
                [[zero if observes else None] * layers for observes in observing],
                jnp.zeros((b, cfg.hidden_size), base.dtype),
            )
            buffers, sums, last = jax.lax.fori_loop(0, n, run_chunk, carry)
        kv.extend(buffers)
        logits = model.logits(last[:, None])[:, 0]
        filled = [
            plan.fill(kv, plan.method.prefill_scores(seen, ctx), ctx, caps)
            for plan, seen, caps in zip(plans, sums, capacities, strict=True)
        ]
        return logits, filled


# One compiled function per static signature (plan, capacities / sampling); the caches are donated to each step.
_prefill = jax.jit(prefill_plans, static_argnums=(0, 6))
_decode = jax.jit(StepPlan.decode, static_argnums=(0, 10, 11), donate_argnums=(2,))
_decode_logits = jax.jit(StepPlan.decode_logits, static_argnums=(0,), donate_argnums=(2,))


_empty_caches = jax.jit(StepPlan.empty_caches, static_argnums=(0, 1, 2))


@functools.partial(jax.jit, donate_argnums=(0,))
def _insert_rows(caches: list[GroupCache], new: list[GroupCache], rows: jax.Array) -> list[GroupCache]:
    """Every group cache's rows `rows` (i32[b], past the batch: skipped) replaced by `new`'s b rows."""
    return [cache.insert_rows(fresh, rows) for cache, fresh in zip(caches, new, strict=True)]


@dataclasses.dataclass(frozen=True)
class LoweredSteps:
    """The engine's jitted prefill and decode step lowered for one `BatchShape`, with the arguments generate passes.

    For XLA's view of them: `prefill.compile().memory_analysis()`, `decode.compile().as_text()`. Compiling a shape
    that `generate` already ran reuses its executable (and the other way round).
    """

    prefill: jax.stages.Lowered
    decode: jax.stages.Lowered


def _abstract(x) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(x.shape, x.dtype)


def _abstract_placed(x: jax.Array) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)


class Engine:
    """Batched prefill + jitted decode over a ragged, budget-sized KV cache.

    `method` decides what the cache keeps (Full KV by default); `num_groups` consecutive layer groups
    each own a slot pool; `use_kernel` switches decode attention from the XLA path to the Pallas kernel.
    `mesh`: a (`data`, `model`) mesh of this process's devices (`make_mesh`); the model's parameters move onto it
    (in place, so engines over one model share them). None: one device, as without sharding.
    Weights, activations and cache take the model's dtype (`load_model(..., dtype=)`).
    `prefill_chunk`: prompts longer than this many positions are prefilled in equal chunks of at most this many.
    """

    def __init__(
        self,
        model: Qwen3,
        *,
        method: KVMethod | None = None,
        budget: float = 1.0,
        num_groups: int = 4,
        use_kernel: bool = False,
        stop_token_ids: Sequence[int] = (),
        length_buckets: Sequence[int] = DEFAULT_LENGTH_BUCKETS,
        max_context: int | None = None,
        mesh: Mesh | None = None,
        prefill_chunk: int = PREFILL_CHUNK,
    ):
        if not 0.0 < budget <= 1.0:
            raise ValueError(f"budget={budget} must be in (0, 1]")
        if prefill_chunk < 1:
            raise ValueError(f"prefill_chunk={prefill_chunk} must be >= 1")
        self.mesh = mesh
        self.data_size = 1
        if mesh is not None:
            shard_model(model, check_mesh(mesh))
            self.data_size = mesh.shape[DATA]
        self.cfg = cfg = model.config
        graphdef, self.params = nnx.split(model)
        self.method = method = method or FullKV()
        self.budget = budget
        self.stop_token_ids = frozenset(int(t) for t in stop_token_ids)
        self.length_buckets = tuple(sorted(length_buckets))
        self.max_context = max_context
        fractions = np.asarray(method.layer_fractions(cfg.num_layers, budget), np.float64)
        if fractions.shape != (cfg.num_layers,) or not ((fractions > 0) & (fractions <= 1)).all():
            raise ValueError(f"method {method.name!r} gave layer fractions outside (0, 1]: {fractions}")
        self.plan = StepPlan(
            graphdef=graphdef,
            cfg=cfg,
            method=method,
            budget=float(budget),
            groups=layer_groups(cfg.num_layers, min(num_groups, cfg.num_layers)),
            fractions=tuple(float(f) for f in fractions),
            use_kernel=use_kernel,
            dtype=model.embed.embedding.dtype,
            mesh=mesh,
            prefill_chunk=prefill_chunk,
        )

    @property
    def fractions(self) -> tuple[float, ...]:
        return self.plan.fractions

    def capacities(self, prompt_bucket: int, new_tokens: int) -> tuple[int, ...]:
        return self.plan.capacities(prompt_bucket, new_tokens)

    def batch_shape(self, prompt_lengths: Sequence[int], max_new_tokens: int) -> BatchShape:
        """The shapes `generate` compiles for prompts of these lengths and up to `max_new_tokens` new tokens each.

        Raises ValueError for an empty batch or prompt, a prompt past the largest length bucket, or one that with
        `max_new_tokens` exceeds the context limit.
        """
        lengths = [int(n) for n in prompt_lengths]
        if not lengths or min(lengths) < 1:
            raise ValueError("every prompt needs at least one token")
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens={max_new_tokens} must be >= 1")
        longest = max(lengths)
        if self.max_context is not None and longest + max_new_tokens > self.max_context:
            raise ValueError(
                f"prompt of {longest} tokens + max_new_tokens={max_new_tokens} exceeds the context "
                f"limit {self.max_context}"
            )
        prompt_bucket = length_bucket(longest, self.length_buckets)
        new_bucket = new_token_bucket(max_new_tokens)
        return BatchShape(
            rows=len(lengths),
            padded_rows=padded_batch(len(lengths), self.data_size),
            prompt_bucket=prompt_bucket,
            new_token_bucket=new_bucket,
            capacities=self.capacities(prompt_bucket, new_bucket),
        )

    def cache_bytes(self, shape: BatchShape) -> int:
        """Bytes of the KV caches a call of this shape allocates, from their shapes alone (nothing is allocated)."""
        caches = jax.eval_shape(lambda: self.plan.empty_caches(shape.padded_rows, shape.capacities))
        return sum(c.nbytes() for c in caches)

    def rows(self, array: np.ndarray | jax.Array) -> jax.Array | np.ndarray:
        """A per-row input (axis 0: the padded batch) placed as the steps take it: split over `data` on a mesh."""
        if self.mesh is None:
            return array
        return jax.device_put(array, NamedSharding(self.mesh, P(DATA)))

    def _abstract_rows(self, shape: tuple[int, ...]) -> jax.ShapeDtypeStruct:
        sharding = None if self.mesh is None else NamedSharding(self.mesh, P(DATA))
        return jax.ShapeDtypeStruct(shape, jnp.int32, sharding=sharding)

    def lower_prefill(self, shape: BatchShape, others: Sequence[Engine] = ()) -> jax.stages.Lowered:
        """Lower the jitted prefill for `shape`, with the abstract arguments `prefill` gives it; with `others`
        (engines over the same model), the one prefill `generate_shared` runs for all of them."""
        b, t = shape.padded_rows, shape.prompt_bucket
        engines = (self, *others)
        grid = self._abstract_rows((b, t))  # padded prompt tokens, roles and tools: i32[B, T]
        theirs = (e.capacities(shape.prompt_bucket, shape.new_token_bucket) for e in others)
        capacities = (shape.capacities, *theirs)  # the shape's own (a batcher sizes its cache itself), then the others'
        return _prefill.lower(
            tuple(e.plan for e in engines),
            self._abstract_params(),
            grid,
            self._abstract_rows((b,)),
            grid,
            grid,
            capacities,
        )

    def _abstract_params(self):
        return jax.tree.map(_abstract if self.mesh is None else _abstract_placed, self.params)

    def lower(self, shape: BatchShape, sampling: SamplingConfig = SamplingConfig()) -> LoweredSteps:
        """Lower the jitted prefill and decode step for `shape`, with the abstract arguments `generate` gives them."""
        return LoweredSteps(prefill=self.lower_prefill(shape), decode=self.lower_decode(shape, sampling))

    def lower_decode(self, shape: BatchShape, sampling: SamplingConfig = SamplingConfig()) -> jax.stages.Lowered:
        """Lower the jitted decode step for `shape`, with the abstract arguments `generate` gives it."""
        b = shape.padded_rows
        params = self._abstract_params()
        rows = self._abstract_rows((b,))  # token ids, positions, roles, lengths, called tools: i32[B]
        caches = jax.eval_shape(lambda: self.plan.empty_caches(b, shape.capacities))
        if self.mesh is not None:  # the layout the prefill hands them over in
            caches = [
                jax.tree.map(
                    lambda x, spec: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(self.mesh, spec)),
                    cache,
                    cache.partition_specs(),
                )
                for cache in caches
            ]
        bits = self._abstract_rows((b, mask_words(self.cfg.vocab_size)))
        key = jax.eval_shape(lambda: jax.random.key(sampling.seed))
        return _decode.lower(
            self.plan, params, caches, rows, rows, rows, rows, rows, bits, key, sampling.temperature, sampling.top_p
        )

    def precompile(self, shape: BatchShape, sampling: SamplingConfig = SamplingConfig()) -> None:
        """Compile what `generate` runs for a batch of `shape` before it is needed: the prefill and the decode step
        ahead of time (nothing executes, so a long prompt costs only its compile), the sampler by running it once."""
        steps = self.lower(shape, sampling)
        steps.prefill.compile()
        steps.decode.compile()
        self.warm_sampler(shape.padded_rows, sampling)

    def warm_sampler(self, rows: int, sampling: SamplingConfig = SamplingConfig()) -> None:
        """Compile the masked sampler for `rows` rows and the key split before each draw, by running them once."""
        logits = self.rows(jnp.zeros((rows, self.cfg.vocab_size), jnp.float32))  # as the steps return them
        _, key = jax.random.split(jax.random.key(sampling.seed))
        self.sample(logits, np.full((rows, mask_words(self.cfg.vocab_size)), -1, np.int32), key, sampling)

    def prefill(
        self,
        tokens: np.ndarray,
        lengths: np.ndarray,
        roles: np.ndarray,
        capacities: tuple[int, ...],
        tools: np.ndarray | None = None,
    ):
        """Jitted prefill of right-padded prompts -> (last-token logits, caches, kept entries per sequence).

        `tools` i32[B, T]: the offered tool each prompt token describes (`BatchShape.pad_tools`; None: none)."""
        tools = np.full(np.shape(tokens), NO_TOOL, np.int32) if tools is None else tools
        placed = (self.rows(x) for x in (tokens, lengths, roles, tools))
        logits, ((caches, kept),) = _prefill((self.plan,), self.params, *placed, (capacities,))
        return logits, caches, kept

    def decode_step(
        self,
        caches: list[GroupCache],
        tokens: np.ndarray,
        positions: np.ndarray,
        roles: np.ndarray,
        prompt_lengths: np.ndarray,
        mask_bits: jax.Array | np.ndarray,
        key: jax.Array,
        sampling: SamplingConfig = SamplingConfig(),
        called: np.ndarray | None = None,
    ):
        """One jitted decode step over the padded rows; `caches` are donated (use the returned ones).

        tokens i32[B] at positions i32[B] with roles i32[B], prompt_lengths i32[B], packed token mask
        i32[B, ceil(V/32)], the tool each row's current call calls i32[B] (None: none known) -> (next tokens i32[B],
        caches, kept entries per row i32[B], overflow bool[]).
        """
        called = _no_call(tokens) if called is None else called
        return _decode(
            self.plan,
            self.params,
            caches,
            *(self.rows(x) for x in (tokens, positions, roles, prompt_lengths, called, mask_bits)),
            key,
            sampling.temperature,
            sampling.top_p,
        )

    def decode_logits(
        self,
        caches: list[GroupCache],
        tokens: np.ndarray,
        positions: np.ndarray,
        roles: np.ndarray,
        prompt_lengths: np.ndarray,
        called: np.ndarray | None = None,
    ):
        """`decode_step` up to the logits (dispatched asynchronously: the host may build the token mask meanwhile)
        -> (logits f32[B, V], caches, kept i32[B], overflow bool[]); `caches` are donated."""
        called = _no_call(tokens) if called is None else called
        placed = (self.rows(x) for x in (tokens, positions, roles, prompt_lengths, called))
        return _decode_logits(self.plan, self.params, caches, *placed)

    def sample(
        self, logits: jax.Array, mask_bits: jax.Array | np.ndarray, key: jax.Array, sampling: SamplingConfig
    ) -> jax.Array:
        """Masked sampling of f32[B, V] logits under the packed mask i32[B, ceil(V/32)] -> i32[B]."""
        return _sample_masked(logits, self.rows(mask_bits), key, sampling.temperature, sampling.top_p)

    def insert_rows(self, caches: list[GroupCache], new: list[GroupCache], rows: np.ndarray) -> list[GroupCache]:
        """Rows `rows` (i32[b]; an index past the batch is skipped) of `caches` (donated) replaced by the b rows of
        `new` (a prefill's caches at the same capacities): how a request enters a running batch, with no recompile
        for the row it lands in."""
        with mesh_context(self.mesh):
            return _insert_rows(caches, new, jnp.asarray(rows, jnp.int32))

    def empty_caches(self, rows: int, capacities: tuple[int, ...]) -> list[GroupCache]:
        """Empty caches of `rows` rows (a multiple of the mesh's data size) at `capacities`, laid out as the steps
        take them."""
        with mesh_context(self.mesh):
            return _empty_caches(self.plan, rows, capacities)

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        sampling: SamplingConfig = SamplingConfig(),
        *,
        prompt_roles: Sequence[Sequence[int]] | None = None,
        prompt_tools: Sequence[Sequence[int] | None] | None = None,
        constraint: TokenConstraint | None = None,
        on_step: StepCallback | None = None,
    ) -> list[Generation]:
        """Generate for a batch of token-id prompts; returns one Generation per prompt, in order.

        `prompt_tools`: per prompt token, the index of the constraint's tool it describes (NO_TOOL: none).
        `on_step`, if given, is called with the `StepTiming` of the prefill and then of every decode step.
        """
        return generate_shared(
            [self],
            prompts,
            sampling,
            prompt_roles=prompt_roles,
            prompt_tools=prompt_tools,
            constraints=[constraint],
            on_steps=[on_step],
        )[0]

    def _decode_loop(
        self,
        shape: BatchShape,
        logits: jax.Array,
        caches: list[GroupCache],
        kept: jax.Array,
        lengths: np.ndarray,  # i32[B_padded], 1 for padding rows
        sampling: SamplingConfig,
        constraint: TokenConstraint | None,
        prefill_s: float,
        on_step: StepCallback | None,
    ) -> list[Generation]:
        """The host loop after prefill: every row admitted at once, one jitted decode step per later token."""
        if on_step is not None:
            on_step(StepTiming(0, prefill_s, prefill_s))
        n, cfg = shape.rows, self.cfg
        rows = DecodeRows(
            self, shape.padded_rows, cfg.vocab_size, cfg.num_layers * cfg.num_kv_heads, sampling, shape.capacities,
            on_step=on_step,
        )  # fmt: skip
        origin = time.perf_counter() - prefill_s
        rows.admit(range(n), range(n), lengths[:n], [sampling.max_new_tokens] * n, logits, np.asarray(kept),
                   constraint, origin)  # fmt: skip
        generations: dict[int, Generation] = dict(rows.release())
        while rows.live:
            caches = rows.step(caches)
            generations.update(rows.release())
        return [generations[i] for i in range(n)]


def generate_shared(
    engines: Sequence[Engine],
    prompts: Sequence[Sequence[int]],
    sampling: SamplingConfig = SamplingConfig(),
    *,
    prompt_roles: Sequence[Sequence[int]] | None = None,
    prompt_tools: Sequence[Sequence[int] | None] | None = None,
    constraints: Sequence[TokenConstraint | None] | None = None,
    on_steps: Sequence[StepCallback | None] | None = None,
    plans_per_prefill: int = PLANS_PER_PREFILL,
) -> list[list[Generation]]:
    """Generate the same prompts with several engines over one model: one shared prefill, then each decodes.

    Returns, per engine, one Generation per prompt. Each engine needs its own constraint (grammar state is per
    sequence); `on_steps` gives each engine its own step-timing callback (see `Engine.generate`). Engines run in
    groups of at most `plans_per_prefill` (`prefill_groups`): one prefill per group, then the group's decodes, so
    only one group's caches are alive at a time. Every engine's TTFT, and the prefill timing each callback gets, is
    its group's whole shared prefill.
    """
    first = engines[0]
    groups = prefill_groups(range(len(engines)), plans_per_prefill)  # a bad size is refused before any work
    constraints = list(constraints) if constraints is not None else [None] * len(engines)
    on_steps = list(on_steps) if on_steps is not None else [None] * len(engines)
    for given, what in ((constraints, "constraints"), (on_steps, "step callbacks")):
        if len(given) != len(engines):
            raise ValueError(f"{len(given)} {what} for {len(engines)} engines: give one per engine")
    shared_leaves = jax.tree.leaves(first.params)
    for engine in engines[1:]:
        same = engine.plan.graphdef == first.plan.graphdef and all(
            a is b for a, b in zip(jax.tree.leaves(engine.params), shared_leaves, strict=True)
        )
        settings = (engine.length_buckets, engine.max_context, engine.mesh, engine.plan.prefill_chunk)
        if not same or settings != (first.length_buckets, first.max_context, first.mesh, first.plan.prefill_chunk):
            raise ValueError(
                "generate_shared needs engines over the same model, length buckets, context limit, mesh and "
                "prefill chunk"
            )
    for engine, constraint in zip(engines, constraints, strict=True):
        if engine.method.needs_roles and prompt_roles is None and constraint is None:
            raise ValueError(
                f"method {engine.method.name!r} decides by token roles, and this batch has none: give prompt_roles "
                "or a constraint (a grammar, or FreeTextConstraint), e.g. through pask_jax.LLM"
            )
    lengths = [len(p) for p in prompts]
    shapes = [engine.batch_shape(lengths, sampling.max_new_tokens) for engine in engines]
    vocab = first.cfg.vocab_size
    if any(t < 0 or t >= vocab for p in prompts for t in p):
        raise ValueError(f"prompt token ids must be in [0, {vocab})")
    tokens, all_lengths, roles = shapes[0].pad(prompts, prompt_roles)
    tools = shapes[0].pad_tools(prompt_tools)

    placed = [first.rows(x) for x in (tokens, all_lengths, roles, tools)]
    outputs: list[list[Generation]] = []
    for group in groups:
        start = time.perf_counter()
        plans = tuple(engines[i].plan for i in group)
        logits, filled = _prefill(plans, first.params, *placed, tuple(shapes[i].capacities for i in group))
        logits.block_until_ready()
        prefill_s = time.perf_counter() - start
        outputs.extend(
            engines[i]._decode_loop(
                shapes[i], logits, caches, kept, all_lengths, sampling, constraints[i], prefill_s, on_steps[i]
            )
            for i, (caches, kept) in zip(group, filled, strict=True)
        )
    return outputs


def prefill_groups(items: Sequence, size: int = PLANS_PER_PREFILL) -> list[tuple]:
    """`items` (engines, or their indices) in consecutive groups of at most `size`, as near equal as they split:
    the groups a sweep's shared prefills compile (27 plans in groups of 9 -> 9, 9, 9; 10 -> 5, 5)."""
    if size < 1:
        raise ValueError(f"plans_per_prefill must be at least 1, got {size}")
    items = tuple(items)
    count = -(-len(items) // size)
    bounds = [round(k * len(items) / count) for k in range(count + 1)] if count else [0]
    return [items[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]


def _no_call(tokens: np.ndarray) -> np.ndarray:
    """i32[B]: no row's called tool known."""
    return np.full(np.shape(tokens), NO_TOOL, np.int32)
