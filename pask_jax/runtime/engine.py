"""The engine: batched prefill + jitted decode over a ragged, budget-sized KV cache.

Data flow per request batch:
  prompts -> right-padded to a length bucket (`runtime.shapes`) -> prefill (`runtime.prefill`: full causal attention
  over the prompt; the method picks which prompt entries each layer's cache keeps) -> ragged KV cache -> decode steps
  (`runtime.step`) fed by the host loop (`runtime.rows`).
Each decode step runs the model on one token per sequence, writes its K/V into the cache, attends to the live slots,
applies the host-supplied token mask (packed bits, as grammar engines write them) and samples. The host loop only
moves B token ids (and B kept-entry counts) per step.

On a device mesh (`Engine(..., mesh=make_mesh(data, model))`, `pask_jax.models.sharding`): parameters lie as the
sharding table says, batch rows and every per-sequence cache array are split over `data` (batches are padded to a
multiple of its size), KV heads over `model` where they divide it; scores, top-k selection and eviction are per
(sequence, KV head), so they run where their rows lie and give the tokens one device gives.

For measuring (the benchmarks): `Engine.batch_shape` is the shape a generate call compiles for, `Engine.cache_bytes`
the bytes its caches take, `Engine.lower` its prefill and decode step lowered for XLA's memory analysis or HLO, and
`generate(..., on_step=)` reports each step's wall time.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from pask_jax.cache import GroupCache
from pask_jax.layers import layer_groups
from pask_jax.methods import FullKV, KVMethod
from pask_jax.models.decoder import Decoder
from pask_jax.models.sharding import DATA, check_mesh, mesh_context, shard_model
from pask_jax.runtime.prefill import prefill_jit
from pask_jax.runtime.rows import DecodeRows, Generation, StepCallback, StepTiming
from pask_jax.runtime.sampling import SamplingConfig, mask_words, sample_masked
from pask_jax.runtime.shapes import (
    DEFAULT_LENGTH_BUCKETS,
    PREFILL_CHUNK,
    BatchShape,
    Capacity,
    length_bucket,
    new_token_bucket,
    padded_batch,
)
from pask_jax.runtime.step import (
    MethodInputs,
    StepInput,
    StepPlan,
    decode_jit,
    decode_logits_jit,
    empty_caches_jit,
    insert_rows_jit,
)
from pask_jax.storage import Storage, full_entry_bytes
from pask_jax.structure.constraint import TokenConstraint
from pask_jax.structure.roles import NO_TOOL


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
    `storage`: how the cache stores K/V (`pask_jax.storage.Storage`: bf16 by default, or int8 / fp8 / int4 per
    token); a method that chooses its own (KIVI's block pool) takes no other. The budget counts bytes
    (`runtime.budget`). Positions are stored as i16 (32,768 positions) unless `max_context` asks for more (i32).
    """

    def __init__(
        self,
        model: Decoder,
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
        storage: Storage | None = None,
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
        own = method.storage(budget, cfg.head_dim)
        if own is not None and storage is not None and storage != own:
            raise ValueError(f"method {method.name!r} chooses its own storage ({own.name}); it takes no other")
        self.storage = storage or own or Storage()
        if max_context is not None and max_context > self.storage.max_positions:  # i16 positions would not hold it
            self.storage = dataclasses.replace(self.storage, positions=4)
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
            storage=self.storage,
        )

    @property
    def fractions(self) -> tuple[float, ...]:
        return self.plan.fractions

    def capacities(self, prompt_bucket: int, new_tokens: int) -> tuple[Capacity, ...]:
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
        if longest + max_new_tokens > self.storage.max_positions:
            raise ValueError(
                f"prompt of {longest} tokens + max_new_tokens={max_new_tokens} exceeds the "
                f"{self.storage.max_positions} positions the cache stores; give the engine a larger max_context"
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

    def rows(self, arrays):
        """Per-row inputs (an array or a pytree of them, such as a `StepInput`; axis 0: the padded batch) placed as
        the steps take them: split over `data` on a mesh."""
        if self.mesh is None:
            return arrays
        return jax.device_put(arrays, NamedSharding(self.mesh, P(DATA)))

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
        return prefill_jit.lower(
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
        rows = self._abstract_rows((b,))
        step = StepInput(rows, rows, rows, rows, MethodInputs(rows))
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
        return decode_jit.lower(self.plan, params, caches, step, bits, key, sampling.temperature, sampling.top_p)

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
        capacities: tuple[Capacity, ...],
        tools: np.ndarray | None = None,
    ):
        """Jitted prefill of right-padded prompts -> (last-token logits, caches, `Kept`: entries and bytes per row).

        `tools` i32[B, T]: the offered tool each prompt token describes (`BatchShape.pad_tools`; None: none)."""
        tools = np.full(np.shape(tokens), NO_TOOL, np.int32) if tools is None else tools
        placed = (self.rows(x) for x in (tokens, lengths, roles, tools))
        logits, ((caches, kept),) = prefill_jit((self.plan,), self.params, *placed, (capacities,))
        return logits, caches, kept

    def decode_step(
        self,
        caches: list[GroupCache],
        step: StepInput,
        mask_bits: jax.Array | np.ndarray,
        key: jax.Array,
        sampling: SamplingConfig = SamplingConfig(),
    ):
        """One jitted decode step over the padded rows; `caches` are donated (use the returned ones).

        `step` (host arrays), the packed token mask i32[B, ceil(V/32)] -> (next tokens i32[B], caches, `Kept`
        (entries and bytes per row), overflow bool[]).
        """
        placed = self.rows(step)
        return decode_jit(
            self.plan, self.params, caches, placed, self.rows(mask_bits), key, sampling.temperature, sampling.top_p
        )

    def decode_logits(self, caches: list[GroupCache], step: StepInput):
        """`decode_step` up to the logits (dispatched asynchronously: the host may build the token mask meanwhile)
        -> (logits f32[B, V], caches, `Kept`, overflow bool[]); `caches` are donated."""
        return decode_logits_jit(self.plan, self.params, caches, self.rows(step))

    def sample(
        self, logits: jax.Array, mask_bits: jax.Array | np.ndarray, key: jax.Array, sampling: SamplingConfig
    ) -> jax.Array:
        """Masked sampling of f32[B, V] logits under the packed mask i32[B, ceil(V/32)] -> i32[B]."""
        return sample_masked(logits, self.rows(mask_bits), key, sampling.temperature, sampling.top_p)

    def insert_rows(self, caches: list[GroupCache], new: list[GroupCache], rows: np.ndarray) -> list[GroupCache]:
        """Rows `rows` (i32[b]; an index past the batch is skipped) of `caches` (donated) replaced by the b rows of
        `new` (a prefill's caches at the same capacities): how a request enters a running batch, with no recompile
        for the row it lands in."""
        with mesh_context(self.mesh):
            return insert_rows_jit(caches, new, jnp.asarray(rows, jnp.int32))

    def empty_caches(self, rows: int, capacities: tuple[Capacity, ...]) -> list[GroupCache]:
        """Empty caches of `rows` rows (a multiple of the mesh's data size) at `capacities`, laid out as the steps
        take them."""
        with mesh_context(self.mesh):
            return empty_caches_jit(self.plan, rows, capacities)

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
        self.check_batch(prompts, prompt_roles, constraint)
        shape = self.batch_shape([len(p) for p in prompts], sampling.max_new_tokens)
        tokens, lengths, roles = shape.pad(prompts, prompt_roles)
        start = time.perf_counter()
        logits, caches, kept = self.prefill(tokens, lengths, roles, shape.capacities, shape.pad_tools(prompt_tools))
        logits.block_until_ready()
        prefill_s = time.perf_counter() - start
        return self.decode_loop(shape, logits, caches, kept, lengths, sampling, constraint, prefill_s, on_step)

    def check_batch(
        self,
        prompts: Sequence[Sequence[int]],
        prompt_roles: Sequence[Sequence[int]] | None,
        constraint: TokenConstraint | None,
    ) -> None:
        """Refuse, before any work, a batch this engine cannot run: token ids outside the vocabulary, or no roles
        for a method that decides by them."""
        if self.method.needs_roles and prompt_roles is None and constraint is None:
            raise ValueError(
                f"method {self.method.name!r} decides by token roles, and this batch has none: give prompt_roles "
                "or a constraint (a grammar, or FreeTextConstraint), e.g. through pask_jax.LLM"
            )
        vocab = self.cfg.vocab_size
        if any(t < 0 or t >= vocab for p in prompts for t in p):
            raise ValueError(f"prompt token ids must be in [0, {vocab})")

    def decode_loop(
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
            self, shape.padded_rows, cfg.vocab_size, cfg.num_layers * cfg.num_kv_heads, full_entry_bytes(cfg.head_dim),
            sampling, shape.capacities, on_step=on_step,
        )  # fmt: skip
        origin = time.perf_counter() - prefill_s
        rows.admit(range(n), range(n), lengths[:n], [sampling.max_new_tokens] * n, logits, kept,
                   constraint, origin)  # fmt: skip
        generations: dict[int, Generation] = dict(rows.release())
        while rows.live:
            caches = rows.step(caches)
            generations.update(rows.release())
        return [generations[i] for i in range(n)]
