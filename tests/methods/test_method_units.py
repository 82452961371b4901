"""Per-method unit tests on small hand-built cases: SnapKV, PyramidKV, DapQ, H2O."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from pask_jax import attention as attention_ops
from pask_jax.methods import H2O, METHODS, DapQ, FullKV, PaskKV, PyramidKV, SnapKV
from pask_jax.methods.base import PROTECTED
from pask_jax.methods.h2o import accumulated_attention, fold_recent_window
from pask_jax.methods.pyramidkv import pyramid_fractions
from pask_jax.methods.snapkv import prompt_first_priority, window_attention, window_scores
from pask_jax.models.decoder import Decoder, ModelConfig
from pask_jax.runtime.engine import Engine
from pask_jax.structure.roles import NO_TOOL, Role, num_roles


def softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def random_qk(b=2, t=12, n=4, kv=2, h=8, seed=0):
    rq, rk = np.random.default_rng(seed).standard_normal((2, b, t, n * h)).astype(np.float32)
    return rq.reshape(b, t, n, h), rk[..., : kv * h].reshape(b, t, kv, h)


# ---- SnapKV ----


def snapkv_numpy(q, k, lengths, window, kernel, pooling="max"):
    """Scores of the prefix entries (pooled window attention), per (sequence, KV head): dict -> f32[P - w]."""
    b, t, n, h = q.shape
    kv = k.shape[2]
    g = n // kv
    out = {}
    for s in range(b):
        p = int(lengths[s])
        start = max(p - window, 0)
        for head in range(kv):
            summed = np.zeros(start)
            for i in range(start, p):
                for qh in range(head * g, (head + 1) * g):
                    logits = k[s, : i + 1, head] @ q[s, i, qh] / np.sqrt(h)
                    summed += softmax(logits)[:start]
            windows = [summed[max(j - kernel // 2, 0) : j + kernel // 2 + 1] for j in range(start)]
            if pooling == "max":
                pooled = np.array([w.max() for w in windows], np.float32)
            else:  # zero padding, divided by the whole kernel (avg_pool1d's count_include_pad)
                pooled = np.array([w.sum() / kernel for w in windows], np.float32)
            out[s, head] = pooled
    return out


@pytest.mark.parametrize("pooling", ["max", "avg"])
def test_snapkv_scores_and_pooling_match_numpy(pooling: str):
    q, k = random_qk()
    lengths = np.array([12, 9], np.int32)
    window, kernel = 4, 3
    summed = window_attention(jnp.asarray(q), jnp.asarray(k), 0, jnp.asarray(lengths), window)
    got = np.asarray(window_scores(summed, jnp.asarray(lengths), window, kernel, pooling))
    assert got.shape == (2, 2, 12)
    for (s, head), want in snapkv_numpy(q, k, lengths, window, kernel, pooling).items():
        p = lengths[s]
        np.testing.assert_allclose(got[s, head, : p - window], want, rtol=1e-5, atol=1e-6)
        win = got[s, head, p - window : p]
        assert (win >= PROTECTED).all() and (np.diff(win) > 0).all(), "window kept, newest first"
        assert (got[s, head, p:] == 0).all(), "padding"
    # Through the method hooks, the prompt in three chunks of 4 queries: the same scores
    ctx = SimpleNamespace(lengths=jnp.asarray(lengths))
    method = SnapKV(window=window, kernel=kernel, pooling=pooling)
    shares = [method.prefill_observe(0, jnp.asarray(q[:, i : i + 4]), jnp.asarray(k), i, ctx) for i in (0, 4, 8)]
    (hook,) = method.prefill_scores([sum(shares)], ctx)
    np.testing.assert_allclose(np.asarray(hook), got, rtol=1e-6)


def test_snapkv_prompt_shorter_than_window_is_all_window():
    q, k = random_qk()
    lengths = jnp.asarray([3, 12], jnp.int32)
    got = np.asarray(window_scores(window_attention(jnp.asarray(q), jnp.asarray(k), 0, lengths, 32), lengths, 32, 7))
    assert (got[0, :, :3] >= PROTECTED).all() and (got[0, :, 3:] == 0).all()
    assert (np.diff(got[1], axis=-1) > 0).all()


def test_prefill_only_decode_rule():
    """Prompt entries leave first (lowest score first, window last), then the oldest generated entry."""
    scores = jnp.array([[[0.5, 2e-9, PROTECTED, PROTECTED * 1.001, 11.0, 12.0, 3.0]]], jnp.float32)
    pos = jnp.array([[[0, 1, 2, 3, 11, 10, 4]]], jnp.int32)
    prompt_len = jnp.array([10], jnp.int32)
    order = np.argsort(np.asarray(prompt_first_priority(scores, pos, prompt_len))[0, 0])
    assert order.tolist() == [1, 0, 6, 2, 3, 5, 4]


# ---- PyramidKV ----


def test_pyramid_fractions_follow_the_formula():
    layers, budget, beta = 8, 0.3, 20.0
    f = pyramid_fractions(layers, budget, beta)
    total = budget * layers  # k_total in units of the full length
    top = total / (beta * layers)
    bottom = 2 * total / layers - top
    assert f[-1] == pytest.approx(top) and f[0] == pytest.approx(bottom)
    np.testing.assert_allclose(np.diff(f), (top - bottom) / (layers - 1))  # linear
    assert f.mean() == pytest.approx(budget)
    assert (np.diff(f) < 0).all() and (f > 0).all() and (f <= 1).all()
    np.testing.assert_allclose(PyramidKV().layer_fractions(layers, budget), f)


def test_pyramid_falls_back_to_uniform_when_infeasible():
    beta = 20.0
    edge = beta / (2 * beta - 1)  # layer 0 would need exactly the full length
    assert pyramid_fractions(4, edge, beta)[0] == pytest.approx(1.0)
    for budget in (edge + 1e-3, 0.6, 1.0):
        np.testing.assert_array_equal(pyramid_fractions(4, budget, beta), np.full(4, budget))
    np.testing.assert_array_equal(pyramid_fractions(1, 0.3, beta), [0.3])


@pytest.mark.parametrize("full", [40, 225, 2048])
def test_pyramid_factory_allotment_puts_the_window_on_top_and_keeps_the_mean(full: int):
    layers, budget = 24, 0.33
    factory, inside = PyramidKV(window=32), PyramidKV(window=32, allotment="pyramid")
    f = factory.layer_fractions(layers, budget)
    on_top = np.array([float(factory.keep_allowance(x, budget, full)) for x in f])
    within = np.array([float(inside.keep_allowance(x, budget, full)) for x in f])
    np.testing.assert_allclose(within, f * full, rtol=1e-6)
    np.testing.assert_allclose(on_top.mean(), budget * full, rtol=1e-5)  # the same total budget
    window = min(32, budget * full)
    assert on_top.min() >= window - 1e-4 and on_top[-1] > within[-1]  # every layer keeps its window
    assert (np.diff(on_top) <= 1e-4).all()  # still a pyramid: lower layers keep more
    with pytest.raises(ValueError, match="allotment"):
        PyramidKV(allotment="uniform")


# ---- DapQ ----


def fake_ctx(prompts, t=40, kv_heads=2, layers=3):
    tokens = np.zeros((len(prompts), t), np.int32)
    for i, p in enumerate(prompts):
        tokens[i, : len(p)] = p
    calls = []

    def extra_query_scores(extra_tokens, extra_positions):
        calls.append((np.asarray(extra_tokens), np.asarray(extra_positions)))
        return [jnp.full((len(prompts), kv_heads, t), float(layer)) for layer in range(layers)]

    lengths = jnp.asarray([len(p) for p in prompts], jnp.int32)
    ctx = SimpleNamespace(tokens=jnp.asarray(tokens), lengths=lengths, kv_heads=kv_heads)
    ctx.extra_query_scores = extra_query_scores
    return ctx, calls


def test_dapq_pseudo_queries_content_and_positions():
    prompts = [list(range(100, 137)), list(range(10, 22))]  # P = 37 and 12
    ctx, calls = fake_ctx(prompts)
    scores = DapQ().prefill_scores([None] * 3, ctx)
    assert [float(s[0, 0, 0]) for s in scores] == [0.0, 1.0, 2.0]  # the extra scores, layer by layer
    [(tokens, positions)] = calls
    for row, p in enumerate(prompts):
        assert positions[row].tolist() == list(range(len(p), len(p) + 32))  # P .. P + N - 1
        last = [p[max(j, 0)] for j in range(len(p) - 28, len(p))]  # short prompts: clipped to the first token
        assert tokens[row].tolist() == p[:4] + last
    ctx, calls = fake_ctx(prompts)
    DapQ(num_pseudo=8, content="last", position_offset=5).prefill_scores([None] * 3, ctx)
    [(tokens, positions)] = calls
    assert positions[0].tolist() == list(range(42, 50)) and tokens[0].tolist() == prompts[0][-8:]
    ctx, calls = fake_ctx(prompts)
    DapQ(num_pseudo=8, content="random", seed=3).prefill_scores([None] * 3, ctx)
    tokens, positions = calls[0]
    assert all(t in prompts[row] for row in range(2) for t in tokens[row].tolist())
    with pytest.raises(ValueError):
        DapQ(content="middle")


def test_dapq_pooling_spreads_a_peak_to_its_neighbours_inside_the_prompt():
    prompts = [list(range(1, 13))]  # P = 12 of T = 16
    ctx, _ = fake_ctx(prompts, t=16, kv_heads=1, layers=1)
    spike = jnp.zeros((1, 1, 16)).at[0, 0, 5].set(1.0).at[0, 0, 14].set(9.0)  # 14 is padding
    ctx.extra_query_scores = lambda *_: [spike]
    (raw,) = DapQ().prefill_scores([None], ctx)
    np.testing.assert_array_equal(raw, spike)  # no pooling: the paper's scores as they are
    (pooled,) = DapQ(pooling="max", kernel=3).prefill_scores([None], ctx)
    assert np.asarray(pooled)[0, 0].tolist() == [0, 0, 0, 0, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0]
    (averaged,) = DapQ(pooling="avg", kernel=3).prefill_scores([None], ctx)
    np.testing.assert_allclose(np.asarray(averaged)[0, 0, 4:7], [1 / 3] * 3)
    assert float(np.asarray(averaged)[0, 0, 12:].max()) == 0.0  # padding stays out
    with pytest.raises(ValueError, match="pooling"):
        DapQ(pooling="mean")


@pytest.fixture(scope="module")
def tiny_model() -> Decoder:
    return Decoder(ModelConfig.tiny("qwen3", num_layers=2, vocab_size=128), rngs=nnx.Rngs(3))


def test_dapq_pseudo_kv_never_reaches_the_cache(tiny_model: Decoder):
    lengths = np.array([13, 7], np.int32)
    tokens = np.zeros((2, 16), np.int32)
    for i, n in enumerate(lengths):
        tokens[i, :n] = np.arange(5, 5 + n) * (i + 2) % 128
    roles = np.zeros_like(tokens)
    engine = Engine(tiny_model, method=DapQ(num_pseudo=6), budget=0.5, num_groups=1, length_buckets=(16,))
    logits, caches, kept = engine.prefill(tokens, lengths, roles, engine.capacities(16, 64))
    (cache,) = caches
    pos, length, table = np.asarray(cache.pos), np.asarray(cache.length), np.asarray(cache.table)
    for idx in np.ndindex(length.shape):
        live = pos[idx][table[idx][: length[idx]]]
        assert length[idx] == np.floor(engine.plan.bytes.slot_entries(0.5 * lengths[idx[1]]))  # bytes, metadata counted
        assert (live >= 0).all() and (live < lengths[idx[1]]).all(), "only prompt positions are cached"
    full = Engine(tiny_model, num_groups=1, length_buckets=(16,))
    full_logits, _, _ = full.prefill(tokens, lengths, roles, full.capacities(16, 64))
    np.testing.assert_allclose(np.asarray(logits), np.asarray(full_logits), rtol=1e-5, atol=1e-5)


# ---- H2O ----


def test_h2o_accumulates_over_decode_steps():
    rng = np.random.default_rng(1)
    scores = rng.random((2, 2, 5)).astype(np.float32)
    probs = [softmax(rng.standard_normal((2, 2, 3, 5))).astype(np.float32) for _ in range(2)]
    method = H2O()
    assert H2O.needs_decode_attention
    got = scores
    for p in probs:
        got = method.update_scores(0, jnp.asarray(got), jnp.asarray(p))
    np.testing.assert_allclose(np.asarray(got), scores + probs[0].sum(2) + probs[1].sum(2), rtol=1e-6)
    np.testing.assert_array_equal(np.asarray(method.new_token_score(0, jnp.array([7, 9]), jnp.zeros(2, int), 2)), 0)


@pytest.mark.parametrize("query_chunk", [512, 2, 4])  # one block; three blocks; two blocks over 2 padded positions
def test_h2o_prefill_is_column_sums_of_causal_attention(monkeypatch, query_chunk):
    monkeypatch.setattr(attention_ops, "QUERY_CHUNK", query_chunk)
    q, k = random_qk(t=6, seed=2)
    lengths = np.array([6, 4], np.int32)
    positions = np.broadcast_to(np.arange(6), (2, 6))
    valid = jnp.asarray(positions < lengths[:, None])
    ctx = SimpleNamespace(positions=jnp.asarray(positions), valid=valid, lengths=jnp.asarray(lengths))
    got = np.asarray(accumulated_attention(jnp.asarray(q), jnp.asarray(k), ctx))
    # the prompt's queries in chunks of 2 and 4 at their positions, against all its keys: the same column sums
    for chunk in (2, 4):
        shares = [
            accumulated_attention(jnp.asarray(q[:, i : i + chunk]), jnp.asarray(k), ctx, i) for i in range(0, 6, chunk)
        ]
        np.testing.assert_allclose(np.asarray(sum(shares)), got, rtol=1e-5, atol=1e-6)
    for s in range(2):
        for head in range(2):
            want = np.zeros(6)
            for i in range(lengths[s]):
                for qh in (2 * head, 2 * head + 1):
                    want[: i + 1] += softmax(k[s, : i + 1, head] @ q[s, i, qh] / np.sqrt(8))
            np.testing.assert_allclose(got[s, head], want, rtol=1e-5, atol=1e-6)


def test_h2o_prefill_keeps_half_recent_half_heavy():
    p = 10
    acc = jnp.asarray(np.arange(p, 0, -1, dtype=np.float32)[None, None])  # older tokens are heavier
    ranked = fold_recent_window(acc, jnp.array([p]), 0.5)
    for m in range(1, p // 2 + 1):
        keep = set(np.asarray(jax.lax.top_k(ranked, 2 * m)[1])[0, 0].tolist())
        assert keep == set(range(m)) | set(range(p - m, p)), m


def test_h2o_decode_protects_the_recent_window():
    pos = jnp.array([[[0, 1, 2, 3, 4, 5, 6, 7, 8, -1]]], jnp.int32)  # 9 live: 8 stay, the 4 most recent protected
    scores = jnp.array([[[5.0, 0.1, 3.0, 2.0, 4.0, 0.0, 0.2, 0.3, 0.05, 0.0]]])
    priority = np.asarray(H2O().eviction_priority(0, scores, pos, pos, jnp.array([8]), jnp.array([4])))[0, 0]
    assert (priority[5:9] == PROTECTED).all()
    assert int(np.argmin(np.where(np.asarray(pos)[0, 0] >= 0, priority, np.inf))) == 1


def test_methods_are_registered_and_hashable():
    for name in ("h2o", "snapkv", "pyramidkv", "dapq"):
        assert METHODS[name]().name == name
    for method in (H2O(), SnapKV(), PyramidKV(), DapQ(), FullKV()):
        assert method == type(method)() and hash(method) == hash(type(method)())


def test_a_method_config_file_layers_on_the_packaged_defaults(tmp_path):
    from pask_jax.methods import load_method_config

    path = tmp_path / "sweep.toml"
    path.write_text('[snapkv]\nwindow = 8\n["snapkv:avg"]\npooling = "avg"\n')
    packaged, layered = load_method_config(), load_method_config(path)
    assert all(":" in section for section in packaged)  # defaults live in the dataclasses; the file holds variants
    for section, values in packaged.items():  # and every variant changes a field its method has
        assert set(values) <= {f.name for f in dataclasses.fields(METHODS[section.partition(":")[0]])}, section
    assert layered["snapkv"] == {"window": 8} and layered["snapkv:avg"] == {"pooling": "avg"}
    assert layered["pask:v1"] == packaged["pask:v1"]
    path.write_text("[snapkvv]\nwindow = 8\n")
    with pytest.raises(ValueError, match="unknown method"):
        load_method_config(path)


def _pask_prefill(
    method, roles: list[int], dapq: list[float], window: list[float] | None = None, tools: list[int] | None = None
) -> np.ndarray:
    """PASK's prefill scores (one layer, one sequence, one KV head) of a prompt with these roles, DapQ giving
    `dapq` to its entries (and SnapKV's observation window `window`; `tools`: the tool each entry describes)."""
    t = len(roles)
    ctx, _ = fake_ctx([list(range(1, t + 1))], t=t, kv_heads=1, layers=1)
    ctx.positions = jnp.arange(t)[None]
    ctx.valid = jnp.ones((1, t), bool)
    ctx.roles = jnp.asarray([[int(x) for x in roles]], jnp.int32)
    ctx.tools = None if tools is None else jnp.asarray([tools], jnp.int32)
    ctx.extra_query_scores = lambda *_: [jnp.asarray(dapq, jnp.float32)[None, None]]
    observed = None if window is None else jnp.asarray(window, jnp.float32)[None, None]
    return np.asarray(method.prefill_scores([observed], ctx)[0])[0, 0]


def test_pask_rank_pooling_and_system_as_request_options():
    from pask_jax.methods.pask import POSITION_RANGE, TIER

    r = len(Role)
    floor, priority = np.zeros((r, 1)), np.zeros((r, 1))
    floor[Role.REQUEST_TEXT], priority[Role.REQUEST_TEXT] = 1.0, 0.5
    priority[Role.PARAM_NAME], priority[Role.DESCRIPTION] = 0.5, 0.25
    tables = dict(
        floor=tuple(map(tuple, floor)),
        priority=tuple(map(tuple, priority)),
        retain=((True,),) * r,
        group_fractions=(0.5,),
        layer_group=(0,),
    )
    S, U, P, D = Role.SINK, Role.REQUEST_TEXT, Role.PARAM_NAME, Role.DESCRIPTION
    roles = [S, Role.SYSTEM_TEXT, Role.SYSTEM_TEXT, P, P, D, D, U]
    dapq = [0.0, 0.1, 0.2, 0.9, 0.1, 0.8, 0.3, 0.0]  # what the coming call attends to
    level = lambda score: np.floor(score / POSITION_RANGE)  # noqa: E731

    recency = _pask_prefill(PaskKV(**tables, rank="recency", system_as_request=False), roles, dapq)
    assert level(recency[1:3]).tolist() == [0, 0] and level(recency[7]) == TIER + 32  # system text: nothing
    assert recency[4] > recency[3] and recency[6] > recency[5]  # inside a level, the later entry stays
    request = _pask_prefill(PaskKV(**tables, rank="recency"), roles, dapq)
    np.testing.assert_array_equal(level(request[1:3]), level(recency[7]))  # now floor-protected as the user's turn
    ranked = _pask_prefill(PaskKV(**tables, rank="dapq", pooling="none", system_as_request=False), roles, dapq)
    assert ranked[3] > ranked[4] and ranked[5] > ranked[6]  # inside a level, DapQ's order
    assert ranked[4] > ranked[5]  # levels still first: a parameter name outranks every description
    tier = _pask_prefill(PaskKV(**tables, pooling="none", system_as_request=False), roles, dapq)
    unprotected = [3, 4, 5, 6]
    assert sorted(unprotected, key=lambda i: tier[i]) == [4, 6, 5, 3]  # DapQ alone orders the unprotected
    assert tier[7] > tier[unprotected].max()  # the floor-protected user text stays above all of them
    pooled = _pask_prefill(PaskKV(**tables, pooling="max", system_as_request=False), roles, dapq)
    # max-pooled over 7 keys, entries 3-6 all see DapQ's 0.9: ties, broken by position
    assert sorted(unprotected, key=lambda i: pooled[i]) == [3, 4, 5, 6]
    window = [0.0, 0.0, 0.0, 0.1, 0.7, 0.2, 0.9, 0.5]  # what the prompt's last tokens attend to
    by_window = _pask_prefill(PaskKV(**tables, pooling="none", query="window"), roles, dapq, window)
    assert sorted(unprotected, key=lambda i: by_window[i]) == [3, 5, 4, 6]  # the window alone orders them
    both = _pask_prefill(PaskKV(**tables, pooling="none", query="both"), roles, dapq, window)
    assert sorted(unprotected, key=lambda i: both[i]) == [4, 5, 6, 3]  # the higher rank, ties by the pseudo queries
    tools = [NO_TOOL, NO_TOOL, NO_TOOL, 0, 0, 1, 1, NO_TOOL]  # two tools of two entries each
    whole_tools = PaskKV(**tables, pooling="none", granularity="tool", system_as_request=False)
    whole = _pask_prefill(whole_tools, roles, dapq, tools=tools)
    assert sorted(unprotected, key=lambda i: whole[i]) == [6, 5, 4, 3]  # tool 1 (best 0.8) below tool 0 (0.9)
    np.testing.assert_array_equal(level(whole), level(tier))  # the policy's levels unchanged: the order moved
    no_tools = _pask_prefill(whole_tools, roles, dapq)
    np.testing.assert_array_equal(no_tools, tier)  # without tool indices: each entry by its own score
    assert not PaskKV().needs_prefill_attention and PaskKV(query="both").needs_prefill_attention
    with pytest.raises(ValueError, match="query"):
        PaskKV(query="last")
    with pytest.raises(ValueError, match="granularity"):
        PaskKV(granularity="token")
    with pytest.raises(ValueError, match="granularity"):
        PaskKV(rank="recency", granularity="tool")
    with pytest.raises(ValueError, match="rank"):
        PaskKV(rank="attention")
    with pytest.raises(ValueError, match="pooling"):
        PaskKV(pooling="sum")


def test_a_v1_policy_scores_the_request_as_it_scored_user_text():
    """The shipped policies are pask-roles-v1: a prompt labelled in v2 (the user's turn REQUEST_TEXT) gets the same
    scores as its v1 labels (USER_TEXT) did, so the first PASK's results stand under the new labels."""
    from pask_jax.policy import SHIPPED_POLICIES, PersistencePolicy

    policy = PersistencePolicy.load(SHIPPED_POLICIES / "qwen2.5-coder-0.5b")
    method = PaskKV.from_policy(policy, 0.33, rank="recency", system_as_request=False)
    S, U, D, P = Role.SINK, Role.USER_TEXT, Role.DESCRIPTION, Role.PARAM_NAME
    v1 = [S, D, D, P, U, U, U, D, U, U]
    dapq = [0.0] * len(v1)
    old = _pask_prefill(method, v1, dapq)
    for stand_in in (Role.REQUEST_TEXT, Role.HISTORY_TEXT, Role.TOOL_RESULT):
        np.testing.assert_array_equal(_pask_prefill(method, [stand_in if r == U else r for r in v1], dapq), old)
    as_system = _pask_prefill(method, [Role.SYSTEM_TEXT if r == U else r for r in v1], dapq)
    assert not np.array_equal(as_system, old)  # the user's text has its own floor in this policy


@pytest.mark.parametrize("seed", range(3))
def test_floor_protected_matches_a_loop(seed: int):
    """Per (sequence, head, role): exactly the ceil(floor * n) valid entries highest in the order, nothing padded."""
    from pask_jax.methods.pask import floor_protected

    rng = np.random.default_rng(seed)
    b, k, t, r = 2, 2, 23, num_roles()
    roles = rng.integers(0, 4, (b, t))  # few roles: several entries each
    valid = np.arange(t)[None] < np.asarray([[t], [t - 5]])
    order = np.stack([np.stack([rng.permutation(t) for _ in range(k)]) for _ in range(b)]).astype(np.float32)
    floor = rng.choice([0.0, 0.3, 0.5, 1.0], r).astype(np.float32)
    got = np.asarray(floor_protected(jnp.asarray(roles), jnp.asarray(valid), jnp.asarray(order), jnp.asarray(floor)))
    want = np.zeros((b, k, t), bool)
    for i in range(b):
        for h in range(k):
            for role in range(r):
                idx = [x for x in range(t) if valid[i, x] and roles[i, x] == role]
                top = sorted(idx, key=lambda x: -order[i, h, x])[: int(np.ceil(floor[role] * len(idx)))]
                want[i, h, top] = True
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("seed", range(2))
def test_rank_by_tool_matches_a_loop(seed: int):
    """Per (sequence, head): entries sorted by their tool's best score (their own outside tools), then their own."""
    from pask_jax.methods.pask import rank_by_tool

    rng = np.random.default_rng(seed)
    b, k, t = 2, 2, 19
    scores = rng.random((b, k, t)).astype(np.float32)
    tools = rng.integers(NO_TOOL, 4, (b, t))
    got = np.asarray(rank_by_tool(jnp.asarray(scores), jnp.asarray(tools, jnp.int32)))
    for i in range(b):
        for h in range(k):
            s = scores[i, h]
            best = {j: s[tools[i] == j].max() for j in set(tools[i].tolist()) - {NO_TOOL}}
            unit = [s[x] if tools[i, x] == NO_TOOL else best[tools[i, x]] for x in range(t)]
            want = sorted(range(t), key=lambda x: (unit[x], s[x]))
            assert np.argsort(got[i, h]).tolist() == want


def test_pask_floor_order_query_protects_what_the_query_attends_to():
    """A half floor on a request: "recency" protects its later half, "query" the half DapQ ranks highest."""
    from pask_jax.methods.pask import POSITION_RANGE, TIER

    r = len(Role)
    floor = np.zeros((r, 1))
    floor[Role.REQUEST_TEXT] = 0.5
    tables = dict(
        floor=tuple(map(tuple, floor)),
        priority=tuple(map(tuple, np.zeros((r, 1)))),
        retain=((True,),) * r,
        group_fractions=(0.5,),
        layer_group=(0,),
    )
    roles = [Role.SINK] + [Role.REQUEST_TEXT] * 6
    dapq = [0.0, 0.9, 0.1, 0.8, 0.2, 0.7, 0.3]  # the early, odd entries are what the answer needs
    tier = lambda scores: (np.floor(scores / POSITION_RANGE) // TIER)[1:].tolist()  # noqa: E731
    recent = _pask_prefill(PaskKV(**tables, pooling="none"), roles, dapq)
    assert tier(recent) == [0, 0, 0, 1, 1, 1]
    query = _pask_prefill(PaskKV(**tables, pooling="none", floor_order="query"), roles, dapq)
    assert tier(query) == [1, 0, 1, 0, 1, 0]
    with pytest.raises(ValueError, match="floor_order"):
        PaskKV(rank="recency", floor_order="query")
    with pytest.raises(ValueError, match="floor_order"):
        PaskKV(floor_order="oldest")


def test_pask_actions_hold_high_buckets_in_slots_low_in_blocks_and_release_first():
    """A hand action table (USER_TEXT RETAIN_HIGH, DESCRIPTION RELEASE, the rest RETAIN_LOW) at b = 0.4, releasing
    first: prefill keeps
    every USER_TEXT entry, the sink and the newest USER_TEXT entries in the full-precision slots (the window of 8),
    the other kept entries in 2-bit blocks, and lets DESCRIPTION go before anything else."""
    from support import BUCKETS, LOW_GROUP, PROMPTS, ROLES, matrix_model

    from pask_jax.policy_compiler import RELEASE, RETAIN_HIGH, RETAIN_LOW

    action = [[RETAIN_LOW] * 2 for _ in range(num_roles())]
    action[Role.USER_TEXT], action[Role.DESCRIPTION] = [RETAIN_HIGH] * 2, [RELEASE] * 2
    method = PaskKV(  # ranked by recency inside a tier, so which USER_TEXT entries stay in slots is known
        action=tuple(map(tuple, action)),
        layer_group=(0, 0, 1, 1),
        high_window=8,
        low_group=LOW_GROUP,
        rank="recency",
        release_first=True,
    )
    engine = Engine(matrix_model(), method=method, budget=0.4, num_groups=2, length_buckets=BUCKETS)
    assert engine.storage.window == 8 and engine.storage.block == LOW_GROUP
    prompt, roles = np.asarray(PROMPTS[0], np.int32), np.asarray(ROLES[0], np.int32)
    _, caches, _ = engine.prefill(prompt[None], np.int32([len(prompt)]), roles[None], engine.capacities(64, 8))
    user = set(np.flatnonzero(roles == Role.USER_TEXT))
    for cache in caches:
        pos, table, length = np.asarray(cache.pos), np.asarray(cache.table), np.asarray(cache.length)
        block_pos = np.asarray(cache.blocks.pos)
        for idx in np.ndindex(length.shape):  # (layer, row, KV head)
            slots = pos[idx][table[idx][: length[idx]]]
            blocks = block_pos[idx][block_pos[idx] >= 0]
            assert len(slots) == 8 and set(roles[slots]) <= {Role.SINK, Role.USER_TEXT}
            assert 0 in slots and set(slots) - {0} == set(sorted(user)[-7:])  # the sink, the newest USER_TEXT
            assert user <= set(slots) | set(blocks)  # every RETAIN_HIGH entry is kept
            dropped = set(range(len(prompt))) - set(slots) - set(blocks)
            assert dropped and set(roles[list(dropped)]) == {Role.DESCRIPTION}  # RELEASE leaves first


def test_pask_actions_keep_released_buckets_at_low_precision_unless_released_first():
    """By default RELEASE entries count as retained at prefill (all go down to blocks before any leaves), so the same
    bytes hold more entries than with `release_first`, where they leave first and pay for full-precision slots."""
    from support import BUCKETS, LOW_GROUP, PROMPTS, ROLES, matrix_model

    from pask_jax.policy_compiler import RELEASE, RETAIN_HIGH, RETAIN_LOW

    action = [[RETAIN_LOW] * 2 for _ in range(num_roles())]
    action[Role.USER_TEXT], action[Role.DESCRIPTION] = [RETAIN_HIGH] * 2, [RELEASE] * 2
    prompt, roles = np.asarray(PROMPTS[0], np.int32), np.asarray(ROLES[0], np.int32)
    kept = {}
    for release_first in (True, False):
        method = PaskKV(action=tuple(map(tuple, action)), layer_group=(0, 0, 1, 1), high_window=8, low_group=LOW_GROUP)
        method = dataclasses.replace(method, release_first=release_first)
        assert (method.release_line(0) == -np.inf) is not release_first
        engine = Engine(matrix_model(), method=method, budget=0.4, num_groups=2, length_buckets=BUCKETS)
        _, caches, _ = engine.prefill(prompt[None], np.int32([len(prompt)]), roles[None], engine.capacities(64, 8))
        kept[release_first] = [int(np.asarray(c.length).sum() + (np.asarray(c.blocks.pos) >= 0).sum()) for c in caches]
    assert all(k > r for k, r in zip(kept[False], kept[True], strict=True))


def test_pask_actions_fill_window_keeps_low_entries_at_full_precision_where_bytes_allow():
    """With `fill_window`, prefill leaves the window full of the highest-ranked entries (HIGH first, then LOW by
    rank); without it only the HIGH bucket's entries (the sink) sit in slots, besides the remainder of a block."""
    from support import BUCKETS, LOW_GROUP, PROMPTS, ROLES, matrix_model

    from pask_jax.policy_compiler import RETAIN_HIGH, RETAIN_LOW

    action = [[RETAIN_LOW] * 2 for _ in range(num_roles())]
    action[Role.SINK] = [RETAIN_HIGH] * 2
    prompt, roles = np.asarray(PROMPTS[0], np.int32), np.asarray(ROLES[0], np.int32)
    in_slots = {}
    for fill in (False, True):
        method = PaskKV(
            action=tuple(map(tuple, action)),
            layer_group=(0, 0, 1, 1),
            high_window=8,
            low_group=LOW_GROUP,
            fill_window=fill,
        )
        engine = Engine(matrix_model(), method=method, budget=1.0, num_groups=2, length_buckets=BUCKETS)
        _, caches, _ = engine.prefill(prompt[None], np.int32([len(prompt)]), roles[None], engine.capacities(64, 8))
        in_slots[fill] = [np.asarray(c.length) for c in caches]
        for cache in caches:  # nothing left out at budget 1
            kept = np.asarray(cache.length).sum() + (np.asarray(cache.blocks.pos) >= 0).sum()
            assert kept == len(prompt) * np.asarray(cache.length).size
    # slots = what prefill leaves at full precision + the remainder that does not fill a block
    sinks, window, n = int((roles == Role.SINK).sum()), 8, len(prompt)
    expected = {False: sinks + (n - sinks) % LOW_GROUP, True: window + (n - window) % LOW_GROUP}
    assert expected[True] > expected[False]
    for fill, lengths in in_slots.items():
        assert all((length == expected[fill]).all() for length in lengths), (fill, lengths)


def test_pask_two_pools_put_each_bucket_in_the_pool_of_its_action_per_layer_group():
    """HIGH a 4-bit block pool: at budget 1 every entry stays, USER_TEXT's in the 4-bit pool where its action is
    RETAIN_HIGH (layer group 0) and in the 2-bit pool where it is RETAIN_LOW (group 1), everything else 2-bit, the
    window of the newest entries at full precision; at b = 0.4 RELEASE (DESCRIPTION) entries are the ones left out."""
    from support import BUCKETS, LOW_GROUP, PROMPTS, ROLES, matrix_model

    from pask_jax.policy_compiler import RELEASE, RETAIN_HIGH, RETAIN_LOW

    action = [[RETAIN_LOW] * 2 for _ in range(num_roles())]
    action[Role.USER_TEXT], action[Role.DESCRIPTION] = [RETAIN_HIGH, RETAIN_LOW], [RELEASE] * 2
    method = PaskKV(
        action=tuple(map(tuple, action)),
        layer_group=(0, 0, 1, 1),
        high_window=8,
        low_group=LOW_GROUP,
        high_storage="kivi4",
    )
    with pytest.raises(ValueError, match="high_window >= low_group"):
        dataclasses.replace(method, high_window=4)
    with pytest.raises(ValueError, match="other than low_storage"):
        dataclasses.replace(method, high_storage="kivi2")
    prompt, roles = np.asarray(PROMPTS[0], np.int32), np.asarray(ROLES[0], np.int32)
    for budget in (1.0, 0.4):
        engine = Engine(matrix_model(), method=method, budget=budget, num_groups=2, length_buckets=BUCKETS)
        assert engine.storage.name == "kivi4+kivi2" and engine.storage.window == 8
        _, caches, _ = engine.prefill(prompt[None], np.int32([len(prompt)]), roles[None], engine.capacities(64, 8))
        for g, cache in enumerate(caches):
            pos, table, length = np.asarray(cache.pos), np.asarray(cache.table), np.asarray(cache.length)
            for idx in np.ndindex(length.shape):  # (layer, row, KV head)
                slots = pos[idx][table[idx][: length[idx]]]
                pools = [np.asarray(p.pos[idx])[np.asarray(p.pos[idx]) >= 0] for p in cache.block_pools]
                high = {int(Role.USER_TEXT)} if g == 0 else set()
                assert set(roles[pools[0]]) <= high and not set(roles[pools[1]]) & high, (g, idx)
                kept = np.concatenate([slots, *pools])
                assert len(set(kept)) == len(kept)
                if budget == 1.0:
                    assert sorted(kept) == list(range(len(prompt))) and len(slots) < 8 + LOW_GROUP
                    assert g == 1 or len(pools[0]) > 0  # group 0's USER_TEXT blocks filled
                else:
                    dropped = set(range(len(prompt))) - set(kept)
                    assert dropped and set(roles[list(dropped)]) == {Role.DESCRIPTION}
