"""TriAxialKV: entries land in the block pool of their tag (prefill and decode), the tag table's compiler (budget in
bytes, greedy by distortion removed per byte), and the method config that carries the table."""

from __future__ import annotations

import types

import jax.numpy as jnp
import numpy as np
import pytest
from support import BUCKETS, PROMPTS, ROLES, matrix_model, synthetic_stats

from pask_jax.factory import resolve_spec
from pask_jax.methods import TriAxialKV, load_method_config
from pask_jax.methods.kivi import kivi_formats
from pask_jax.runtime.engine import Engine
from pask_jax.runtime.step import StepInput, decode_logits_jit
from pask_jax.storage import Storage, full_entry_bytes
from pask_jax.structure.roles import Role, role_names
from pask_jax.triaxial_table import compile_triaxial_bits, pooled_low_distortion, triaxial_config

INT4_TAGS = ("USER_TEXT", "TEMPLATE")


def test_tags_choose_the_pools_and_bad_tables_fail():
    assert TriAxialKV().storage(0.3, 16).name == "kivi2"  # no table: KIVI-2
    assert TriAxialKV(int4=tuple(role_names())).storage(0.3, 16).name == "kivi4"
    method = TriAxialKV(int4=["USER_TEXT"])  # a config's list
    assert method.int4 == ("USER_TEXT",) and hash(method) == hash(TriAxialKV(int4=("USER_TEXT",)))
    assert method.storage(0.3, 16).name == "kivi4+kivi2"
    roles = jnp.asarray([Role.USER_TEXT, Role.DESCRIPTION, Role.FUNCTION_NAME])
    np.testing.assert_array_equal(method.block_pool(0, roles), [0, 1, 1])
    with pytest.raises(ValueError, match="unknown tag"):
        TriAxialKV(int4=("TOOL_NAMES",))
    with pytest.raises(ValueError, match="residual window of at least a group"):
        TriAxialKV(group=32, residual=16)


def test_entries_land_in_the_pool_of_their_tag():
    """At budget 1 nothing leaves: the prompt's whole blocks go into the pool of their tag at prefill, and the window
    flushes generated entries a block at a time into the pool of theirs; every position stays, once."""
    method = TriAxialKV(int4=INT4_TAGS, group=8, residual=8)
    engine = Engine(matrix_model(), method=method, budget=1.0, num_groups=2, length_buckets=BUCKETS)
    prompt, roles = np.asarray(PROMPTS[0], np.int32), np.asarray(ROLES[0], np.int32)
    _, caches, _ = engine.prefill(prompt[None], np.int32([len(prompt)]), roles[None], engine.capacities(64, 64))
    steps = 30
    for t in range(steps):  # generated entries alternate between an INT4 tag and an INT2 one
        position = len(prompt) + t
        role = Role.TEMPLATE if t % 3 else Role.ARG_STRING
        step = StepInput(*(np.int32([x]) for x in (5 + t, position, role, len(prompt))))
        _, caches, _, _ = decode_logits_jit(engine.plan, engine.params, caches, step)
    int4 = {int(r) for r in (Role.USER_TEXT, Role.TEMPLATE)}
    for cache in caches:
        assert len(cache.block_pools) == 2
        pos, table, length = np.asarray(cache.pos), np.asarray(cache.table), np.asarray(cache.length)
        for idx in np.ndindex(length.shape):  # (layer, row, KV head)
            held = [pos[idx][table[idx][: length[idx]]]]
            for p, pool in enumerate(cache.block_pools):
                live = np.asarray(pool.pos[idx]) >= 0
                tags = set(np.asarray(pool.role[idx])[live].tolist())
                assert tags and (tags <= int4 if p == 0 else not tags & int4), (p, tags)
                held.append(np.asarray(pool.pos[idx])[live])
            held = np.concatenate(held)
            assert sorted(held) == list(range(len(prompt) + steps))
            assert length[idx] < engine.storage.window + engine.storage.block


def _stats(low_storage: str, distortion: dict[Role, float], scale: int = 10) -> types.SimpleNamespace:
    """Synthetic statistics at one LOW precision: the roles' distortion in every layer group, 10x the tokens."""
    stats = synthetic_stats()
    stats.entries = stats.entries * scale
    stats.distortion_low = np.zeros_like(stats.entries)
    for role, d in distortion.items():
        stats.distortion_low[role] = d
    stats.low_storage = low_storage
    return stats


INT2_DISTORTION = {Role.TOOL_NAME: 0.5, Role.USER_TEXT: 0.3, Role.DESCRIPTION: 0.3, Role.TEMPLATE: 0.05}
INT2_DISTORTION[Role.SCHEMA_PUNCT] = 0.2
INT4_DISTORTION = {role: d / 10 for role, d in INT2_DISTORTION.items()} | {Role.SCHEMA_PUNCT: 0.25}  # worse at INT4
HEAD_DIM = 64


def _table_bytes(stats, int4: tuple[str, ...], group: int = 32, residual: int = 128) -> float:
    """Bytes per layer and KV head of an average item held as the table says, the window at its fullest."""
    int2_entry, int4_entry = (
        Storage(blocks=kivi_formats(bits, group, HEAD_DIM)).block_entry_bytes(HEAD_DIM) for bits in (2, 4)
    )
    tokens = stats.entries.mean(axis=1)
    up = sum(tokens[Role[name]] for name in int4)
    window = min(residual + group, tokens.sum())
    slot = Storage().slot_entry_bytes(HEAD_DIM)
    return tokens.sum() * int2_entry + up * (int4_entry - int2_entry) + window * (slot - int2_entry)


