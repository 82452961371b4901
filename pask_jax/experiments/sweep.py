"""Method sweeps that share a prefill: several engines over one model on the same prompts.

Prefill attention is uncompressed for every method, so one forward serves them all and each method fills its own
cache from it (`runtime.prefill.prefill_plans` over several plans); then each engine decodes its own rows. The BFCL
and NIAH harnesses and the compile benchmark run their method x budget grids through `generate_shared`.
Their PASK policies by label come from `--policy` through the one resolver (`resolve_policies`).
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence

import jax

from pask_jax.arguments import policy_spec
from pask_jax.policy import ModelFingerprint, PersistencePolicy, resolve_policy
from pask_jax.runtime.engine import Engine
from pask_jax.runtime.prefill import prefill_jit
from pask_jax.runtime.rows import Generation, StepCallback
from pask_jax.runtime.sampling import SamplingConfig
from pask_jax.structure.constraint import TokenConstraint

# Plans one shared prefill compiles together: each adds its scoring and fill to the executable, and XLA:CPU ran out of
# memory compiling 27 at a 1024-position bucket, so a larger sweep runs one forward per group of this many.
PLANS_PER_PREFILL = 9


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
        engine.check_batch(prompts, prompt_roles, constraint)
    lengths = [len(p) for p in prompts]
    shapes = [engine.batch_shape(lengths, sampling.max_new_tokens) for engine in engines]
    tokens, all_lengths, roles = shapes[0].pad(prompts, prompt_roles)
    tools = shapes[0].pad_tools(prompt_tools)

    placed = [first.rows(x) for x in (tokens, all_lengths, roles, tools)]
    outputs: list[list[Generation]] = []
    for group in groups:
        start = time.perf_counter()
        plans = tuple(engines[i].plan for i in group)
        logits, filled = prefill_jit(plans, first.params, *placed, tuple(shapes[i].capacities for i in group))
        logits.block_until_ready()
        prefill_s = time.perf_counter() - start
        outputs.extend(
            engines[i].decode_loop(
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


def resolve_policies(values: Mapping[str, str], fingerprint: ModelFingerprint) -> dict[str, PersistencePolicy]:
    """A sweep's `--policy` values by label (`arguments.labelled_policies`) -> its PASK policies by label, each
    resolved as `pask-jax run` and `LLM` resolve one (`policy.resolve_policy`: auto, the shipped policy that fits the
    model; a directory, refused if it fits another; none, no policy: PASK uncalibrated, so no entry)."""
    resolved = {label: resolve_policy(policy_spec(value), fingerprint) for label, value in values.items()}
    return {label: policy for label, policy in resolved.items() if policy is not None}
