"""Memory sums from shapes alone: bytes one device holds of a tree laid out on a mesh, a model's parameters, a KV cache,
a tree's bytes, and how many cache rows fit a byte limit.

Nothing is allocated: parameters come from `nnx.eval_shape`, caches from `jax.eval_shape`, their layout from the
sharding table (`pask_jax.models.sharding`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P

from pask_jax.cache import GroupCache
from pask_jax.models.decoder import Decoder, ModelConfig
from pask_jax.models.sharding import DATA, MODEL, ShardingError, cache_axes, param_specs


def bytes_per_device(tree, specs, mesh_shape: Mapping[str, int]) -> int:
    """Bytes one device holds of `tree` (arrays or ShapeDtypeStructs) laid out by `specs` on a mesh of `mesh_shape`."""

    def leaf_bytes(x, spec: P) -> int:
        splits = [math.prod(mesh_shape[a] for a in (s if isinstance(s, tuple) else (s,))) for s in spec if s]
        return math.prod(x.shape) * jnp.dtype(x.dtype).itemsize // math.prod(splits)

    return sum(jax.tree.leaves(jax.tree.map(leaf_bytes, tree, specs, is_leaf=lambda s: isinstance(s, P))))


def param_bytes_per_device(cfg: ModelConfig, dtype, data: int = 1, model: int = 1) -> int:
    """Parameter bytes per device of a model of `cfg` in `dtype` on a data x model mesh (from the table alone)."""
    abstract = nnx.state(nnx.eval_shape(lambda: Decoder(cfg, dtype=dtype, rngs=nnx.Rngs(0))))
    mesh_shape = {DATA: data, MODEL: model}
    return bytes_per_device(abstract, param_specs(abstract, mesh_shape), mesh_shape)


def cache_bytes_per_device(cfg: ModelConfig, dtype, batch: int, slots: int, data: int = 1, model: int = 1) -> int:
    """KV-cache bytes per device for `batch` sequences of `slots` kept entries per (layer, KV head), all layers in one
    group, on a data x model mesh (K / V plus the slot bookkeeping the cache keeps)."""
    if batch % data:
        raise ShardingError(f"batch={batch} is not a multiple of data={data} (the engine pads batches to one)")
    mesh_shape = {DATA: data, MODEL: model}
    axes = cache_axes(cfg.num_kv_heads, mesh_shape)
    cache = jax.eval_shape(
        lambda: GroupCache.empty(cfg.num_layers, batch, cfg.num_kv_heads, slots, cfg.head_dim, dtype, axes=axes)
    )
    return bytes_per_device(cache, cache.partition_specs(), mesh_shape)


def tree_bytes(tree) -> int:
    """Bytes of every array (or ShapeDtypeStruct) of `tree`, all devices' shards together: e.g. a model's weights."""
    return sum(math.prod(x.shape) * jnp.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree))


def rows_fitting(bytes_at: Callable[[int], int], limit: int) -> int:
    """The most rows whose caches fit `limit` bytes, where `bytes_at(n)` is the bytes of n rows and grows linearly
    with them (a per-row part plus a fixed part, such as a cache's overflow flag); 0 when not even one row fits."""
    per_row = bytes_at(2) - bytes_at(1)
    return max(0, (limit - (bytes_at(1) - per_row)) // per_row)