def test_compiler_ranks_tags_by_distortion_removed_per_byte_within_the_budget():
    stats2, stats4 = _stats("kivi2", INT2_DISTORTION), _stats("kivi4", INT4_DISTORTION)
    value = pooled_low_distortion(stats2) - pooled_low_distortion(stats4)
    tokens = stats2.entries.mean(axis=1)
    worth = sorted((r for r in range(len(tokens)) if value[r] > 0), key=lambda r: -value[r] / tokens[r])
    ranked = tuple(role_names()[r] for r in worth)
    assert ranked == ("TOOL_NAME", "USER_TEXT", "DESCRIPTION", "TEMPLATE")  # 0.09, 0.018, 0.0045, 0.00225 per token
    assert compile_triaxial_bits(stats2, stats4, 1.0, HEAD_DIM) == ranked  # SCHEMA_PUNCT is worse at INT4: never
    seen = set()
    for budget in np.linspace(0.05, 1.0, 40):
        int4 = compile_triaxial_bits(stats2, stats4, float(budget), HEAD_DIM)
        limit = budget * tokens.sum() * full_entry_bytes(HEAD_DIM)
        if int4:
            assert _table_bytes(stats2, int4) <= limit  # the budget's bytes, window and metadata counted
            assert list(int4) == [name for name in ranked if name in int4]  # taken in rank order
            for name in ranked:  # a tag passed over did not fit beside the ones taken
                if name not in int4:
                    assert _table_bytes(stats2, (*int4, name)) > limit
        elif _table_bytes(stats2, ()) <= limit:  # INT2 everywhere fits, but no upgrade does
            assert _table_bytes(stats2, (ranked[-1],)) > limit
        seen.add(int4)
    assert () in seen and len(seen) >= 4  # INT2 everywhere at the lowest budgets, more tags as the budget grows
    assert compile_triaxial_bits(stats2, stats4, 0.05, HEAD_DIM) == ()  # even INT2 does not fit


def test_compiler_refuses_statistics_that_do_not_fit():
    stats2, stats4 = _stats("kivi2", INT2_DISTORTION), _stats("kivi4", INT4_DISTORTION)
    with pytest.raises(ValueError, match="--low-storage kivi2"):
        compile_triaxial_bits(stats4, stats4, 0.3, HEAD_DIM)
    no_low = synthetic_stats()
    no_low.distortion_low = None
    with pytest.raises(ValueError, match="no LOW precision"):
        compile_triaxial_bits(stats2, no_low, 0.3, HEAD_DIM)
    stats4.model = "another"
    with pytest.raises(ValueError, match="differ in model"):
        compile_triaxial_bits(stats2, stats4, 0.3, HEAD_DIM)


def test_the_table_reaches_the_method_through_a_method_config(tmp_path):
    path = tmp_path / "triaxial.toml"
    path.write_text(triaxial_config(("TOOL_NAME", "ARG_KEY"), "b02", note="budget 0.2"))
    spec = resolve_spec("triaxialkv:b02", load_method_config(path))
    assert TriAxialKV(**spec.overrides).int4 == ("TOOL_NAME", "ARG_KEY")
    path.write_text(triaxial_config(("TOOL_NAMES",)))
    with pytest.raises(ValueError, match="unknown tag"):  # before any model loads
        resolve_spec("triaxialkv", load_method_config(path))


def test_cli_writes_the_table_that_a_run_reads(tmp_path, capsys):
    from pask_jax.cli import main
    from pask_jax.policy_compiler import CalibrationStats

    paths = {}
    for bits, distortion in ((2, INT2_DISTORTION), (4, INT4_DISTORTION)):
        ns = _stats(f"kivi{bits}", distortion)
        stats = CalibrationStats(
            **vars(ns),
            task_error_strict=ns.task_error,
            nll_delta=ns.task_error,
            present=(ns.entries > 0).astype(np.int64),
            baseline_error=0.0,
            baseline_error_strict=0.0,
            baseline_nll=1.0,
            n_items=2,
            skipped={},
            wall_s=0.0,
        )
        paths[bits] = tmp_path / f"int{bits}.json"
        stats.save(paths[bits])
    out = tmp_path / "triaxial.toml"
    table = ["triaxial-table", "--budget", "0.4", "--head-dim", str(HEAD_DIM), "--label", "b04", "--out", str(out)]
    with pytest.raises(SystemExit) as done:
        main([*table, "--int2", str(paths[2]), "--int4", str(paths[4])])
    assert done.value.code == 0
    expected = compile_triaxial_bits(*(CalibrationStats.load(paths[b]) for b in (2, 4)), 0.4, HEAD_DIM)
    assert expected and TriAxialKV(**resolve_spec("triaxialkv:b04", load_method_config(out)).overrides).int4 == expected
    with pytest.raises(SystemExit) as done:  # the statistics swapped: a clear error, status 2
        main([*table, "--int2", str(paths[4]), "--int4", str(paths[2])])
    assert done.value.code == 2 and "--low-storage kivi2" in capsys.readouterr().err
