"""Calibration passes: parity with the plain forward, masks equal to hand-built ones, group locality, sharding over 8
fake CPU devices, resume after interruption, and one small end-to-end run on real BFCL calibration items."""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from pask_jax.attention import attention
from pask_jax.calibration.passes import (
    NO_ROLE,
    PassPlan,
    baseline_pass,
    low_precision,
    prefill,
    removal_mask,
    removed_entries,
    target_stats,
    teacher_force,
    variant_pass,
)
from pask_jax.calibration.run import CalibrationStats, Example, calibrate_examples, item_arrays, pack_bits
from pask_jax.kernels.quantize import PRESETS, KVFormat, dequantize, quantize
from pask_jax.layers import layer_groups
from pask_jax.models.decoder import Decoder, ModelConfig
from pask_jax.structure.roles import GENERATED_ROLES, PROMPT_ROLES, Role, num_roles

LAYERS, GROUPS = 4, 2


@functools.cache
def tiny_model() -> Decoder:
    return Decoder(ModelConfig.tiny(num_layers=LAYERS), rngs=nnx.Rngs(0))


def jitted(model: Decoder, fn, *args):
    """fn(model, *args) under jax.jit (eager op-by-op execution of the model is slow on CPU)."""
    graphdef, state = nnx.split(model)
    return jax.jit(lambda state, *a: fn(nnx.merge(graphdef, state), *a))(state, *args)


