"""Prefill: one causal forward over right-padded prompts (in equal chunks when long), then each plan's method picks
the prompt entries its caches keep.

Prefill attention is uncompressed for every method, so plans over one model can share the forward: only the scoring
and the fill are per plan (what a method sweep, `pask_jax.experiments.sweep`, uses; an `Engine` passes its one plan).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from pask_jax.attention import attention, attention_probs
from pask_jax.methods.base import PrefillContext
from pask_jax.models.sharding import constrain, mesh_context
from pask_jax.runtime.shapes import Capacity, prefill_chunks
from pask_jax.runtime.step import StepPlan


def prefill_plans(
    plans: tuple[StepPlan, ...], params, tokens, lengths, roles, tools, capacities: tuple[tuple[Capacity, ...], ...]
):
    """A causal forward over the prompts, then every plan's method picks what its own caches keep.

    tokens i32[B, T], lengths i32[B], roles i32[B, T], tools i32[B, T] (the offered tool each token describes) ->
    last-token logits f32[B, V], per plan (caches, `Kept`: entries and bytes per row).
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


# One compiled prefill per (plans, capacities); the prompt arrays are its only traced arguments besides the weights.
prefill_jit = jax.jit(prefill_plans, static_argnums=(0, 6))
