"""How the decoder and its cache lie on a device mesh: axes `data` (batch) x `model` (tensor parallel), JAX SPMD.

One declarative table, `PARAM_AXES`, names the logical axis of every dimension of every parameter of `Qwen3`
(attention heads, KV heads, MLP hidden, vocabulary); `LOGICAL_AXES` maps logical axes to mesh axes. A dimension is
split over its mesh axis only when the axis size divides it, and replicated otherwise: the default model's 2 KV heads
(and its 14 query heads) stay whole on a 4-wide `model` axis while its MLP and vocabulary are split. Activations are
constrained with the same logical names (`constrain`, called inside the model), which is a no-op unless a mesh is
active (`mesh_context`, entered by the engine while it traces), so code without a mesh runs exactly as before.

Multi-host: `init_distributed` calls `jax.distributed.initialize()` when the environment asks for it; each process
then builds its mesh from its own devices (`make_mesh` uses `jax.local_devices()`), the layout `pask-jax run` uses
to give each host its own share of the input lines.
"""

from __future__ import annotations

import contextlib
import os
import re
from collections.abc import Mapping, Sequence

import jax
from flax import nnx
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

DATA, MODEL = "data", "model"  # the engine's mesh axes: batch rows, tensor parallel
MESH_AXES = (DATA, MODEL)

# Logical axis -> the mesh axis it is split over (when that axis divides it).
LOGICAL_AXES: dict[str, str] = {
    "batch": DATA,  # sequences, and every per-sequence cache array
    "vocab": MODEL,  # embedding rows, LM head rows, logits
    "heads": MODEL,  # query heads (q / o projections)
    "kv_heads": MODEL,  # KV heads (k / v projections, the KV cache)
    "mlp": MODEL,  # MLP hidden (gate / up columns, down rows)
}

# Every parameter of `Qwen3`: its path (`*` = a layer index) -> the logical axis of each dimension (None: whole).
PARAM_AXES: dict[str, tuple[str | None, ...]] = {
    "embed.embedding": ("vocab", None),  # [V, D]
    "lm_head.kernel": ("vocab", None),  # [V, D], untied checkpoints
    "final_norm.scale": (None,),  # [D]
    "layers.*.input_norm.scale": (None,),  # [D]
    "layers.*.post_attn_norm.scale": (None,),  # [D]
    "layers.*.attn.q_proj.kernel": (None, "heads", None),  # [D, N, H]
    "layers.*.attn.q_proj.bias": ("heads", None),  # [N, H], Qwen2
    "layers.*.attn.k_proj.kernel": (None, "kv_heads", None),  # [D, K, H]
    "layers.*.attn.k_proj.bias": ("kv_heads", None),  # [K, H]
    "layers.*.attn.v_proj.kernel": (None, "kv_heads", None),  # [D, K, H]
    "layers.*.attn.v_proj.bias": ("kv_heads", None),  # [K, H]
    "layers.*.attn.o_proj.kernel": ("heads", None, None),  # [N, H, D]
    "layers.*.attn.q_norm.scale": (None,),  # [H], Qwen3
    "layers.*.attn.k_norm.scale": (None,),  # [H]
    "layers.*.mlp.gate_proj.kernel": (None, "mlp"),  # [D, F]
    "layers.*.mlp.up_proj.kernel": (None, "mlp"),  # [D, F]
    "layers.*.mlp.down_proj.kernel": ("mlp", None),  # [F, D]
}


class ShardingError(ValueError):
    """A mesh the engine cannot use, or a parameter the table does not name."""