def synthetic_example(seed: int, prompt_len: int = 23, gold_len: int = 9, vocab: int = 256) -> Example:
    """Random ids and roles; the grammar mask allows everything but on a few rows restricts to a random subset."""
    rng = np.random.default_rng(seed)
    prompt_roles = rng.choice(np.array(PROMPT_ROLES[:4]), prompt_len).astype(np.int32)
    prompt_roles[0] = Role.SINK
    gold_roles = rng.choice(np.array(GENERATED_ROLES[:4]), gold_len).astype(np.int32)
    gold = rng.integers(0, vocab, gold_len).astype(np.int32)
    allowed = np.full((gold_len, -(-vocab // 32)), -1, np.int32)
    restricted = rng.choice(gold_len, 3, replace=False)
    allowed[restricted] = pack_bits([{*np.flatnonzero(rng.random(vocab) < 0.1), gold[t]} for t in restricted], vocab)
    consistent = pack_bits([[g] for g in gold], vocab)  # only the gold token spells the gold text
    return Example(
        f"synthetic_{seed}",
        rng.integers(0, vocab, prompt_len).astype(np.int32),
        prompt_roles,
        gold,
        gold_roles,
        allowed,
        consistent,
    )


def hand_masked_forward(model: Decoder, ex: Example, role: int, group: int, level: float) -> np.ndarray:
    """Full forward over prompt + fed gold with the variant's mask built by hand: logits of the fed rows."""
    tokens = np.concatenate([ex.prompt, ex.gold[:-1]])
    roles = np.concatenate([ex.prompt_roles, ex.gold_roles[:-1]])
    n, p = len(tokens), len(ex.prompt)
    causal = np.tril(np.ones((n, n), bool))
    removed = np.zeros((n, n), bool)
    for i in range(p, n):  # fed queries only
        keys = [j for j in range(i + 1) if roles[j] == role]
        keep = math.ceil(level * len(keys))
        for j in keys[: len(keys) - keep]:
            removed[i, j] = j != i
    start, stop = layer_groups(LAYERS, GROUPS)[group]
    masks = {l: (causal & ~removed) if start <= l < stop else causal for l in range(LAYERS)}  # noqa: E741

    def forward(model, tokens):
        attend = lambda l, q, k, v: attention(q, k, v, jnp.asarray(masks[l])[None])  # noqa: E731, E741
        return model.logits(model.forward(tokens[None], jnp.arange(n)[None], attend))[0, p:]

    return np.asarray(jitted(model, forward, jnp.asarray(tokens)))


def unpack(bits: np.ndarray, vocab: int) -> np.ndarray:
    ids = np.arange(vocab)
    return ((bits.view(np.uint32)[:, ids >> 5] >> (ids & 31).astype(np.uint32)) & 1).astype(bool)


def _plan(model: Decoder, **kw) -> PassPlan:
    return PassPlan(nnx.graphdef(model), layer_groups(LAYERS, GROUPS), **kw)


def _force(model, ex, rows, low: bool = False, formats=None):
    spec = np.array(rows, np.float64)  # [(role, group, level)]
    role, group, level = spec[:, 0].astype(np.int32), spec[:, 1].astype(np.int32), spec[:, 2].astype(np.float32)

    def run(model, arrays, role, group, level):
        k, v, first = prefill(model, arrays)
        return first, *teacher_force(
            model, _plan(model, **({} if formats is None else {"low": formats})), arrays, k, v, role, group, level, low
        )

    first, logits, outs = jitted(model, run, item_arrays(ex), role, group, level)
    return first, np.asarray(logits), [np.asarray(o) for o in outs]


def test_baseline_matches_plain_forward():
    model, ex = tiny_model(), synthetic_example(0)
    full = np.asarray(jitted(model, lambda m, x: m(x[None])[0], np.concatenate([ex.prompt, ex.gold[:-1]])))
    first, logits, _ = _force(model, ex, [(NO_ROLE, 0, 0.0)])
    p, t = len(ex.prompt), len(ex.gold) - 1
    np.testing.assert_allclose(np.asarray(first), full[p - 1], atol=1e-5)
    np.testing.assert_allclose(logits[0, :t], full[p:], atol=1e-5)
    # the jitted baseline pass agrees, and its own statistics follow from those logits
    base = baseline_pass(_plan(model), nnx.state(model), item_arrays(ex))
    np.testing.assert_allclose(np.asarray(base["first_logits"]), full[p - 1], atol=1e-5)
    rows = np.concatenate([full[p - 1 : p], full[p:]])
    nll = np.mean(
        np.log(np.exp(rows - rows.max(-1, keepdims=True)).sum(-1)) + rows.max(-1) - rows[np.arange(t + 1), ex.gold]
    )
    assert float(base["nll"]) == pytest.approx(nll, rel=1e-5)
    allowed = unpack(ex.allowed, rows.shape[-1])
    greedy = np.where(allowed, rows, -np.inf).argmax(-1)  # constrained greedy choice per target
    assert bool(base["error_strict"]) == bool((greedy != ex.gold).any())
    assert bool(base["error"]) == bool((greedy != ex.gold)[:-1].any())  # only the gold token spells the gold text


def test_target_stats_text_consistency_and_end_of_turn():
    """Vocabulary of 8; gold g = [1, 2, 3] (3 = end of turn). Token 5 spells a prefix of the gold text at target 1."""
    allowed = pack_bits([[1, 4], [2, 5, 6], [3, 7]], 8)
    consistent = pack_bits([[1], [2, 5], [3]], 8)
    item = item_arrays(
        Example(
            "x",
            np.array([0, 0], np.int32),
            np.zeros(2, np.int32),
            np.array([1, 2, 3], np.int32),
            np.zeros(3, np.int32),
            allowed,
            consistent,
        )
    )
    tb = item.fed.shape[0]

    def stats(first: list[float], second: list[float], third: list[float]):
        logits = np.zeros((1, tb, 8), np.float32)
        logits[0, 0], logits[0, 1] = second, third
        out = target_stats(item, jnp.asarray(first, jnp.float32), jnp.asarray(logits))
        return bool(out["error"][0]), bool(out["error_strict"][0]), float(out["nll"][0])

    onehot = lambda i: [5.0 if j == i else 0.0 for j in range(8)]  # noqa: E731
    assert stats(onehot(1), onehot(2), onehot(3))[:2] == (False, False)
    assert stats(onehot(0), onehot(2), onehot(3))[:2] == (False, False)  # 0 scores best but the grammar forbids it
    assert stats(onehot(4), onehot(2), onehot(3))[:2] == (True, True)  # the grammar allows 4: the call goes wrong
    assert stats(onehot(1), onehot(5), onehot(3))[:2] == (False, True)  # 5 spells the same text: only strict fails
    assert stats(onehot(1), onehot(6), onehot(3))[:2] == (True, True)
    assert stats(onehot(1), onehot(2), onehot(7))[:2] == (False, True)  # the end-of-turn decision is strict-only
    uniform = stats([0.0] * 8, [0.0] * 8, [0.0] * 8)
    assert uniform[2] == pytest.approx(math.log(8), rel=1e-6)  # NLL over the 3 gold tokens


@pytest.mark.parametrize(
    ("role", "group", "level"),
    [(PROMPT_ROLES[1], 1, 0.0), (PROMPT_ROLES[2], 0, 0.5), (GENERATED_ROLES[1], 1, 0.0), (Role.SINK, 0, 0.0)],
)
def test_variant_equals_hand_masked_forward(role, group, level):
    model, ex = tiny_model(), synthetic_example(1)
    _, logits, _ = _force(model, ex, [(NO_ROLE, 0, 0.0), (int(role), group, level)])
    expected = hand_masked_forward(model, ex, int(role), group, level)
    t = len(ex.gold) - 1
    np.testing.assert_allclose(logits[1, :t], expected, atol=1e-5)
    assert np.abs(logits[1, :t] - logits[0, :t]).max() > 1e-4  # the removal mattered


def test_removal_keeps_most_recent_and_self():
    ex = synthetic_example(2)
    arrays = item_arrays(ex)
    role = int(PROMPT_ROLES[0])
    n = int((ex.prompt_roles == role).sum())
    for level in (0.0, 0.25, 0.5, 0.75, 1.0):
        mask = np.asarray(removal_mask(arrays, jnp.array([role]), jnp.array([level], jnp.float32)))[0, 0]
        oldest = np.flatnonzero(ex.prompt_roles == role)[: n - math.ceil(level * n)]
        np.testing.assert_array_equal(np.flatnonzero(mask), oldest)  # all but the ceil(level * n) most recent
    assert not np.asarray(removal_mask(arrays, jnp.array([NO_ROLE]), jnp.zeros(1))).any()
    counts = removed_entries(arrays, jnp.array([role, role]), jnp.array([0.0, 1.0]))
    assert list(np.asarray(counts)) == [n, 0]


def test_removal_changes_only_its_group_and_later():
    model, ex = tiny_model(), synthetic_example(3)
    start = layer_groups(LAYERS, GROUPS)[1][0]
    _, _, outs = _force(model, ex, [(NO_ROLE, 0, 0.0), (int(PROMPT_ROLES[1]), 1, 0.0)])
    t = len(ex.gold) - 1
    for layer in range(start):
        np.testing.assert_allclose(outs[layer][1, :t], outs[layer][0, :t], atol=1e-6)
    assert np.abs(outs[start][1, :t] - outs[start][0, :t]).max() > 1e-4


def test_low_precision_reads_codes_and_ignores_padding():
    x = jax.random.normal(jax.random.key(0), (40, 2, 16)).at[:, :, 3].mul(20.0)  # f32[S, K, H], an outlier channel
    key_fmt, value_fmt = PRESETS["kivi2"]
    low = np.asarray(low_precision(x, key_fmt, jnp.int32(32)))
    per_head = jnp.moveaxis(x[:32], 1, 0)  # the 32 valid slots are one channel block per head
    expected = np.moveaxis(np.asarray(dequantize(quantize(per_head, key_fmt), key_fmt)), 0, 1)
    np.testing.assert_allclose(low[:32], expected, atol=1e-6)  # the padding slots never entered the block
    assert np.abs(low[:32] - np.asarray(x[:32])).max() > 1e-3  # 2 bits lose something
    np.testing.assert_allclose(
        low_precision(x, value_fmt, jnp.int32(40))[5], quantize_token(x[5], value_fmt), atol=1e-6
    )


def quantize_token(x: jax.Array, fmt) -> np.ndarray:  # f[K, H]: each KV head's token on its own
    fmt = dataclasses.replace(fmt, group=x.shape[-1])
    return np.asarray(dequantize(quantize(x[:, None], fmt), fmt))[:, 0]


def test_low_variant_reads_the_bucket_at_low_precision():
    model, ex = tiny_model(), synthetic_example(5)
    role, t = int(PROMPT_ROLES[1]), len(ex.gold) - 1
    rows = [(NO_ROLE, 0, 0.0), (role, 1, 0.0)]
    _, removed, _ = _force(model, ex, rows)
    _, kivi2, outs = _force(model, ex, rows, low=True)
    _, fine, _ = _force(model, ex, rows, low=True, formats=(KVFormat(8, "int", "channel", 32), PRESETS["int8"][1]))
    np.testing.assert_allclose(kivi2[0, :t], removed[0, :t], atol=1e-5)  # a variant of no role changes nothing
    start = layer_groups(LAYERS, GROUPS)[1][0]
    for layer in range(start):  # only its group's layers read the bucket at LOW precision
        np.testing.assert_allclose(outs[layer][1, :t], outs[layer][0, :t], atol=1e-6)
    change = lambda logits: np.abs(logits[1, :t] - logits[0, :t]).max()  # noqa: E731
    assert 1e-4 < change(kivi2) < change(removed)  # 2 bits change less than removing the bucket
    assert change(fine) < change(kivi2) / 4  # and 8 bits less still: the variant reads the codes it is given


def test_variant_pass_statistics():
    model, ex = tiny_model(), synthetic_example(4)
    plan, params, arrays = _plan(model), nnx.state(model), item_arrays(ex)
    base = baseline_pass(plan, params, arrays)
    feed = {k: base[k] for k in ("prompt_k", "prompt_v", "first_logits", "outs")}
    role = jnp.array([NO_ROLE, int(PROMPT_ROLES[1])], jnp.int32)
    out = variant_pass(plan, params, arrays, feed, role, jnp.array([0, 1], jnp.int32), jnp.zeros(2, jnp.float32))
    assert float(out["nll"][0]) == pytest.approx(float(base["nll"]), rel=1e-6)
    assert bool(out["error"][0]) == bool(base["error"])
    np.testing.assert_allclose(np.asarray(out["diff_sq"][0]), 0.0, atol=1e-10)
    diff = np.asarray(out["diff_sq"][1])
    assert (diff[:2] < 1e-10).all() and (diff[2:] > 0).all()  # group 1 = layers 2, 3


def _run(examples, **kw) -> CalibrationStats:
    return calibrate_examples(
        tiny_model(), [(e.id, lambda e=e: e) for e in examples], groups=GROUPS, batch=16, progress=False, **kw
    )


def _same(a: CalibrationStats, b: CalibrationStats, atol: float = 0.0) -> None:
    for key, value in vars(a).items():
        if key == "wall_s":
            continue
        if isinstance(value, np.ndarray):
            np.testing.assert_allclose(value, getattr(b, key), atol=atol, err_msg=key)
        elif isinstance(value, float):
            assert value == pytest.approx(getattr(b, key), abs=atol), key
        else:
            assert value == getattr(b, key), key


def test_stats_shapes_and_json_roundtrip(tmp_path):
    stats = _run([synthetic_example(s) for s in range(2)])
    r, g, lv = num_roles(), GROUPS, 4
    assert stats.task_error.shape == (r, g, lv) and stats.distortion.shape == (r, g)
    assert stats.n_items == 2 and stats.item_ids == ["synthetic_0", "synthetic_1"]
    assert (stats.present[int(Role.SINK)] == 2).all() and stats.entries[int(Role.SINK), 0] == 1
    assert (stats.distortion[PROMPT_ROLES[1]] > 0).all() and (stats.distortion_per_entry >= 0).all()
    assert (stats.present[Role.FREE_TEXT] == 0).all() and (stats.task_error[Role.FREE_TEXT] == 0).all()
    stats.save(tmp_path / "stats.json")
    _same(stats, CalibrationStats.load(tmp_path / "stats.json"))


def test_resume_matches_uninterrupted(tmp_path):
    examples = [synthetic_example(s) for s in range(4)]
    built = []

    def tracked(e):
        def build():
            built.append(e.id)
            return e

        return build

    first = calibrate_examples(
        tiny_model(),
        [(e.id, tracked(e)) for e in examples],
        groups=GROUPS,
        batch=16,
        max_items=2,
        checkpoint_dir=tmp_path / "ckpt",
        save_every=1,
        progress=False,
    )
    assert first.n_items == 2
    resumed = calibrate_examples(
        tiny_model(),
        [(e.id, tracked(e)) for e in examples],
        groups=GROUPS,
        batch=16,
        checkpoint_dir=tmp_path / "ckpt",
        progress=False,
    )
    assert built == [e.id for e in examples]  # nothing was recomputed
    _same(resumed, _run(examples))
    with pytest.raises(ValueError, match="checkpoint"):
        calibrate_examples(
            tiny_model(),
            [(e.id, tracked(e)) for e in examples],
            groups=1,
            checkpoint_dir=tmp_path / "ckpt",
            progress=False,
        )


SHARDED_SCRIPT = """
import sys, jax
sys.path.insert(0, {tests!r})
from test_calibration import _run, synthetic_example
assert jax.device_count() == 8, jax.devices()
print("STATS" + _run([synthetic_example(s) for s in range(2)]).to_json())
"""


def test_sharded_over_8_devices_matches_single_device():
    env = os.environ | {"XLA_FLAGS": "--xla_force_host_platform_device_count=8", "JAX_PLATFORMS": "cpu"}
    script = SHARDED_SCRIPT.format(tests=str(Path(__file__).parent))
    proc = subprocess.run(
        [sys.executable, "-c", script],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        cwd=Path(__file__).parents[2],
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    sharded = CalibrationStats.from_json(proc.stdout.split("STATS", 1)[1])
    _same(sharded, _run([synthetic_example(s) for s in range(2)]), atol=1e-5)


def test_end_to_end_real_bfcl_items():
    pytest.importorskip("bfcl_eval")
    from pask_jax.experiments.bfcl import load_answers, load_category, split_items
    from pask_jax.experiments.bfcl.calibration import calibrate, calibration_items, prepare_example
    from pask_jax.models.tokenizer import qwen_tokenizer

    tokenizer, vocab = qwen_tokenizer(), 151936
    parallel = prepare_example(*calibration_items(1, ("parallel",))[0], tokenizer, vocab)
    text = tokenizer.decode(list(parallel.gold))
    assert text.count("<tool_call>") == 2 and text.endswith("</tool_call><|im_end|>")  # two calls, then the end
    assert parallel.gold_roles[0] == Role.FRAMING and parallel.gold_roles[-1] == Role.END_OF_TURN
    assert {Role.FUNCTION_NAME, Role.ARG_KEY, Role.ARG_NUMBER} <= set(parallel.gold_roles.tolist())
    assert parallel.prompt_roles[0] == Role.SINK and Role.REQUEST_TEXT in parallel.prompt_roles
    # text consistency: where the gold tokenisation has "}}\n", the token "}}" stays on the gold text too
    t = next(i for i, g in enumerate(parallel.gold) if tokenizer.decode([int(g)]) == "}}\n")
    (braces,) = tokenizer.encode("}}")
    assert unpack(parallel.consistent[t : t + 1], vocab)[0, [braces, parallel.gold[t]]].all()
    # a non-ASCII enum value: the grammar wants raw UTF-8, not json.dumps' \\uXXXX
    item = next(i for i in load_category("live_parallel_multiple") if i["id"] == "live_parallel_multiple_3-2-1")
    korean = prepare_example(item, load_answers("live_parallel_multiple")[item["id"]], tokenizer, vocab)
    assert "거실" in tokenizer.decode(list(korean.gold))

    items = calibration_items(per_category=1, categories=("simple_python", "multiple"))
    model = Decoder(ModelConfig.tiny(vocab_size=vocab, hidden_size=32, num_layers=LAYERS), rngs=nnx.Rngs(0))
    options = dict(groups=GROUPS, levels=(0.0,), batch=16, progress=False)
    stats = calibrate(model, tokenizer, items, target="canonical", **options)
    assert stats.n_items == 2 and not stats.skipped and stats.target == "canonical"
    assert stats.item_ids == [it["id"] for it, _ in items]
    assert (stats.present[Role.REQUEST_TEXT] == 2).all() and (stats.present[Role.END_OF_TURN] == 0).all()
    assert (stats.distortion[Role.REQUEST_TEXT] > 0).all()
    own = calibrate(model, tokenizer, items[:1], **options)  # the default target: the model's own full-KV call
    assert own.target == "own" and own.item_ids + list(own.skipped) == stats.item_ids[:1]
    assert all("unfinished" in why for why in own.skipped.values())  # a random model may not end its call
    with pytest.raises(ValueError, match="target="):
        calibrate(model, tokenizer, items, target="gold", **options)
    for part in ("dev", "evaluation"):
        item = getattr(split_items("simple_python"), part)[0]
        with pytest.raises(ValueError, match="never be calibrated on"):
            calibrate(model, tokenizer, [(item, {})], progress=False)

    # every item in every regime: BFCL's own prompt and a long one among calibration distractors, both layouts
    regimes = dict(contexts=(0, 768), layouts=("question_last", "question_first"))
    both = calibrate(model, tokenizer, items[:1], target="canonical", **regimes, **options)
    item_id = items[0][0]["id"]
    assert both.item_ids == [
        item_id,
        f"{item_id}@0:question_first",
        f"{item_id}@768:question_last",
        f"{item_id}@768:question_first",
    ]
    assert both.n_items == 4 and (both.present[Role.REQUEST_TEXT] == 4).all()
    short, long = (prepare_example(*items[0], tokenizer, vocab, context=c) for c in (0, 768))
    assert len(short.prompt) < 400 < len(long.prompt) <= 768 and short.gold.tolist() == long.gold.tolist()
    tool_names = [int((ex.prompt_roles == Role.TOOL_NAME).sum()) for ex in (short, long)]
    assert tool_names[1] > 3 * tool_names[0] > 0  # the distractors' names
    with pytest.raises(ValueError, match="layouts="):
        calibrate(model, tokenizer, items, layouts=("middle",), **options)


def test_own_call_target_is_right_at_full_kv():
    """The engine's greedy constrained call, teacher-forced by the passes, has baseline error 0: the passes'
    argmax under the grammar reproduces every token the engine decoded (own-call targets are right by construction)."""
    pytest.importorskip("bfcl_eval")
    from pask_jax.calibration.run import own_call
    from pask_jax.experiments.bfcl.calibration import calibration_items, prepare_example
    from pask_jax.experiments.bfcl.dialect import bfcl_function
    from pask_jax.experiments.bfcl.prompt import bfcl_prompt, bfcl_python_functions
    from pask_jax.models.tokenizer import qwen_tokenizer
    from pask_jax.runtime.engine import Engine
    from pask_jax.runtime.sampling import SamplingConfig
    from pask_jax.structure import GrammarConstraint, compile_grammar

    tokenizer, vocab = qwen_tokenizer(), 151936
    model = Decoder(ModelConfig.tiny(vocab_size=vocab, hidden_size=32, num_layers=LAYERS), rngs=nnx.Rngs(0))
    engine = Engine(model, stop_token_ids=tokenizer.eos_token_ids)
    item, answer = calibration_items(1, ("simple_python",))[0]
    grammar = compile_grammar(
        [bfcl_function(f) for f in bfcl_python_functions(item["function"])], tokenizer, framing="tool_call"
    )
    prompt = tokenizer.encode(bfcl_prompt(item))
    with pytest.raises(ValueError, match="unfinished after 3 tokens"):  # a call takes more than 3 tokens
        own_call(engine, prompt, grammar, max_new_tokens=3)
    # A random model rarely ends its call: take its first 24 greedy tokens (the property holds for any prefix).
    (gen,) = engine.generate(
        [prompt], SamplingConfig(max_new_tokens=24), constraint=GrammarConstraint([grammar], vocab)
    )
    ex = prepare_example(item, None, tokenizer, vocab, gold=gen.tokens)
    assert ex.gold.tolist() == gen.tokens and ex.gold_roles[0] == Role.FRAMING
    base = baseline_pass(_plan(model), nnx.state(model), item_arrays(ex))
    assert not bool(base["error"]) and not bool(base["error_strict"])
    # ...while the canonical rendering of the ground truth is not what this model says
    canonical = prepare_example(item, answer, tokenizer, vocab)
    assert bool(baseline_pass(_plan(model), nnx.state(model), item_arrays(canonical))["error_strict"])
