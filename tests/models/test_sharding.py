"""Sharded inference on a CPU device mesh: every method (and PASK under a policy) gives one device's greedy tokens
and kept entries on the mesh (data, model) = (4, 2), which splits both axes; full KV and PASK under a policy do on
(8, 1) and (2, 4) too (the KV heads whole on a model axis of 4); parameters lie as the table says; a layout compiles
the steps one device compiles, once; bf16 tracks f32.

The mesh runs need 8 devices, which XLA:CPU only fakes when `--xla_force_host_platform_device_count` is set before JAX
starts: one subprocess (`worker`) runs every layout and prints its results, the tests below judge them.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from support import BUCKETS, CASES, NEW, PROMPTS, ROLES, synthetic_stats, tiny_model

from pask_jax.calibration.compiler import compile_policy
from pask_jax.experiments.sweep import generate_shared, prefill_groups
from pask_jax.llm import LLM
from pask_jax.memory import cache_bytes_per_device, param_bytes_per_device
from pask_jax.methods import KVMethod, PaskKV
from pask_jax.models.decoder import Decoder, ModelConfig
from pask_jax.models.loading import cast_model, resolve_dtype
from pask_jax.models.sharding import (
    PARAM_AXES,
    ShardingError,
    check_mesh,
    make_mesh,
    param_path,
    param_spec,
    param_specs,
    parse_mesh,
)
from pask_jax.runtime import prefill, sampling, step
from pask_jax.runtime.engine import Engine
from pask_jax.runtime.sampling import SamplingConfig
from pask_jax.runtime.scheduler import ContinuousBatcher, SequenceRequest
from pask_jax.runtime.shapes import padded_batch

DEVICES = 8
LAYOUTS = ((8, 1), (4, 2), (2, 4))
BUDGET = 0.33
COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"  # jax.monitoring: one per XLA backend compile
STEPS = {"prefill": prefill.prefill_jit, "decode": step.decode_jit, "sample": sampling.sample_masked}  # jitted steps
# one method per way a cache is laid out, filled or read: slots (full, int8), blocks that fill (KIVI), per-layer
# fractions (PyramidKV), prefill statistics (SnapKV's window, DapQ's pseudo queries, H2O's decode attention), PASK
# under a policy, and SnapKV decoding through the Pallas kernel
NAMES = ("dapq", "full", "h2o", "int8", "pyramidkv", "snapkv", "kivi_group8", "pask_policy", "snapkv_kernel")
EVERY_METHOD_LAYOUT = (4, 2)  # both axes split: every NAMES method runs on it; the other layouts run LAYOUT_NAMES
LAYOUT_NAMES = ("full", "pask_policy")
CONTINUOUS = "pask_policy"  # the method continuous batching runs on every layout
POLICY = compile_policy(synthetic_stats(num_layers=2, groups=2), [BUDGET])
MARK = "SHARDED-RESULTS:"
CONTINUOUS_LIMITS = (NEW, 2, 9, 1, 14, 5, NEW, 3, 7, 11)


def method(name: str) -> KVMethod:
    """The CASES of tests/methods/test_methods.py at BUDGET; "pask_policy" under a policy compiled for BUDGET."""
    return PaskKV.from_policy(POLICY, BUDGET) if name == "pask_policy" else CASES[name.removesuffix("_kernel")](BUDGET)


def methods_model() -> Decoder:
    return Decoder(ModelConfig.tiny("qwen3", vocab_size=256), rngs=nnx.Rngs(5))  # 2 layers, 4 / 2 heads


def placement_problems(model: Decoder, mesh) -> list[str]:
    """Parameters whose sharding is not the table's; and, independently of the table, any matrix of the tiny model
    left whole on a `model` axis of 2 or more (its head, MLP and vocabulary sizes divide 4; only its 2 KV heads stay
    whole on 4), or any norm scale split."""
    problems, model_axis = [], mesh.shape["model"]
    for key, leaf in jax.tree_util.tree_flatten_with_path(nnx.state(model))[0]:
        path = param_path(key)
        expected = NamedSharding(mesh, param_spec(path, leaf.shape, mesh.shape))
        if not leaf.sharding.is_equivalent_to(expected, leaf.ndim):
            problems.append(f"{path}: {leaf.sharding} is not the table's {expected.spec}")
        split = leaf.sharding.shard_shape(leaf.shape) != leaf.shape
        kv_whole = re.search(r"\.[kv]_proj\.", path) and model.config.num_kv_heads % model_axis
        if leaf.ndim >= 2 and model_axis > 1 and not kv_whole and not split:
            problems.append(f"{path}: a matrix left whole on {dict(mesh.shape)}")
        if leaf.ndim == 1 and split:
            problems.append(f"{path}: a norm scale split on {dict(mesh.shape)}")
    return problems


def layout_names(layout: tuple[int, int] | None) -> tuple[str, ...]:
    """The methods a layout runs: every one on one device (the reference) and on EVERY_METHOD_LAYOUT."""
    return NAMES if layout in (None, EVERY_METHOD_LAYOUT) else LAYOUT_NAMES


def step_executables() -> dict[str, int]:
    return {name: fn._cache_size() for name, fn in STEPS.items()}


def worker() -> None:
    """Each layout's methods (`layout_names`) at BUDGET on one device and on it: tokens, kept ratios, prefill logits,
    continuous batching's tokens, parameter placement, compiles."""
    assert jax.device_count() == DEVICES, jax.devices()
    compiles = []
    jax.monitoring.register_event_duration_secs_listener(lambda event, _, **kw: compiles.append(event == COMPILE_EVENT))
    sampling = SamplingConfig(max_new_tokens=NEW)
    results = {}
    reference_logits = None
    for layout in (None, *LAYOUTS):
        mesh = None if layout is None else make_mesh(*layout)
        names = layout_names(layout)
        model = methods_model()
        engines = [
            Engine(
                model,
                method=method(name),
                budget=1.0 if name == "full" else BUDGET,
                num_groups=2,
                length_buckets=BUCKETS,
                use_kernel=name.endswith("_kernel"),
                mesh=mesh,
            )
            for name in names
        ]
        counts, executables, start = [], step_executables(), time.perf_counter()
        for _ in range(2):  # the second run must reuse every executable of the first
            before = sum(compiles)
            gens = generate_shared(engines, PROMPTS, sampling, prompt_roles=ROLES)
            counts.append(sum(compiles) - before)
        executables = {k: n - executables[k] for k, n in step_executables().items()}
        print(layout, counts, executables, f"{time.perf_counter() - start:.1f} s", file=sys.stderr, flush=True)
        full = engines[names.index("full")]
        shape = full.batch_shape([len(p) for p in PROMPTS], NEW)
        logits = np.asarray(full.prefill(*shape.pad(PROMPTS, ROLES), shape.capacities)[0])
        reference_logits = logits if layout is None else reference_logits
        placement = []
        if mesh is not None:
            untied = tiny_model("qwen2", tie_embeddings=False)  # q/k/v biases and an LM head: the other entries
            Engine(untied, mesh=mesh)
            placement = placement_problems(model, mesh) + placement_problems(untied, mesh)
        batcher = ContinuousBatcher(engines[names.index(CONTINUOUS)], rows=8)  # 8 rows, 10 requests: refilled mid-run
        requests = [SequenceRequest(PROMPTS[i % 3], CONTINUOUS_LIMITS[i], ROLES[i % 3]) for i in range(10)]
        continuous = dict(batcher.run(requests))
        results[str(layout)] = {
            "continuous": [continuous[i].tokens for i in range(len(requests))],
            "tokens": {n: [g.tokens for g in gen] for n, gen in zip(names, gens, strict=True)},
            "kept": {n: [g.stats.kept_ratios for g in gen] for n, gen in zip(names, gens, strict=True)},
            "logits_max_diff": float(np.abs(logits[: len(PROMPTS)] - reference_logits[: len(PROMPTS)]).max()),
            "padded_rows": shape.padded_rows,
            "compiles": counts,
            "step_executables": executables,
            "placement": placement,
        }
    print(MARK + json.dumps(results))


