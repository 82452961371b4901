"""Jitted calibration passes: one item's prompt is prefilled once, then its gold call is teacher-forced under many
bucket removals at once.

Layout of one item. The prompt (P tokens, padded to Pb) is prefilled with full causal attention; its per-layer K/V is
what a compressed cache would hold. The gold call g_0..g_{T-1} is scored as the engine would produce it: g_0 comes
from the prefill's last-position logits (full attention, as in the engine, so no variant changes it), and the *fed*
tokens g_0..g_{T-2} (padded to Tb) are teacher-forced as decode steps, each predicting the next gold token. Keys are
slots ``[prompt 0..Pb-1 | fed 0..Tb-1]`` (S = Pb + Tb), in position order; padding slots are never visible.

A variant (role r, layer group g, keep level lam) changes only the layers of group g, and only for the fed queries:
query t loses the role-r keys it would see except the ceil(lam * n_t) most recent of them, n_t being the role-r keys
visible to it (prompt and earlier fed tokens alike) -- an online cache that ranks a bucket by recency and keeps a
fraction lam of it. A query always sees itself. Role ``NO_ROLE`` removes nothing (the baseline; padding rows).

A *low* variant (role r, group g) removes nothing: the role-r keys and values its fed queries see (all but the
query's own) are read at the cache's LOW precision instead (`PassPlan.low`, KIVI-2 by default: keys per channel over
blocks of 32 slots in position order, values per token), as a cache holding the bucket in its block pool would give
them; the other keys stay exact. Attention then runs over the exact and the low keys side by side, each visible where
the variant says.

Axis letters: V variants, T fed queries (Tb), S keys (Pb + Tb), L layers, N query heads, K KV heads, H head dim,
D model width, W packed mask words, Voc vocabulary.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from flax import nnx

from pask_jax.attention import attention
from pask_jax.kernels.quantize import PRESETS, KVFormat, dequantize, quantize
from pask_jax.models.decoder import Decoder
from pask_jax.runtime.sampling import unpack_mask

NO_ROLE = -1  # a variant row that removes nothing


@dataclasses.dataclass(frozen=True)
class PassPlan:
    """Static part of the passes (hashable: one compile per plan and shape)."""

    graphdef: nnx.GraphDef
    groups: tuple[tuple[int, int], ...]  # layer ranges [start, stop) of the G layer groups
    low: tuple[KVFormat, KVFormat] = PRESETS["kivi2"]  # (key, value) formats of the LOW precision low variants read

    def group_of(self, layer: int) -> int:
        return next(g for g, (start, stop) in enumerate(self.groups) if start <= layer < stop)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class ItemArrays:
    """One calibration item, padded to its (Pb, Tb) bucket."""

    prompt: jax.Array  # i32[Pb]
    prompt_len: jax.Array  # i32[]   P
    fed: jax.Array  # i32[Tb]  g_0..g_{T-2}, the tokens run as decode steps
    fed_len: jax.Array  # i32[]   T - 1
    key_roles: jax.Array  # i32[S]  role of each key slot (prompt roles, then the fed tokens' roles)
    targets: jax.Array  # i32[Tb + 1] g_0..g_{T-1}: target 0 from the prefill, target t + 1 from fed query t
    allowed: jax.Array  # i32[Tb + 1, W] packed bits: tokens the grammar allows before each target
    consistent: jax.Array  # i32[Tb + 1, W] packed bits: tokens spelling a prefix of the gold text from each target


def _layout(item: ItemArrays) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    pb, tb = item.prompt.shape[0], item.fed.shape[0]
    fed_pos = item.prompt_len + jnp.arange(tb, dtype=jnp.int32)  # i32[T]
    key_pos = jnp.concatenate([jnp.arange(pb, dtype=jnp.int32), fed_pos])  # i32[S]
    key_valid = jnp.concatenate([jnp.arange(pb) < item.prompt_len, jnp.arange(tb) < item.fed_len])  # bool[S]
    visible = key_valid[None] & (key_pos[None] <= fed_pos[:, None])  # bool[T, S]
    return fed_pos, key_valid, visible, pb + jnp.arange(tb)  # query t's own slot


def removal_mask(item: ItemArrays, role: jax.Array, level: jax.Array) -> jax.Array:
    """role i32[V], level f32[V] -> bool[V, T, S]: fed query t of variant v loses key s (in the variant's group)."""
    _, key_valid, visible, self_slot = _layout(item)
    match = (item.key_roles[None] == role[:, None]) & key_valid[None]  # bool[V, S]
    cum = jnp.cumsum(match, axis=1, dtype=jnp.int32)  # i32[V, S]: role-r keys at or before each slot
    seen = cum[:, self_slot]  # i32[V, T]: n_t, role-r keys query t sees
    keep = jnp.ceil(level[:, None] * seen - 1e-3)  # f32[V, T]: ceil(lam * n_t), robust to float rounding
    rank = seen[:, :, None] - cum[:, None, :]  # i32[V, T, S]: 0 = the most recent role-r key
    not_self = jnp.arange(match.shape[1])[None] != self_slot[:, None]  # bool[T, S]
    return match[:, None] & visible[None] & not_self[None] & (rank >= keep[:, :, None])


def prefill(model: Decoder, item: ItemArrays) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Full causal forward over the prompt -> K f[L, Pb, K, H], V f[L, Pb, K, H], last-position logits f32[Voc]."""
    pb = item.prompt.shape[0]
    positions = jnp.arange(pb, dtype=jnp.int32)[None]  # i32[1, Pb]
    valid = positions < item.prompt_len  # bool[1, Pb]
    ks, vs = [], []

    def attend(layer, q, k, v):
        ks.append(k[0])
        vs.append(v[0])
        return attention(q, k, v, causal=True, key_valid=valid)

    hidden = model.forward(item.prompt[None], positions, attend)  # f[1, Pb, D]
    return jnp.stack(ks), jnp.stack(vs), model.logits(hidden[:, item.prompt_len - 1][:, None])[0, 0]


def low_precision(x: jax.Array, fmt: KVFormat, length: jax.Array) -> jax.Array:
    """x f[..., S, K, H] (S slots, the first `length` valid) as a cache storing it at `fmt` reads it back: quantized
    per KV head along the slots (a channel format over blocks of slots in order). Slots past `length` copy the last
    valid one first, so padding never widens a block's range."""
    s, h = x.shape[-3], x.shape[-1]
    if fmt.axis == "token":
        fmt = dataclasses.replace(fmt, group=min(fmt.group, h))
    padded = -(-s // fmt.group) * fmt.group if fmt.axis == "channel" else s
    index = jnp.minimum(jnp.arange(padded), jnp.maximum(length, 1) - 1)
    per_head = jnp.moveaxis(jnp.take(x, index, axis=-3), -2, -3).astype(jnp.float32)  # [..., K, S', H]
    restored = dequantize(quantize(per_head, fmt), fmt)[..., :s, :]
    return jnp.moveaxis(restored, -3, -2).astype(x.dtype)


def teacher_force(
    model: Decoder,
    plan: PassPlan,
    item: ItemArrays,
    prompt_k: jax.Array,  # f[L, Pb, K, H]
    prompt_v: jax.Array,  # f[L, Pb, K, H]
    role: jax.Array,  # i32[V]
    group: jax.Array,  # i32[V]
    level: jax.Array,  # f32[V]
    low: bool = False,  # the variants are low variants (their level 0 keys read at LOW precision, not removed)
) -> tuple[jax.Array, list[jax.Array]]:
    """Run the fed tokens for V variants -> logits f32[V, T, Voc], per-layer attention outputs [L] f[V, T, N, H]."""
    nv = role.shape[0]
    fed_pos, _, visible, _ = _layout(item)
    changed = removal_mask(item, role, level)  # bool[V, T, S]: removed, or read at LOW precision
    outs = []

    def attend(layer, q, k, v):  # q f[V, T, N, H], k / v f[V, T, K, H]
        def slots(prompt: jax.Array, fed: jax.Array) -> jax.Array:  # f[V, S, K, H]
            return jnp.concatenate([jnp.broadcast_to(prompt, (nv, *prompt.shape)), fed], axis=1)

        keys, values = slots(prompt_k[layer], k), slots(prompt_v[layer], v)
        in_group = (group == plan.group_of(layer))[:, None, None]  # bool[V, 1, 1]
        exact = visible[None] & ~(changed & in_group)
        if not low:
            out = attention(q, keys, values, exact)
        else:
            key_fmt, value_fmt = plan.low
            low_keys = slots(
                low_precision(prompt_k[layer], key_fmt, item.prompt_len), low_precision(k, key_fmt, item.fed_len)
            )
            low_values = slots(
                low_precision(prompt_v[layer], value_fmt, item.prompt_len), low_precision(v, value_fmt, item.fed_len)
            )
            both = jnp.concatenate([exact, changed & in_group], axis=2)  # bool[V, T, 2S]
            out = attention(q, jnp.concatenate([keys, low_keys], 1), jnp.concatenate([values, low_values], 1), both)
        outs.append(out)
        return out

    tokens = jnp.broadcast_to(item.fed, (nv, item.fed.shape[0]))
    hidden = model.forward(tokens, jnp.broadcast_to(fed_pos, tokens.shape), attend)
    return model.logits(hidden), outs


def _per_target(logits: jax.Array, targets: jax.Array, allowed: jax.Array, consistent: jax.Array):
    """logits f32[..., T, Voc], targets i32[T], packed bits allowed / consistent i32[T, W] -> bool / f32[..., T]:
    (off_text: the greedy constrained choice leaves the gold text, off_token: it is not the gold token, nll).

    Greedy constrained decoding takes the best token the grammar allows. It stays on the gold *text* when that token
    spells a prefix of the rest of the gold (``}}`` where the gold tokenisation has ``}}\n``), which is what matters
    for the call; off_token is the stricter token-exact test. Ties count as staying. (Max comparisons rather than
    argmax: XLA's CPU argmax over a 152k vocabulary is ~10x slower.)
    """
    vocab = logits.shape[-1]
    allowed, consistent = unpack_mask(allowed, vocab), unpack_mask(consistent, vocab)  # bool[T, Voc]
    gold = jnp.take_along_axis(logits, jnp.broadcast_to(targets[:, None], (*logits.shape[:-1], 1)), -1)[..., 0]
    best_on = jnp.where(allowed & consistent, logits, -jnp.inf).max(axis=-1)
    best_off = jnp.where(allowed & ~consistent, logits, -jnp.inf).max(axis=-1)
    top = logits.max(axis=-1)
    nll = jnp.log(jnp.exp(logits - top[..., None]).sum(-1)) + top - gold
    return best_off > best_on, jnp.maximum(best_on, best_off) > gold, nll


def target_stats(item: ItemArrays, first_logits: jax.Array, logits: jax.Array) -> dict[str, jax.Array]:
    """first_logits f32[Voc] (prefill, predicts g_0), logits f32[V, T, Voc] (fed queries, predict g_1..) -> per
    variant: ``error`` (greedy constrained decoding would leave the gold text before the end of turn: the call is
    wrong), ``error_strict`` (some gold token, end of turn included, is not the greedy constrained token), ``nll``
    (mean negative log-likelihood of the gold tokens). The end-of-turn decision is left out of ``error``: after a
    complete call the grammar also allows another one, and a model may prefer that even with the full cache."""
    first = _per_target(first_logits[None], item.targets[:1], item.allowed[:1], item.consistent[:1])  # each [1]
    rest = _per_target(logits, item.targets[1:], item.allowed[1:], item.consistent[1:])  # each [V, T]
    t = jnp.arange(logits.shape[1])
    content, valid = t < item.fed_len - 1, t < item.fed_len  # fed query t predicts g_{t+1}; g_{T-1} ends the turn
    return {
        "error": first[0][0] | (rest[0] & content).any(-1),
        "error_strict": first[1][0] | (rest[1] & valid).any(-1),
        "nll": (first[2][0] + jnp.where(valid, rest[2], 0.0).sum(-1)) / (item.fed_len + 1),
    }


def _sq_norms(outs: list[jax.Array], fed_valid: jax.Array, ref: jax.Array | None = None) -> jax.Array:
    """Per-layer squared L2 norm over the valid fed queries of outs (or of outs - ref): f32[V, L]."""
    w = fed_valid[None, :, None, None]
    sq = [
        jnp.sum(jnp.square(o.astype(jnp.float32) - (0.0 if ref is None else ref[i])) * w, axis=(1, 2, 3))
        for i, o in enumerate(outs)
    ]
    return jnp.stack(sq, axis=1)


@functools.partial(jax.jit, static_argnums=0)
def baseline_pass(plan: PassPlan, params: nnx.State, item: ItemArrays) -> dict[str, jax.Array]:
    """Prefill once, then the fed tokens with nothing removed: the prompt KV, the baseline's attention outputs and
    statistics every variant is compared with."""
    model = nnx.merge(plan.graphdef, params)
    prompt_k, prompt_v, first_logits = prefill(model, item)
    none = jnp.full((1,), NO_ROLE, jnp.int32)
    logits, outs = teacher_force(model, plan, item, prompt_k, prompt_v, none, none, jnp.zeros((1,), jnp.float32))
    fed_valid = jnp.arange(item.fed.shape[0]) < item.fed_len
    stats = {k: v[0] for k, v in target_stats(item, first_logits, logits).items()}
    return stats | {
        "prompt_k": prompt_k,
        "prompt_v": prompt_v,
        "first_logits": first_logits,
        "outs": jnp.stack([o[0] for o in outs]),  # f[L, T, N, H]
        "out_sq": _sq_norms(outs, fed_valid)[0],  # f32[L]
        "logits": logits[0],  # f32[T, Voc]
    }


@functools.partial(jax.jit, static_argnums=(0, 7))
def variant_pass(
    plan: PassPlan,
    params: nnx.State,
    item: ItemArrays,
    base: dict[str, jax.Array],  # baseline_pass's prompt_k, prompt_v, first_logits, outs
    role: jax.Array,  # i32[V]  (V sharded over the mesh's "data" axis)
    group: jax.Array,  # i32[V]
    level: jax.Array,  # f32[V]
    low: bool = False,  # low variants (`teacher_force`)
) -> dict[str, jax.Array]:
    """V variants in one pass -> error / error_strict bool[V], nll f32[V], diff_sq f32[V, L] (squared L2 change of
    each layer's attention outputs over the fed queries)."""
    model = nnx.merge(plan.graphdef, params)
    logits, outs = teacher_force(model, plan, item, base["prompt_k"], base["prompt_v"], role, group, level, low)
    fed_valid = jnp.arange(item.fed.shape[0]) < item.fed_len
    return target_stats(item, base["first_logits"], logits) | {"diff_sq": _sq_norms(outs, fed_valid, base["outs"])}


@jax.jit
def removed_entries(item: ItemArrays, role: jax.Array, level: jax.Array) -> jax.Array:
    """i32[M]: distinct keys that variant (role, level) hides from at least one fed query (0: it changes nothing)."""
    fed_valid = jnp.arange(item.fed.shape[0]) < item.fed_len
    return (removal_mask(item, role, level) & fed_valid[None, :, None]).any(axis=1).sum(-1)
