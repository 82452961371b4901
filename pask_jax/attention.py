"""Every attention computation of the package, in one place: what a layer's query attends to and how.

- Prefill (a prompt attending to itself, or a chunk of it to the keys before it): `attention`, blocked with an
  online softmax so a long prompt never materialises its T x S weights, and `reference_attention`, the one-block
  definition it and every cache path must match.
- The weights the methods and calibration read: `attention_probs` (grouped by KV head), `grouped_logits`.
- Decode over a layer of a group cache (`pask_jax.cache.GroupCache`): `decode_attention`, the XLA path (the slot and
  block pools dequantized where they are quantized, under the live mask, no gather) or, with `use_kernel`, the
  Pallas gather-attention kernel of the backend (`pask_jax.kernels.gather_attention`, per shard on a mesh);
  `decode_attention_probs` also returns the weights (H2O's accumulated attention), on the XLA path.

Axis letters: B batch, T query tokens, S key tokens, N query heads, K KV heads, G query heads per KV head (N = K * G),
H head dim, C slots of a pool.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

from pask_jax.cache import GroupCache
from pask_jax.kernels import (
    SoftmaxPartial,
    block_pool_attention,
    gather_attention,
    masked_softmax,
    merge_partials,
    per_row_shards,
    slot_pool_attention,
)


def attention_probs(
    q: jax.Array,  # f[B, T, N, H]
    k: jax.Array,  # f[B, S, K, H]
    mask: jax.Array,  # bool[B, T, S]: True where query t may attend key s
) -> jax.Array:  # f32[B, K, G, T, S]
    """Softmax attention weights, grouped by KV head; rows with no visible key are zeros, never NaN."""
    b, t, n, h = q.shape
    kv_heads = k.shape[2]
    qg = jnp.transpose(q.reshape(b, t, kv_heads, n // kv_heads, h), (0, 2, 3, 1, 4))  # [B, K, G, T, H]
    logits = grouped_logits(qg, jnp.transpose(k, (0, 2, 1, 3)))
    return masked_softmax(logits, mask[:, None, None])  # mask as [B, 1, 1, T, S]


def grouped_logits(
    q: jax.Array,  # f[B, K, G, T, H]
    k: jax.Array,  # f[B, K, S, H]
) -> jax.Array:  # f32[B, K, G, T, S]
    """Scaled attention logits, grouped by KV head.

    As [B, K, G*T, H] x [B, K, S, H]: one batched matmul per KV head, about 3x faster on XLA:CPU than contracting the
    query-major [B, T, K, G, H] against [B, S, K, H].
    """
    b, kv_heads, g, t, h = q.shape
    logits = jnp.einsum("BKMH,BKSH->BKMS", q.reshape(b, kv_heads, g * t, h), k, preferred_element_type=jnp.float32)
    return logits.reshape(b, kv_heads, g, t, -1) / math.sqrt(h)


QUERY_CHUNK = 512  # `attention`'s blocks of queries and keys ([B, N, chunk, chunk] weights at a time)


def reference_attention(
    q: jax.Array,  # f[B, T, N, H]
    k: jax.Array,  # f[B, S, K, H]
    v: jax.Array,  # f[B, S, K, H]
    mask: jax.Array,  # bool[B, T, S]
) -> jax.Array:  # f[B, T, N, H]
    """Grouped-query softmax attention in one block: the definition `attention` and every cache path must match."""
    b, t, n, h = q.shape
    out = jnp.einsum("BKGTS,BSKH->BTKGH", attention_probs(q, k, mask).astype(v.dtype), v)
    return out.reshape(b, t, n, h)


def _block_size(n: int) -> int:
    """Block length for n queries (or keys): n itself up to QUERY_CHUNK, else n split evenly into blocks of at most
    QUERY_CHUNK, rounded up to a multiple of 8 (so the padding stays under 8 per block)."""
    blocks = -(-n // QUERY_CHUNK)
    per_block = -(-n // blocks)
    return n if blocks == 1 else (per_block + 7) // 8 * 8


def _attention_block(
    q: jax.Array,  # f[B, K, G, c, H]
    k: jax.Array,  # f[B, K, s, H]
    v: jax.Array,  # f[B, K, s, H]
    mask: jax.Array,  # bool[B, c, s]
    row_max: jax.Array,  # f32[B, K, G, c]: the running max of the logits so far
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """One block of queries against one block of keys -> unnormalised output f32[B, K, G, c, H], its softmax
    denominator f32[B, K, G, c], the new running max (FlashAttention's online softmax)."""
    b, kv_heads, g, c, h = q.shape
    logits = jnp.where(mask[:, None, None], grouped_logits(q, k), -1e30)
    new_max = jnp.maximum(row_max, logits.max(axis=-1))
    weights = jnp.where(mask[:, None, None], jnp.exp(logits - new_max[..., None]), 0.0)  # a masked key adds 0
    out = jnp.einsum("BKMS,BKSH->BKMH", weights.reshape(b, kv_heads, g * c, -1).astype(v.dtype), v)
    return out.reshape(b, kv_heads, g, c, h).astype(jnp.float32), weights.sum(axis=-1), new_max


def attention(
    q: jax.Array,  # f[B, T, N, H]
    k: jax.Array,  # f[B, S, K, H]
    v: jax.Array,  # f[B, S, K, H]
    mask: jax.Array | None = None,  # bool[B, T, S]
    *,
    causal: bool = False,
    key_valid: jax.Array | None = None,  # bool[B, S], with mask None
    query_start: jax.Array | int = 0,  # i32[]: the position of query 0, with causal (a chunk of a longer prompt)
) -> jax.Array:  # f[B, T, N, H]
    """`reference_attention` in blocks of QUERY_CHUNK queries and keys with an online softmax, so a long prompt never
    materialises its T x S weights (rows with no visible key are zeros, as there).

    causal: the caller's mask is causal over a prompt attending to itself, query t being prompt position
    `query_start + t` (S >= query_start + T, mask[t, s] False for s > query_start + t), so the key blocks after each
    query block are skipped: about half the work of a long prompt.
    mask None (with causal and `key_valid`): the mask is query t sees key s <= query_start + t where key s is valid,
    built per block, so a long prompt never materialises its T x S mask either (1 GiB at 32k tokens).
    """
    b, t, n, h = q.shape
    s, kv_heads = k.shape[1], k.shape[2]
    if causal and s < t:
        raise ValueError(f"causal attention needs at least as many keys as queries, got {t} queries and {s} keys")
    if (mask is None) == (key_valid is None) or (mask is None and not causal):
        raise ValueError("attention takes a mask, or causal=True with key_valid")
    cq, ck = _block_size(t), _block_size(s)
    tp, sp = -(-t // cq) * cq, -(-s // ck) * ck  # padded to whole blocks (the padding is masked out)
    qt = jnp.pad(q.reshape(b, t, kv_heads, n // kv_heads, h), ((0, 0), (0, tp - t), (0, 0), (0, 0), (0, 0)))
    qt = jnp.transpose(qt, (0, 2, 3, 1, 4))  # [B, K, G, Tp, H]
    kt, vt = (jnp.transpose(jnp.pad(x, ((0, 0), (0, sp - s), (0, 0), (0, 0))), (0, 2, 1, 3)) for x in (k, v))
    if mask is not None:
        mask = jnp.pad(mask, ((0, 0), (0, tp - t), (0, sp - s)))  # bool[B, Tp, Sp]
    else:
        key_valid = jnp.pad(key_valid, ((0, 0), (0, sp - s)))  # bool[B, Sp]

    def block_mask(i: jax.Array, j: jax.Array) -> jax.Array:  # query block i x key block j -> bool[B, cq, ck]
        if mask is not None:
            rows = jax.lax.dynamic_slice_in_dim(mask, i * cq, cq, axis=1)
            return jax.lax.dynamic_slice_in_dim(rows, j * ck, ck, axis=2)
        rows, cols = query_start + i * cq + jnp.arange(cq), j * ck + jnp.arange(ck)
        return (rows[:, None] >= cols[None, :])[None] & jax.lax.dynamic_slice_in_dim(key_valid, j * ck, ck, 1)[:, None]

    if tp == cq and sp == ck:  # one block: no loops (short prompts, decode-sized queries)
        out, denom, _ = _attention_block(qt, kt, vt, block_mask(0, 0), jnp.full(qt.shape[:-1], -1e30, jnp.float32))
        blocks = (out / jnp.maximum(denom, 1e-30)[..., None])[None]  # [1, B, K, G, Tp, H]
    else:

        def query_block(i: jax.Array) -> jax.Array:  # -> f32[B, K, G, cq, H]
            q_block = jax.lax.dynamic_slice_in_dim(qt, i * cq, cq, axis=3)

            def key_block(j, carry):
                out, denom, row_max = carry
                k_block, v_block = (jax.lax.dynamic_slice_in_dim(x, j * ck, ck, axis=2) for x in (kt, vt))
                o, d, new_max = _attention_block(q_block, k_block, v_block, block_mask(i, j), row_max)
                rescale = jnp.exp(row_max - new_max)  # the earlier blocks' terms, to the new max
                return out * rescale[..., None] + o, denom * rescale + d, new_max

            shape = q_block.shape[:-1]
            init = (jnp.zeros((*shape, h), jnp.float32), jnp.zeros(shape, jnp.float32), jnp.full(shape, -1e30))
            # causal: the key blocks up to the one holding this query block's last position
            last = query_start + (i + 1) * cq - 1
            visible = jnp.minimum(last // ck + 1, sp // ck) if causal else sp // ck
            out, denom, _ = jax.lax.fori_loop(0, visible, key_block, init)
            return out / jnp.maximum(denom, 1e-30)[..., None]

        blocks = jax.lax.map(query_block, jnp.arange(tp // cq))  # [Tp / cq, B, K, G, cq, H]
    out = jnp.transpose(blocks, (1, 0, 4, 2, 3, 5)).reshape(b, tp, n, h)  # query blocks back in order
    return out[:, :t].astype(q.dtype)


def pool_attention_probs(
    q: jax.Array,  # f[B, K, G, H]
    k: jax.Array,  # f[B, K, C, H]
    live: jax.Array,  # bool[B, K, C]
) -> jax.Array:  # f32[B, K, G, C], zeros on free slots
    logits = jnp.einsum("BKGH,BKCH->BKGC", q, k, preferred_element_type=jnp.float32) / math.sqrt(q.shape[-1])
    return masked_softmax(logits, live[:, :, None])


def pool_attention(
    q: jax.Array,  # f[B, K, G, H]
    k: jax.Array,  # f[B, K, C, H]
    v: jax.Array,  # f[B, K, C, H]
    live: jax.Array,  # bool[B, K, C]
) -> jax.Array:  # f[B, K, G, H]; zeros where no slot is live
    probs = pool_attention_probs(q, k, live)
    return jnp.einsum("BKGC,BKCH->BKGH", probs.astype(v.dtype), v).astype(q.dtype)


def decode_attention(
    q: jax.Array,  # f[B, N, H] one query per sequence, RoPE applied
    cache: GroupCache,
    layer: int,  # the layer's index inside the cache's group
    *,
    use_kernel: bool = False,
) -> jax.Array:  # f[B, N, H]
    """Decode attention of q to the live entries of one layer of a group cache: its slot pool and block pools.

    XLA path: the pools dequantized inside the step (a no-op at full precision), laid end to end, and attended over
    with the live mask (no gather). `use_kernel`: the Pallas kernels of `jax.default_backend()` (on CPU the TPU
    kernels, interpreted): a full-precision slot pool's gathers the live slots the table names (per shard on an
    active mesh); an int8 / fp8 slot pool's and a block pool's read the codes and fold the scales in, and their
    softmax states merge. An int4 / int2 slot pool has no kernel: it takes the XLA path.
    """
    b, n, h = q.shape
    kv_heads = cache.pos.shape[2]
    qg = q.reshape(b, kv_heads, n // kv_heads, h)  # [B, K, G, H]
    if not use_kernel or cache.storage.slots.kind == "int" and not cache.storage.slots.full:
        k, v, live = _pools(cache, layer)  # XLA (and int4 / int2 slot pools, which no kernel reads)
        out = pool_attention(qg, k, v, live)
    elif cache.storage.lossless:
        kernel = per_row_shards(functools.partial(gather_attention, use_kernel=True), cache.axes)
        out = kernel(qg, cache.k.codes[layer], cache.v.codes[layer], cache.table[layer], cache.length[layer])
    else:  # each pool's kernel reads its codes; their softmax states merge
        out = merge_partials(_pool_partials(qg, cache, layer)).astype(q.dtype)
    return out.reshape(b, n, h)


def _pool_partials(qg: jax.Array, cache: GroupCache, layer: int) -> list[SoftmaxPartial]:
    """The online-softmax state of each pool of one layer, from its kernel (a full-precision slot pool -- KIVI's
    window, a few dozen entries -- from XLA)."""
    at = functools.partial(jax.tree.map, lambda x: x[layer])
    table, length = cache.table[layer], cache.length[layer]
    if cache.storage.slots.full:
        k, v = cache.slot_kv(layer)
        parts = [_partial(qg, k, v, cache.pos[layer] >= 0)]
    else:
        fmt = cache.storage.slots
        parts = [
            slot_pool_attention(qg, at(cache.k), at(cache.v), table, length, k_fmt=fmt, v_fmt=fmt, use_kernel=True)
        ]
    for blocks in cache.block_pools:
        key, value = blocks.formats
        parts.append(
            block_pool_attention(
                qg,
                at(blocks.k),
                at(blocks.v),
                blocks.table[layer],
                blocks.count[layer],
                blocks.live(layer).astype(jnp.int32),
                k_fmt=key,
                v_fmt=value,
                use_kernel=True,
            )  # fmt: skip
        )
    return parts


def _partial(q: jax.Array, k: jax.Array, v: jax.Array, live: jax.Array) -> SoftmaxPartial:
    """q f[B, K, G, H] over k, v f[B, K, C, H] where live (bool[B, K, C]) -> its online-softmax state."""
    logits = jnp.einsum("BKGH,BKCH->BKGC", q, k, preferred_element_type=jnp.float32) / math.sqrt(q.shape[-1])
    logits = jnp.where(live[:, :, None], logits, -jnp.inf)
    m = jnp.max(logits, axis=-1)  # -inf where nothing is live
    weights = jnp.where(live[:, :, None], jnp.exp(logits - jnp.where(jnp.isfinite(m), m, 0.0)[..., None]), 0.0)
    return SoftmaxPartial(jnp.einsum("BKGC,BKCH->BKGH", weights, v.astype(jnp.float32)), m, weights.sum(-1))


def decode_attention_probs(
    q: jax.Array,  # f[B, N, H]
    cache: GroupCache,
    layer: int,
) -> tuple[jax.Array, jax.Array]:  # f[B, N, H], f32[B, K, G, C]
    """`decode_attention` on the XLA path that also returns the weights over the slot pool (zeros on free slots),
    for methods that accumulate attention (H2O); a cache with a block pool has no per-slot weights to give."""
    if cache.blocks is not None:
        raise ValueError("attention weights per slot are not defined for a cache with a block pool")
    b, n, h = q.shape
    k, v = cache.slot_kv(layer)
    kv_heads = k.shape[1]
    probs = pool_attention_probs(q.reshape(b, kv_heads, n // kv_heads, h), k, cache.pos[layer] >= 0)
    out = jnp.einsum("BKGC,BKCH->BKGH", probs.astype(v.dtype), v).astype(q.dtype)
    return out.reshape(b, n, h), probs


def _pools(cache: GroupCache, layer: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """One layer's keys, values f[B, K, S, H] and live mask bool[B, K, S]: the slot pool, then each block pool."""
    k, v = cache.slot_kv(layer)
    live = cache.pos[layer] >= 0
    if cache.blocks is None:
        return k, v, live
    keys, values, lives = [k], [v], [live]
    for blocks in cache.block_pools:
        block_k, block_v = blocks.dequantized(layer)
        keys, values = keys + [block_k], values + [block_v]
        lives.append(blocks.live(layer).reshape(live.shape[0], live.shape[1], -1))
    join = lambda xs: jnp.concatenate([x.astype(jnp.float32) for x in xs], axis=2)  # noqa: E731
    return join(keys).astype(k.dtype), join(values).astype(v.dtype), jnp.concatenate(lives, 2)