@pytest.fixture(scope="module")
def sharded() -> dict:
    flags = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={DEVICES}"
    # XLA without most optimization passes (a third less compile time): every comparison is between runs compiled so
    env = os.environ | {"XLA_FLAGS": flags.strip(), "JAX_PLATFORMS": "cpu", "JAX_DISABLE_MOST_OPTIMIZATIONS": "1"}
    here = Path(__file__).parent  # test_sharding's folder, and tests/ above it (support)
    path = [str(here), str(here.parent)]
    script = f"import sys; sys.path[:0] = {path!r}; import test_sharding; test_sharding.worker()"
    proc = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=1500, cwd=here.parents[1]
    )
    assert proc.returncode == 0 and MARK in proc.stdout, proc.stderr[-4000:]
    return json.loads(proc.stdout.split(MARK, 1)[1])


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda s: f"{s[0]}x{s[1]}")
def test_every_method_gives_one_devices_tokens_and_kept_entries(sharded: dict, layout: tuple[int, int]):
    one, mesh = sharded["None"], sharded[str(layout)]
    assert sorted(mesh["tokens"]) == sorted(mesh["kept"]) == sorted(layout_names(layout))
    differ = [n for n in mesh["tokens"] if mesh["tokens"][n] != one["tokens"][n]]
    assert not differ, f"greedy tokens differ from one device on {layout} for {differ}"
    differ = [n for n in mesh["kept"] if mesh["kept"][n] != one["kept"][n]]
    assert not differ, f"kept/full entries differ from one device on {layout} for {differ}"
    assert mesh["padded_rows"] % layout[0] == 0  # 3 prompts: padded to whole rows per data shard


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda s: f"{s[0]}x{s[1]}")
def test_continuous_batching_gives_one_devices_static_tokens(sharded: dict, layout: tuple[int, int]):
    static = sharded["None"]["tokens"][CONTINUOUS]
    expected = [static[i % 3][:limit] for i, limit in enumerate(CONTINUOUS_LIMITS)]
    assert sharded["None"]["continuous"] == expected
    assert sharded[str(layout)]["continuous"] == expected


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda s: f"{s[0]}x{s[1]}")
def test_prefill_logits_within_1e_5_of_one_device(sharded: dict, layout: tuple[int, int]):
    assert sharded[str(layout)]["logits_max_diff"] <= 1e-5


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda s: f"{s[0]}x{s[1]}")
def test_every_parameter_lies_as_the_table_says(sharded: dict, layout: tuple[int, int]):
    assert sharded[str(layout)]["placement"] == []