def make_mesh(data: int, model: int = 1, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A (`data`, `model`) mesh over the first data x model of `devices` (default: this process's own devices)."""
    if data < 1 or model < 1:
        raise ShardingError(f"mesh sizes must be >= 1, got data={data}, model={model}")
    devices = list(jax.local_devices() if devices is None else devices)
    if data * model > len(devices):
        raise ShardingError(f"a {data} x {model} mesh needs {data * model} devices; there are {len(devices)}")
    return jax.make_mesh(
        (data, model), MESH_AXES, axis_types=(AxisType.Auto, AxisType.Auto), devices=devices[: data * model]
    )


def parse_mesh(text: str) -> tuple[int, int]:
    """The sizes a "DATAxMODEL" text names: "4x2" -> (4, 2)."""
    match = re.fullmatch(r"\s*(\d+)\s*x\s*(\d+)\s*", text)
    if match is None:
        raise ShardingError(f"mesh {text!r} must be DATAxMODEL, e.g. 8x1 or 4x2")
    return int(match[1]), int(match[2])


def check_mesh(mesh: Mesh) -> Mesh:
    """The mesh, if the engine can run on it: axes ("data", "model"), every device this process's own."""
    if set(mesh.axis_names) != set(MESH_AXES) or len(mesh.axis_names) != 2:
        raise ShardingError(f"the engine's mesh needs axes {MESH_AXES}, got {mesh.axis_names} (see make_mesh)")
    if any(d.process_index != jax.process_index() for d in mesh.devices.flat):
        raise ShardingError(
            "the engine's mesh must hold only this process's devices (jax.local_devices()): each process runs its "
            "own share of the requests"
        )
    return mesh


def init_distributed() -> bool:
    """Call `jax.distributed.initialize()` before any JAX computation when the environment asks for it:
    `JAX_COORDINATOR_ADDRESS` (plus `JAX_NUM_PROCESSES`, `JAX_PROCESS_ID`) or `PASK_DISTRIBUTED=1` (Cloud TPU pods
    and SLURM, where JAX detects the cluster itself). Returns whether it did."""
    env = os.environ
    if not env.get("JAX_COORDINATOR_ADDRESS") and env.get("PASK_DISTRIBUTED") != "1":
        return False
    count, index = env.get("JAX_NUM_PROCESSES"), env.get("JAX_PROCESS_ID")
    jax.distributed.initialize(
        env.get("JAX_COORDINATOR_ADDRESS"),
        num_processes=None if count is None else int(count),
        process_id=None if index is None else int(index),
    )
    return True


# ---- logical axes -> partition specs ----


def logical_spec(axes: Sequence[str | None], shape: Sequence[int], mesh_shape: Mapping[str, int]) -> P:
    """The PartitionSpec of an array of `shape` whose dimensions have logical `axes`: a dimension is split over its
    mesh axis when that axis is in the mesh and its size divides the dimension, else replicated."""
    if len(axes) != len(shape):
        raise ShardingError(f"{len(axes)} logical axes {tuple(axes)} for an array of shape {tuple(shape)}")
    spec = []
    for axis, size in zip(axes, shape, strict=True):
        mesh_axis = LOGICAL_AXES[axis] if axis is not None else None
        split = mesh_axis in mesh_shape and mesh_shape[mesh_axis] > 1 and size % mesh_shape[mesh_axis] == 0
        spec.append(mesh_axis if split else None)
    return P(*spec)


def mesh_context(mesh: Mesh | None):
    """While tracing under it, `constrain` (and the cache's constraints) lay activations out on `mesh`."""
    return contextlib.nullcontext() if mesh is None else jax.sharding.use_abstract_mesh(mesh.abstract_mesh)


def constrain(x: jax.Array, *axes: str | None) -> jax.Array:
    """`jax.lax.with_sharding_constraint` of x by logical axes, on the active mesh (`mesh_context`); else x."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return x
    return jax.lax.with_sharding_constraint(x, logical_spec(axes, x.shape, mesh.shape))


def cache_axes(num_kv_heads: int, mesh_shape: Mapping[str, int]) -> tuple[str | None, str | None]:
    """The mesh axes of a cache's sequence and KV-head dimensions (`GroupCache.axes`); batches are padded to a
    multiple of the `data` size, so sequences are always split over it."""
    spec = logical_spec(("batch", "kv_heads"), (mesh_shape.get(DATA, 1), num_kv_heads), mesh_shape)
    return spec[0], spec[1]


# ---- parameters ----


def param_path(key_path) -> str:
    """A pytree key path of an `nnx.State` -> the parameter's dotted path ("layers.3.attn.q_proj.kernel")."""
    parts = []
    for key in key_path:
        part = getattr(key, "key", getattr(key, "name", getattr(key, "idx", None)))
        parts.append(str(part))
    if parts and parts[-1] == "value":  # the Variable's value
        parts.pop()
    return ".".join(parts)


def param_axes(path: str) -> tuple[str | None, ...]:
    """The table's logical axes of the parameter at `path` (ShardingError if the table does not name it)."""
    axes = PARAM_AXES.get(re.sub(r"(?<=^layers\.)\d+(?=\.)", "*", path))
    if axes is None:
        raise ShardingError(f"parameter {path!r} has no entry in PARAM_AXES (pask_jax/models/sharding.py)")
    return axes


def param_spec(path: str, shape: Sequence[int], mesh_shape: Mapping[str, int]) -> P:
    return logical_spec(param_axes(path), shape, mesh_shape)


def param_specs(params, mesh_shape: Mapping[str, int]):
    """The PartitionSpec of every leaf of a parameter state (arrays or ShapeDtypeStructs), as the same tree."""
    return jax.tree_util.tree_map_with_path(lambda k, x: param_spec(param_path(k), x.shape, mesh_shape), params)


def place_params(params, mesh: Mesh):
    """Every parameter `jax.device_put` onto `mesh` with its table sharding (already placed ones are kept as is)."""
    specs = param_specs(params, mesh.shape)
    return jax.tree.map(lambda x, spec: jax.device_put(x, NamedSharding(mesh, spec)), params, specs)


def shard_model(model: nnx.Module, mesh: Mesh) -> nnx.Module:
    """Move the model's parameters onto `mesh` per the table, in place (engines over one model then share them)."""
    nnx.update(model, place_params(nnx.state(model), check_mesh(mesh)))
    return model