def test_a_layout_compiles_the_steps_one_device_compiles_once_and_a_rerun_nothing(sharded: dict):
    """Per layout: one prefill per group of methods sharing it, one decode step per method, one sampler; a rerun of
    the same shapes (and every decode step after the first, the caches donated in the layout they came out in)
    compiles none."""
    layouts = {str(layout): layout for layout in (None, *LAYOUTS)}
    assert sorted(sharded) == sorted(layouts)
    for key, result in sharded.items():
        print(key, "backend compiles (first run, rerun):", result["compiles"], "steps:", result["step_executables"])
        names = layout_names(layouts[key])
        expected = {"prefill": len(prefill_groups(names)), "decode": len(names), "sample": 1}
        assert result["step_executables"] == expected, key
        assert result["compiles"][1] == 0, key


# ---- the table and the layout rules, without devices ----


def test_the_table_names_every_parameter_of_every_family_and_nothing_else():
    used = set()
    for architecture in ("qwen3", "qwen2", "llama"):
        for tie in (True, False):
            abstract = nnx.state(nnx.eval_shape(lambda a=architecture, t=tie: tiny_model(a, tie_embeddings=t)))
            specs = param_specs(abstract, {"data": 2, "model": 2})  # ShardingError for a parameter it lacks
            assert len(jax.tree.leaves(specs, is_leaf=lambda s: isinstance(s, P))) == len(jax.tree.leaves(abstract))
            paths = [param_path(k) for k, _ in jax.tree_util.tree_flatten_with_path(abstract)[0]]
            used |= {re.sub(r"^layers\.\d+\.", "layers.*.", path) for path in paths}
    assert used == set(PARAM_AXES)  # no entry names a parameter no family has


def test_a_parameter_the_table_does_not_name_is_refused():
    model = tiny_model()
    model.layers[1].attn.extra = nnx.Param(jnp.zeros((4, 4)))
    with pytest.raises(ShardingError, match=r"'layers\.1\.attn\.extra\.?\w*' has no entry in PARAM_AXES"):
        param_specs(nnx.state(model), {"data": 1, "model": 2})


def test_the_default_models_kv_heads_split_only_where_they_divide_the_model_axis():
    cfg = ModelConfig.qwen2_5_coder_0_5b()  # 14 query heads, 2 KV heads, MLP 4864, vocabulary 151936
    d = cfg.hidden_size
    params = {
        "layers.0.attn.q_proj.kernel": (d, 14, 64),
        "layers.0.attn.k_proj.kernel": (d, 2, 64),
        "layers.0.mlp.gate_proj.kernel": (d, 4864),
        "embed.embedding": (cfg.vocab_size, d),
    }
    on_two = [param_spec(path, shape, {"data": 1, "model": 2}) for path, shape in params.items()]
    assert on_two == [P(None, "model", None), P(None, "model", None), P(None, "model"), P("model", None)]
    on_four = [param_spec(path, shape, {"data": 2, "model": 4}) for path, shape in params.items()]
    assert on_four == [P(None, None, None), P(None, None, None), P(None, "model"), P("model", None)]  # heads whole


def test_bytes_per_device_follow_the_shardings():
    cfg = ModelConfig.qwen2_5_coder_0_5b()
    assert param_bytes_per_device(cfg, jnp.bfloat16) == 494_032_768 * 2  # Qwen2.5-0.5B's parameter count, tied
    tiny = ModelConfig.tiny("qwen2", tie_embeddings=False)  # every matrix and bias divides 2; norms stay whole
    whole = param_bytes_per_device(tiny, jnp.float32)
    norms = 4 * tiny.hidden_size * (2 * tiny.num_layers + 1)
    assert param_bytes_per_device(tiny, jnp.float32, data=4, model=2) == (whole - norms) // 2 + norms
    one = cache_bytes_per_device(tiny, jnp.float32, batch=8, slots=32)
    assert cache_bytes_per_device(tiny, jnp.float32, batch=8, slots=32, data=4, model=2) == pytest.approx(
        one / 8, abs=1
    )  # sequences over 4, both KV heads over 2 (the overflow flag: 1 byte on every device)
    with pytest.raises(ShardingError, match="batch=6 is not a multiple of data=4"):
        cache_bytes_per_device(tiny, jnp.float32, batch=6, slots=32, data=4)


def test_meshes_are_checked():
    with pytest.raises(ShardingError, match="needs 64 devices"):
        make_mesh(8, 8)
    with pytest.raises(ShardingError, match="DATAxMODEL"):
        parse_mesh("4*2")
    assert parse_mesh("4x2") == (4, 2)
    wrong = jax.make_mesh((1,), ("batch",), axis_types=(jax.sharding.AxisType.Auto,))
    with pytest.raises(ShardingError, match="axes"):
        check_mesh(wrong)
    with pytest.raises(ShardingError, match="axes"):
        Engine(tiny_model(), mesh=wrong)


def test_batches_pad_to_whole_rows_per_data_shard():
    assert [padded_batch(n) for n in (1, 3, 5)] == [1, 4, 8]
    assert [padded_batch(n, 8) for n in (1, 3, 9)] == [8, 8, 16]
    assert padded_batch(5, 6) == 12


def test_a_one_device_mesh_gives_the_tokens_of_no_mesh():
    sampling = SamplingConfig(max_new_tokens=8)
    plain = Engine(methods_model(), length_buckets=BUCKETS).generate(PROMPTS, sampling)
    meshed = Engine(methods_model(), length_buckets=BUCKETS, mesh=make_mesh(1, 1)).generate(PROMPTS, sampling)
    assert [g.tokens for g in meshed] == [g.tokens for g in plain]


# ---- dtype ----

BF16_LOGITS_ATOL = 0.05  # bf16 keeps 8 mantissa bits: the tiny model's logits (|l| < ~3) move by a few 1e-2


def test_bfloat16_tracks_float32():
    """Prefill logits within BF16_LOGITS_ATOL; greedy tokens identical, or parting only where f32's own top-2 margin
    is below that tolerance."""
    f32 = methods_model()
    bf16 = cast_model(f32, "bfloat16")
    assert {x.dtype for x in jax.tree.leaves(nnx.state(bf16))} == {jnp.dtype(jnp.bfloat16)}
    assert {x.dtype for x in jax.tree.leaves(nnx.state(f32))} == {jnp.dtype(jnp.float32)}  # the original is kept
    engines = [Engine(m, length_buckets=BUCKETS) for m in (f32, bf16)]
    shape = engines[0].batch_shape([len(p) for p in PROMPTS], NEW)
    logits = [np.asarray(e.prefill(*shape.pad(PROMPTS), shape.capacities)[0]) for e in engines]
    np.testing.assert_allclose(logits[1], logits[0], atol=BF16_LOGITS_ATOL)
    _, caches, _ = engines[1].prefill(*shape.pad(PROMPTS), shape.capacities)
    assert caches[0].k.codes.dtype == jnp.bfloat16 and caches[0].score.dtype == jnp.float32
    sampling = SamplingConfig(max_new_tokens=NEW)
    tokens = [[g.tokens for g in e.generate(PROMPTS, sampling)] for e in engines]
    for prompt, a, b in zip(PROMPTS, *tokens, strict=True):
        same = next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), len(a))
        assert same >= 4, (a, b)  # the first tokens always agree
        if same < len(a):  # a divergence is allowed only at a near-tie of the f32 model itself
            top2 = np.sort(np.asarray(f32(jnp.asarray([prompt + a[:same]])))[0, -1])[-2:]
            assert top2[1] - top2[0] < BF16_LOGITS_ATOL, (same, top2)


def test_dtype_names_and_the_cpu_default():
    assert resolve_dtype(None) == resolve_dtype("auto") == jnp.float32  # these tests run on CPU
    assert resolve_dtype("bfloat16") == resolve_dtype(jnp.bfloat16) == jnp.bfloat16
    with pytest.raises(ValueError, match="float16"):
        resolve_dtype("float16")
    with pytest.raises(ValueError, match="int8"):
        resolve_dtype(jnp.int8)


def test_llm_dtype_casts_a_given_model_and_its_cache(tiny_qwen_vocab, qwen_tok):
    llm = LLM(tiny_qwen_vocab, tokenizer=qwen_tok, method="full", dtype="bfloat16")
    assert llm.model.embed.embedding.dtype == jnp.bfloat16 and llm.engine.plan.dtype == jnp.bfloat16
    assert tiny_qwen_vocab.embed.embedding.dtype == jnp.float32  # the caller's model is not changed
    kept = LLM(tiny_qwen_vocab, tokenizer=qwen_tok, method="full")
    assert kept.model is tiny_qwen_vocab  # no dtype named: the given model as it is
