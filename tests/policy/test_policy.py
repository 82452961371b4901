"""Policy compiler and the online PASK method: budgets, floors, priorities, precision actions, save/load (formats v1
and v2), statistics carried and any budget compiled on load, fingerprint mismatches."""

from __future__ import annotations

import dataclasses
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import synthetic_stats
from flax import nnx

from pask_jax.calibration.compiler import compile_policy
from pask_jax.methods import make_method
from pask_jax.methods.pask import PaskKV
from pask_jax.models.decoder import Decoder, ModelConfig
from pask_jax.policy import (
    SHIPPED_POLICIES,
    ModelFingerprint,
    PersistencePolicy,
    PolicyError,
    find_shipped_policy,
    resolve_policy,
)
from pask_jax.policy_compiler import (
    RELEASE,
    RETAIN_HIGH,
    RETAIN_LOW,
    CalibrationStats,
    CompileOptions,
    compile_table,
    compile_tables,
    pooled_stats,
    with_high_precision,
)
from pask_jax.runtime.engine import Engine
from pask_jax.structure.roles import Role, num_roles

REPO = Path(__file__).parents[2]
EXPERIMENTAL_POLICIES = REPO / "results" / "policies"  # experimental and ablation policies (not shipped)
R, G = num_roles(), 2
SHIPPED = SHIPPED_POLICIES / "qwen2.5-coder-0.5b"
SHIPPED_STATS = REPO / "results" / "calibration_qwen2.5-coder-0.5b_schema36.json"  # what the shipped tables came from
SHIPPED_HASH = "b2bbfa9da9e3fa48"  # the shipped policy's content hash, as published results name it
OWN16_STATS = REPO / "results" / "calibration_qwen2.5-coder-0.5b_own16.json"  # item-hash split, 16 items


def synthetic_calibration() -> CalibrationStats:
    """conftest's synthetic statistics as a full `CalibrationStats` (what a saved policy carries)."""
    s = synthetic_stats()
    zeros = np.zeros_like(s.task_error)
    return CalibrationStats(
        task_error=s.task_error,
        task_error_strict=zeros,
        nll_delta=zeros,
        distortion=s.distortion_per_entry * s.entries,
        distortion_per_entry=s.distortion_per_entry,
        entries=s.entries,
        present=(s.entries > 0).astype(np.int64),
        baseline_error=0.0,
        baseline_error_strict=0.0,
        baseline_nll=1.0,
        n_items=len(s.item_ids),
        model=s.model,
        num_layers=s.num_layers,
        groups=s.groups,
        levels=s.levels,
        taxonomy=s.taxonomy,
        item_ids=s.item_ids,
        skipped={},
        wall_s=0.0,
        target="own",
    )


def _same_table(a, b, atol: float = 0.0) -> None:
    assert a.budget == b.budget
    for field in ("floor", "priority", "retain", "group_fractions"):
        np.testing.assert_allclose(getattr(a, field), getattr(b, field), atol=atol, rtol=0, err_msg=field)


@pytest.mark.parametrize("budget", [0.2, 0.33, 0.5, 1.0])
def test_table_obeys_budget_and_floors(budget: float):
    stats = synthetic_stats()
    table = compile_table(stats, budget)
    table.validate(R, G)
    assert table.group_fractions.mean() <= budget + 1e-6
    assert (table.group_fractions >= budget / 2 - 1e-6).all() and (table.group_fractions <= 2 * budget + 1e-6).all()
    assert table.floor[Role.USER_TEXT].tolist() == [0.75, 0.75]  # the smallest level within tolerance
    assert table.floor[Role.TOOL_NAME].tolist() == [0.25, 0.25]
    assert (table.floor[Role.DESCRIPTION] == 0).all()
    floor_cost = (table.floor * stats.entries).sum(0)
    assert (floor_cost <= table.group_fractions * stats.entries.sum(0) + 1e-6).all()
    assert (table.priority[Role.TOOL_NAME] > table.priority[Role.DESCRIPTION]).all()


def test_infeasible_floors_give_way_least_sensitive_first():
    stats = synthetic_stats()
    stats.task_error[Role.DESCRIPTION] = [[0.01, 0.01, 0.01, 0.5]] * G  # wants floor 1.0 but barely matters
    stats.task_error[Role.DESCRIPTION, :, 0] = 0.05
    table = compile_table(stats, 0.2)
    assert table.floor[Role.USER_TEXT].tolist() == [0.75, 0.75]
    assert (table.floor[Role.DESCRIPTION] < 1.0).all()
    assert ((table.floor * stats.entries).sum(0) <= 0.2 * stats.entries.sum(0) + 1e-6).all()


def test_floors_give_way_per_entry():
    """A large bucket whose removal hurts more in total but less per entry (descriptions) yields to a small one."""
    stats = synthetic_stats()
    stats.task_error[Role.DESCRIPTION] = [[0.4, 0.4, 0.4, 0.4]] * G  # wants floor 1.0: 60 of 140 entries
    stats.task_error[Role.TOOL_NAME] = [[0.3, 0.3, 0.3, 0.3]] * G  # wants floor 1.0: 5 entries
    table = compile_table(stats, 0.33)
    assert table.floor[Role.TOOL_NAME].tolist() == [1.0, 1.0] and (table.floor[Role.DESCRIPTION] < 1.0).all()
    floor_cost = (table.floor * stats.entries).sum(0)
    assert (floor_cost <= 0.33 * stats.entries.sum(0) + 1e-6).all()


def test_floors_stay_within_floor_share():
    stats = synthetic_stats()
    for floor_share in (0.0, 0.25):
        table = compile_table(stats, 0.2, floor_share=floor_share)
        floor_cost = (table.floor * stats.entries).sum(0)
        assert (floor_cost <= floor_share * 0.2 * stats.entries.sum(0) + 1e-6).all()
        assert table.group_fractions.mean() == pytest.approx(0.2, abs=1e-3)  # the rest goes by distortion
    # 7 of 28 entries per group. Per entry, user text (0.5 / 15) is less sensitive than tool names (0.3 / 5): it
    # gives way first, down to (7 - 0.25 x 5) / 15.
    table = compile_table(stats, 0.2, floor_share=0.25)
    np.testing.assert_allclose(table.floor[Role.USER_TEXT], 5.75 / 15, atol=1e-6)
    assert table.floor[Role.TOOL_NAME].tolist() == [0.25, 0.25]
    with pytest.raises(ValueError, match="floor_share"):
        compile_table(stats, 0.33, floor_share=1.5)


def test_group_shares_bounded_when_one_group_scores_higher():
    """Per-group-constant values (the one_role ablation's shape) must not hand one group everything."""
    stats = synthetic_stats()
    stats.task_error[:] = 0.0
    stats.distortion_per_entry = np.tile([[1.0, 0.01]], (R, 1))  # group 0 outscores group 1 on every role
    table = compile_table(stats, 0.33)
    np.testing.assert_allclose(table.group_fractions, [0.495, 0.165], atol=1e-6)  # 2b - b/2 moved, b/2 left
    table = compile_table(stats, 0.7)
    np.testing.assert_allclose(table.group_fractions, [1.0, 0.4], atol=1e-6)  # capped at all of group 0


def test_ablation_switches():
    stats = synthetic_stats()
    assert (compile_table(stats, 0.33, use_floors=False).floor == 0).all()
    uniform = compile_table(stats, 0.33, use_distortion=False)
    assert (uniform.priority == 0).all() and uniform.floor[Role.USER_TEXT][0] == 0.75
    present = stats.entries[:, 0] > 0
    pooled = pooled_stats(stats, axis=0)  # every role of a group looks alike to the compiler
    assert len(np.unique(pooled.task_error[present], axis=0)) == 1 and (pooled.entries == stats.entries).all()
    one_role = compile_policy(stats, [0.33], ablation="one_role").table(0.33)
    assert len(np.unique(one_role.priority[present], axis=0)) == 1
    stats.task_error[Role.USER_TEXT, 1] = 0.0  # groups now differ; pooling over groups must hide it
    per_group = compile_policy(stats, [0.33]).table(0.33)
    one_group = compile_policy(stats, [0.33], ablation="one_group").table(0.33)
    assert per_group.floor[Role.USER_TEXT].tolist() == [0.75, 0.0]
    assert one_group.floor[Role.USER_TEXT, 0] == one_group.floor[Role.USER_TEXT, 1]
    with pytest.raises(ValueError, match="unknown ablation"):
        compile_policy(stats, [0.33], ablation="no_roles")


FITS = ModelFingerprint("qwen3", 4, 4, 2, 16, 64, vocab_hash="0123456789abcdef")


def test_statistics_of_another_layer_count_are_refused():
    stats = synthetic_stats(num_layers=6, groups=2)  # FITS has 4 layers
    with pytest.raises(ValueError, match=r"calibrated on .* \(6 layers\); the model has 4"):
        compile_policy(stats, [0.33], fits=FITS)
    assert compile_policy(synthetic_stats(num_layers=4, groups=2), [0.33], fits=FITS).fits == FITS


def test_save_load_and_mismatches(tmp_path: Path):
    policy = compile_policy(synthetic_calibration(), [0.2, 0.33], fits=FITS)
    policy.save(tmp_path / "p")
    loaded = PersistencePolicy.load(tmp_path / "p")
    assert loaded.model == "tiny-qwen3" and [t.budget for t in loaded.tables] == [0.2, 0.33]
    np.testing.assert_array_equal(loaded.table(0.33).floor, policy.table(0.33).floor)
    assert (tmp_path / "p" / "policy.json").read_text().count("RETAIN") > 0
    assert loaded.fits == FITS and loaded.content_hash() == policy.content_hash()
    loaded.check_fits(FITS)
    other = dataclasses.replace(FITS, vocab_hash="fedcba9876543210")
    with pytest.raises(PolicyError, match="vocabulary 0123456789abcdef.*vocabulary fedcba9876543210"):
        loaded.check_fits(other)
    with pytest.raises(PolicyError, match="no model fingerprint"):
        compile_policy(synthetic_stats(), [0.2]).check_fits(FITS)
    with pytest.raises(PolicyError, match="no shipped PASK policy fits"):
        find_shipped_policy(other, tmp_path)
    assert find_shipped_policy(FITS, tmp_path).content_hash() == policy.content_hash()
    with pytest.raises(PolicyError, match="no policy.json"):
        PersistencePolicy.load(tmp_path)


@pytest.mark.parametrize("field", [f.name for f in dataclasses.fields(ModelFingerprint)])
def test_a_policy_for_another_model_is_refused_naming_both(tmp_path: Path, field: str):
    """Any difference in what the policy fits (architecture, sizes, vocabulary, role taxonomy) refuses it."""
    compile_policy(synthetic_calibration(), [0.33], fits=FITS).save(tmp_path / "p")
    value = getattr(FITS, field)
    other = dataclasses.replace(FITS, **{field: value + 1 if isinstance(value, int) else f"{value}-other"})
    with pytest.raises(PolicyError) as info:
        resolve_policy(tmp_path / "p", other)
    assert re.search(re.escape(FITS.describe()) + ".*" + re.escape(other.describe()), str(info.value))
    assert resolve_policy(tmp_path / "p", FITS).fits == FITS


def test_policy_answers_any_budget_from_its_statistics(tmp_path: Path):
    """A budget the policy was not compiled for is compiled on load from the statistics it carries, with its compile
    options: the same table a policy compiled for that budget holds."""
    stats = CalibrationStats.load(SHIPPED_STATS)
    compile_policy(stats, [0.2, 0.5], fits=dataclasses.replace(FITS, num_layers=24)).save(tmp_path / "p")
    assert json.loads((tmp_path / "p" / "stats.json").read_text())["item_ids"] == stats.item_ids
    loaded = PersistencePolicy.load(tmp_path / "p")
    at_033 = loaded.table(0.33)
    _same_table(at_033, compile_policy(stats, [0.33]).table(0.33))
    _same_table(at_033, PersistencePolicy.load(SHIPPED).table(0.33), atol=1e-6)  # compiled for 0.33 and shipped
    at_027 = loaded.table(0.27)
    at_027.validate(R, loaded.groups)
    assert at_027.budget == 0.27 and at_027.group_fractions.mean() <= 0.27 + 1e-6  # equal groups: 6 layers each
    assert loaded.table(0.27) is at_027  # compiled once
    np.testing.assert_array_equal(loaded.table(0.5).floor[:19], loaded.tables[1].floor)  # stored ones kept (v1 rows)
    assert PaskKV.from_policy(loaded, 0.27).layer_fractions(24, 0.27).mean() == pytest.approx(0.27, abs=1e-3)
    with pytest.raises(PolicyError, match=r"budget=1.5 must be in \(0, 1\]"):
        loaded.table(1.5)
    # the compile options travel too: an ablated policy answers new budgets with the same ablation
    compile_policy(stats, [0.2], ablation="one_role", floor_share=0.5).save(tmp_path / "ablated")
    ablated = PersistencePolicy.load(tmp_path / "ablated")
    _same_table(ablated.table(0.33), compile_policy(stats, [0.33], ablation="one_role", floor_share=0.5).table(0.33))
    # the statistics do not change the content hash: it is the hash of the compiled tables
    assert loaded.content_hash() == dataclasses.replace(loaded, stats=None, compile_options=None).content_hash()


def test_policy_without_statistics_answers_only_its_budgets(tmp_path: Path):
    shipped = PersistencePolicy.load(SHIPPED)  # the shipped policy carries its statistics: any budget
    assert shipped.stats is not None and shipped.content_hash() == SHIPPED_HASH
    assert shipped.table(0.27).budget == 0.27
    assert json.loads((Path(SHIPPED) / "stats.json").read_text()) == json.loads(Path(SHIPPED_STATS).read_text())
    # without them, the same directory answers only its compiled budgets, and keeps its hash
    shutil.copytree(SHIPPED, tmp_path / "bare")
    (tmp_path / "bare" / "stats.json").unlink()
    bare = PersistencePolicy.load(tmp_path / "bare")
    assert bare.stats is None and bare.content_hash() == SHIPPED_HASH
    with pytest.raises(PolicyError, match=r"no policy table for budget 0.27.*pask-jax calibrate --stats"):
        bare.table(0.27)
    # saving a policy without statistics over one with them drops the stale file
    shutil.copytree(SHIPPED, tmp_path / "with-stats")
    bare.save(tmp_path / "with-stats")
    assert not (tmp_path / "with-stats" / "stats.json").exists()


def test_statistics_must_reproduce_the_tables(tmp_path: Path):
    compile_policy(synthetic_calibration(), [0.33], fits=FITS).save(tmp_path / "p")
    other = synthetic_calibration()
    other.task_error[Role.USER_TEXT] = 0.0  # another calibration: user text no longer needs a floor
    other.save(tmp_path / "p" / "stats.json")
    with pytest.raises(PolicyError, match="do not reproduce the floor of budget 0.33.*remove it"):
        PersistencePolicy.load(tmp_path / "p")
    other = synthetic_calibration()
    other.groups = 1
    other.save(tmp_path / "p" / "stats.json")
    with pytest.raises(PolicyError, match="statistics for 4 layers in 1 groups"):
        PersistencePolicy.load(tmp_path / "p")


def test_policy_directory_moves(tmp_path: Path):
    compile_policy(synthetic_calibration(), [0.33], fits=FITS).save(tmp_path / "here" / "p")
    moved = shutil.move(tmp_path / "here" / "p", tmp_path / "there" / "renamed")
    shutil.rmtree(tmp_path / "here")
    policy = PersistencePolicy.load(moved)
    assert policy.fits == FITS and policy.table(0.2).budget == 0.2


def test_policy_module_needs_no_jax_or_calibration():
    """A loaded policy compiles tables with the numpy compiler: `pask_jax.policy` imports neither JAX nor the
    calibration package (which imports the model)."""
    code = (
        "import json, sys, pask_jax.policy; "
        "print(json.dumps(sorted(m for m in sys.modules if m in ('jax', 'flax') or m.startswith('pask_jax.calib'))))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert json.loads(out.stdout) == []


def test_floors_respected_online():
    """After prefill, every (layer, head) keeps at least the floor of each prompt bucket."""
    model = Decoder(ModelConfig.tiny("qwen3", num_layers=4), rngs=nnx.Rngs(0))
    policy = compile_policy(synthetic_stats(), [0.33])
    engine = Engine(model, method=PaskKV.from_policy(policy, 0.33), budget=0.33, num_groups=G, length_buckets=(64,))
    rng = np.random.default_rng(0)
    length = 60
    tokens = rng.integers(0, 256, (1, 64)).astype(np.int32)
    roles = np.zeros((1, 64), np.int32)  # a role mix like the calibration's, so the floors are feasible
    mix = [Role.TEMPLATE] * 10 + [Role.DESCRIPTION] * 30 + [Role.USER_TEXT] * 12 + [Role.TOOL_NAME] * 8
    roles[0, :length] = rng.permutation(mix)
    _, caches, _ = engine.prefill(tokens, np.array([length], np.int32), roles, engine.capacities(64, 64))
    table = policy.table(0.33)
    for g, cache in enumerate(caches):
        pos, length_live, table_idx = np.asarray(cache.pos), np.asarray(cache.length), np.asarray(cache.table)
        for layer, head in np.ndindex(pos.shape[0], pos.shape[2]):
            live = pos[layer, 0, head][table_idx[layer, 0, head][: length_live[layer, 0, head]]]
            for role in (Role.USER_TEXT, Role.TOOL_NAME):
                n = int((roles[0, 1:length] == role).sum())  # position 0 is the sink
                kept = int((roles[0, live[live > 0]] == role).sum())
                assert kept >= np.ceil(table.floor[role, g] * n) - 1e-9, (g, role, kept, n)


@pytest.mark.parametrize(
    ("name", "layers", "hidden", "min_items"),
    [("qwen2.5-coder-0.5b", 24, 896, 32), ("qwen2.5-coder-1.5b", 28, 1536, 12)],
)
def test_shipped_policies_load_and_obey_their_budgets(name: str, layers: int, hidden: int, min_items: int):
    from pask_jax.experiments.bfcl import is_calibration

    policy = PersistencePolicy.load(SHIPPED_POLICIES / name)
    fits = policy.fits
    assert (fits.architecture, fits.num_layers, fits.num_kv_heads, fits.hidden_size) == ("qwen2", layers, 2, hidden)
    assert policy.groups == 4 and len(policy.calibration_items) >= min_items
    assert all(is_calibration(i, "schema") for i in policy.calibration_items)  # the split it was fitted under
    assert policy.taxonomy == "pask-roles-v1"  # answered in the current taxonomy by stand-ins
    for table in policy.tables:
        table.validate(19, policy.groups)
        policy.table(table.budget).validate(R, policy.groups)
        assert table.group_fractions.mean() <= table.budget + 1e-6  # equal groups (layers divisible by 4)
        method = PaskKV.from_policy(policy, table.budget)
        assert np.isclose(method.layer_fractions(layers, table.budget).mean(), table.group_fractions.mean())


def test_shipped_policy_is_section_1s():
    """RESULTS.md scores `results/policies/qwen2.5-coder-0.5b-schema36`; the package ships the same tables."""
    assert PersistencePolicy.load(EXPERIMENTAL_POLICIES / "qwen2.5-coder-0.5b-schema36").content_hash() == SHIPPED_HASH


@pytest.mark.parametrize(
    ("stats_file", "policy_dir", "ablation"),
    [
        (SHIPPED_STATS, SHIPPED, "none"),
        (
            REPO / "results" / "calibration_qwen2.5-coder-1.5b_schema12.json",
            SHIPPED_POLICIES / "qwen2.5-coder-1.5b",
            "none",
        ),
        (OWN16_STATS, EXPERIMENTAL_POLICIES / "qwen2.5-coder-0.5b-own16", "none"),
        *[
            (OWN16_STATS, EXPERIMENTAL_POLICIES / "qwen2.5-coder-0.5b-ablations" / a, a)
            for a in ("no_floors", "no_distortion", "one_role", "one_group")
        ],
    ],
    ids=["shipped", "shipped_1_5b", "own16", "no_floors", "no_distortion", "one_role", "one_group"],
)
def test_committed_policies_recompile_from_their_statistics(stats_file: Path, policy_dir: Path, ablation: str):
    """The recompile commands of RESULTS.md give the committed tables: a compiler change that would alter a policy
    (and so the published PASK numbers) must come with a recompiled policy."""
    from pask_jax.calibration.run import CalibrationStats

    stats = CalibrationStats.load(stats_file)
    shipped = PersistencePolicy.load(policy_dir)
    budgets = [t.budget for t in shipped.tables]
    assert budgets == [0.2, 0.33, 0.5]
    recompiled = compile_policy(stats, budgets, ablation=ablation)
    for ours, theirs in zip(recompiled.tables, shipped.tables, strict=True):
        for field in ("floor", "priority", "retain", "group_fractions"):
            np.testing.assert_allclose(getattr(ours, field), getattr(theirs, field), atol=1e-6, err_msg=field)


def test_retained_call_outranks_floors_and_released_entries_leave_first():
    """Order of eviction (lowest score leaves first): released generated < unprotected prompt < floor-protected
    prompt < the generated call of RETAIN buckets (floors were calibrated with the whole call present)."""
    import jax.numpy as jnp

    from pask_jax.methods.base import PrefillContext
    from pask_jax.methods.pask import POSITION_RANGE

    policy = compile_policy(synthetic_stats(), [0.33])
    table = policy.table(0.33)
    method = PaskKV.from_policy(policy, 0.33)
    retained, released = Role.FUNCTION_NAME, Role.ARG_LITERAL
    table.retain[[retained, released], 0] = True, False  # pin the actions under test in group 0 (layer 0)
    method = dataclasses.replace(method, retain=tuple(map(tuple, table.retain.tolist())))
    roles = jnp.asarray([[Role.SINK, Role.DESCRIPTION, Role.USER_TEXT, Role.USER_TEXT]], jnp.int32)
    positions = jnp.arange(4, dtype=jnp.int32)[None]
    ctx = PrefillContext(roles * 0, positions, positions < 4, jnp.asarray([4]), roles, 1, lambda *a: [])
    prompt = np.asarray(method.role_scores(0, ctx))[0, 0]  # [sink, description, user, user]
    assert table.floor[Role.USER_TEXT, 0] == 0.75 and table.floor[Role.DESCRIPTION, 0] == 0
    assert prompt[1] < prompt[2] < prompt[3]  # the description leaves before the floor-protected user text
    call = np.asarray(method.new_token_score(0, jnp.asarray([4]), jnp.asarray([retained]), 1))[0, 0]
    assert call > prompt[3]
    scores = jnp.asarray([[[prompt[1], call]]])  # [B, K, S]: an old released entry beside the description
    pos, role = jnp.asarray([[[1, 5]]]), jnp.asarray([[[Role.DESCRIPTION, released]]])
    late = np.asarray(method.eviction_priority(0, scores, pos, role, jnp.asarray([5 + 20]), jnp.asarray([4])))
    assert late[0, 0, 0] == prompt[1]  # prompt entries are never released
    assert late[0, 0, 1] == 5 < POSITION_RANGE  # released after the window: level 0, oldest first


# ---- precision actions (RELEASE / RETAIN_LOW / RETAIN_HIGH under a byte budget) -------------------------------------

BYTES = (256.0, 53.0, 271.0)  # head_dim 64: a full bf16 entry, a KIVI 2-bit block entry, a bf16 slot with metadata
ACTIONS = np.array([0.0, BYTES[1], BYTES[2]])  # bytes of one entry under each action


def low_calibration() -> CalibrationStats:
    """`synthetic_calibration` measured at LOW precision too: LOW adds back a tenth of a bucket's distortion, except
    schema punctuation's (LOW removes none of it: dominated by HIGH); user text's call survives LOW precision (its
    removal breaks it), tool names' does not."""
    s = synthetic_calibration()
    s.distortion_low = 0.1 * s.distortion
    s.distortion_low[Role.SCHEMA_PUNCT] = s.distortion[Role.SCHEMA_PUNCT]
    s.task_error_low = np.zeros((R, G))
    s.task_error_low[Role.TOOL_NAME] = 0.3
    s.task_error_strict_low, s.nll_delta_low = np.zeros((R, G)), np.zeros((R, G))
    s.low_storage = "kivi2"
    return s


def _precision(stats, budget: float, **options):
    (table,) = compile_tables(stats, [budget], CompileOptions(entry_bytes=options.pop("entry_bytes", BYTES), **options))
    table.validate(R, G)
    return table


@pytest.mark.parametrize("budget", [0.05, 0.1, 0.2, 0.33, 0.5, 1.0])
def test_precision_plan_obeys_byte_budget_and_floors(budget: float):
    stats = low_calibration()
    table = _precision(stats, budget)
    held = (stats.entries * ACTIONS[table.action]).sum(0)  # f64[G] bytes per layer (groups have 2 layers each)
    reference = BYTES[0] * stats.entries.sum(0)
    assert held.sum() <= budget * reference.sum() + 1e-6
    assert (held <= min(1.0, 2 * budget) * reference + 1e-6).all()  # no group takes everything
    assert table.group_fractions.mean() <= budget + 1e-6
    np.testing.assert_array_equal(table.retain, table.action != RELEASE)
    assert (table.floor[table.retain] == 1.0).all()
    # Floors: user text at least LOW (removal breaks the call, LOW does not), tool names HIGH (LOW breaks it too):
    # 15 x 53 + 5 x 271 bytes per layer, which fit from budget 0.06 on.
    assert (table.action[Role.USER_TEXT] >= RETAIN_LOW).all()
    if budget >= 0.1:
        assert (table.action[Role.TOOL_NAME] == RETAIN_HIGH).all()
    else:  # tool names' floor gives way first (less task error per byte saved than user text's), down to LOW
        assert (table.action[Role.TOOL_NAME] >= RETAIN_LOW).all()
        assert (table.action[Role.TOOL_NAME] == RETAIN_LOW).any()
    if budget < 0.2:  # descriptions are worth the least per byte
        assert (table.action[Role.DESCRIPTION] == RELEASE).all()


def test_low_within_tolerance_gets_retain_low_floor():
    stats = low_calibration()
    assert _precision(stats, 0.2).action[Role.USER_TEXT].tolist() == [RETAIN_LOW] * G
    stats.task_error_low[Role.USER_TEXT, 1] = 0.5  # LOW precision breaks the call too: HIGH is its floor
    assert _precision(stats, 0.2).action[Role.USER_TEXT].tolist() == [RETAIN_LOW, RETAIN_HIGH]


def test_dominated_low_goes_from_release_to_high():
    """Schema punctuation at LOW is as distorted as removed: it goes RELEASE -> HIGH even where its LOW would fit."""
    stats = low_calibration()
    for budget in (0.05, 0.1, 0.2, 0.33, 0.5, 1.0):
        assert RETAIN_LOW not in _precision(stats, budget).action[Role.SCHEMA_PUNCT]
    assert _precision(stats, 0.2).action[Role.SCHEMA_PUNCT].tolist() == [RELEASE] * G
    assert _precision(stats, 0.5).action[Role.SCHEMA_PUNCT].tolist() == [RETAIN_HIGH] * G
    stats.distortion_low[Role.SCHEMA_PUNCT] *= 0.1  # LOW now worth its bytes: taken at 0.2
    assert _precision(stats, 0.2).action[Role.SCHEMA_PUNCT].tolist() == [RETAIN_LOW] * G


def test_budget_one_keeps_everything_high_when_it_fits():
    stats = low_calibration()
    present = stats.entries > 0
    table = _precision(stats, 1.0, entry_bytes=(256.0, 53.0, 256.0))  # HIGH as large as the reference
    assert (table.action[present] == RETAIN_HIGH).all() and (table.action[~present] == RETAIN_LOW).all()
    np.testing.assert_allclose(table.group_fractions, 1.0, atol=1e-6)
    # with metadata HIGH costs more than the reference: not everything can be HIGH, what is left goes LOW
    table = _precision(stats, 1.0)
    assert (table.action[present] >= RETAIN_LOW).all() and (table.action[present] == RETAIN_LOW).any()


def test_precision_priority_follows_value_per_byte():
    table = _precision(low_calibration(), 0.2)
    assert (table.priority[Role.TOOL_NAME] > table.priority[Role.USER_TEXT]).all()  # 0.5 vs 0.01 per entry
    assert (table.priority[Role.USER_TEXT] > table.priority[Role.DESCRIPTION]).all()  # both LOW: 0.01 vs 0.001


def test_nll_value_ranks_by_the_nll_change_not_distortion():
    """Under value="nll" the knapsack reads the NLL change: descriptions, the least distortion per byte, rank first
    when their removal alone costs NLL; schema punctuation, all distortion and no NLL change, is not bought at HIGH;
    a negative mean change (noise) is worth nothing."""
    stats = low_calibration()
    level0 = list(stats.levels).index(0.0)
    stats.nll_delta = np.zeros_like(stats.nll_delta)
    stats.nll_delta[Role.DESCRIPTION, :, level0] = 1.0  # removing descriptions costs NLL, at LOW none
    stats.nll_delta[Role.USER_TEXT, :, level0] = -1.0
    by_distortion, by_nll = _precision(stats, 0.33), _precision(stats, 0.33, value="nll")
    assert (by_distortion.priority[Role.DESCRIPTION] < by_distortion.priority[Role.TOOL_NAME]).all()
    assert (by_nll.priority[Role.DESCRIPTION] > by_nll.priority[Role.TOOL_NAME]).all()
    assert (by_nll.priority[Role.USER_TEXT] == 0).all() and (by_nll.action[Role.USER_TEXT] == RETAIN_LOW).all()
    assert RETAIN_HIGH in by_distortion.action[Role.SCHEMA_PUNCT]
    assert RETAIN_HIGH not in by_nll.action[Role.SCHEMA_PUNCT]
    with pytest.raises(ValueError, match="unknown action value"):
        CompileOptions(entry_bytes=BYTES, value="mse")
    with pytest.raises(ValueError, match="needs entry_bytes"):
        CompileOptions(value="nll")


def test_precision_ablations():
    stats = low_calibration()
    no_floors = _precision(stats, 0.05, ablation="no_floors")
    assert no_floors.action[Role.USER_TEXT].tolist() == [RETAIN_LOW, RELEASE]  # its floor kept it LOW in both
    assert (no_floors.floor[no_floors.action == RELEASE] == 0).all()
    uniform = _precision(stats, 0.2, ablation="no_distortion")
    assert (uniform.priority == 0).all() and (uniform.action[Role.TOOL_NAME] == RETAIN_HIGH).all()
    present = stats.entries[:, 0] > 0
    pooled = pooled_stats(stats, axis=0)
    expected = (stats.task_error_low * stats.entries).sum(0) / stats.entries.sum(0)  # entries-weighted mean
    np.testing.assert_allclose(pooled.task_error_low[present], np.broadcast_to(expected, (present.sum(), G)))
    per_entry = pooled.distortion_low[present] / stats.entries[present]
    np.testing.assert_allclose(per_entry, per_entry[:1].repeat(len(per_entry), 0))
    one_role = _precision(stats, 0.2, ablation="one_role")
    assert len(np.unique(one_role.priority[present & (one_role.action[:, 0] == RETAIN_LOW)])) == 1
    stats.task_error_low[Role.USER_TEXT, 1] = 0.5  # groups differ; pooling over groups must hide it
    one_group = _precision(stats, 0.2, ablation="one_group")
    assert one_group.action[Role.USER_TEXT, 0] == one_group.action[Role.USER_TEXT, 1]


def test_precision_compile_needs_low_statistics_and_valid_sizes():
    with pytest.raises(PolicyError, match="lack task_error_low, task_error_strict_low, nll_delta_low, distortion_low"):
        compile_tables(synthetic_calibration(), [0.2], CompileOptions(entry_bytes=BYTES))
    for bad in ((256.0, 271.0, 53.0), (0.0, 53.0, 271.0), (256.0, 53.0)):
        with pytest.raises(ValueError, match="entry_bytes"):
            CompileOptions(entry_bytes=bad)
    assert CompileOptions(entry_bytes=[256, 53, 271]) == CompileOptions(entry_bytes=BYTES)  # as policy.json gives it
    table = _precision(low_calibration(), 0.2)
    with pytest.raises(PolicyError, match="actions must be one of"):
        dataclasses.replace(table, action=np.full((R, G), 3, np.int8)).validate(R, G)
    with pytest.raises(PolicyError, match="action has shape"):
        dataclasses.replace(table, action=table.action[:-1]).validate(R, G)


def high_calibration() -> CalibrationStats:
    """`low_calibration`'s items measured at a second, finer LOW precision (4 bits): a hundredth of each bucket's
    distortion comes back, and tool names' calls survive it."""
    s = low_calibration()
    s.distortion_low = 0.01 * s.distortion
    s.task_error_low = np.zeros((R, G))
    s.low_storage = "kivi4"
    return s


BYTES_4_2 = (256.0, 53.125, 85.125)  # a full bf16 entry, a KIVI 2-bit and a KIVI 4-bit block entry (head_dim 64)


def test_a_lossy_high_pairs_two_calibrations_and_sets_floors_and_values():
    both = with_high_precision(low_calibration(), high_calibration())
    assert (both.low_storage, both.high_storage) == ("kivi2", "kivi4")
    np.testing.assert_array_equal(both.distortion_high, high_calibration().distortion_low)
    again = CalibrationStats.from_json(both.to_json())  # HIGH fields round-trip
    np.testing.assert_array_equal(again.distortion_high, both.distortion_high)
    assert again.high_storage == "kivi4"
    entries = both.entries

    def high_entries(stats, budget: float) -> float:
        table = _precision(stats, budget, entry_bytes=BYTES_4_2)
        assert (table.action[Role.TOOL_NAME] == RETAIN_HIGH).all()  # LOW breaks its call, 4 bits do not
        cost = np.array([0.0, *BYTES_4_2[1:]])[table.action]
        assert (entries * cost).sum() <= budget * BYTES_4_2[0] * entries.sum() + 1e-6
        return float(entries[table.action == RETAIN_HIGH].sum())

    # HIGH's own damage counts: with 4 bits as lossy as 2 bits, the bytes go to keeping entries at LOW first (where
    # bytes are left over, as at 0.33, upgrades worth nothing take them as with a full-precision HIGH)
    flat = dataclasses.replace(both, distortion_high=low_calibration().distortion_low)
    assert high_entries(both, 0.2) > high_entries(flat, 0.2)
    # a full-precision window held beside the plan: its bytes come out of every group's share, and into its fraction
    window = 1500.0  # bytes per layer
    table = _precision(both, 0.33, entry_bytes=BYTES_4_2, window_bytes=window)
    layers = np.full(G, 2.0)  # the synthetic statistics: 4 layers in 2 groups
    planned = (entries * np.array([0.0, *BYTES_4_2[1:]])[table.action]).sum(0) * layers  # f64[G]
    reference = BYTES_4_2[0] * entries.sum(0) * layers
    assert planned.sum() + window * layers.sum() <= 0.33 * reference.sum() + 1e-6
    np.testing.assert_allclose(table.group_fractions, (planned + window * layers) / reference, rtol=1e-5)
    assert high_entries(both, 0.33) > float(entries[table.action == RETAIN_HIGH].sum())
    with pytest.raises(ValueError, match="needs entry_bytes"):
        CompileOptions(window_bytes=100.0)
    # the one_role ablation pools HIGH's measurements as it pools LOW's: per entry, one value for every role of a group
    present = entries[:, 0] > 0
    before = both.distortion_high[present, 0] / entries[present, 0]
    assert np.ptp(before) > 0  # tool names distort most
    pooled = pooled_stats(both, axis=0)
    np.testing.assert_allclose(
        pooled.distortion_high[present, 0] / entries[present, 0],
        before @ entries[present, 0] / entries[present, 0].sum(),
    )
    with pytest.raises(PolicyError, match="distortion_high"):
        _precision(dataclasses.replace(both, distortion_high=None), 0.2, entry_bytes=BYTES_4_2)
    with pytest.raises(ValueError, match="both statistics were measured at kivi2"):
        with_high_precision(low_calibration(), low_calibration())
    with pytest.raises(ValueError, match="differ in item_ids"):
        with_high_precision(low_calibration(), dataclasses.replace(high_calibration(), item_ids=["simple_python_4"]))
    with pytest.raises(ValueError, match="already carry a HIGH precision"):
        with_high_precision(both, high_calibration())


def test_statistics_without_low_fields_load_and_round_trip():
    text = SHIPPED_STATS.read_text()
    old = CalibrationStats.from_json(text)
    assert old.task_error_low is None and old.distortion_low is None and old.low_storage is None
    assert old.to_json() == text  # no LOW keys written: the file keeps its bytes
    stats = low_calibration()
    again = CalibrationStats.from_json(stats.to_json())
    assert again.low_storage == "kivi2"
    for name in ("task_error_low", "task_error_strict_low", "nll_delta_low", "distortion_low"):
        assert isinstance(getattr(again, name), np.ndarray) and getattr(again, name).dtype == np.float64, name
        np.testing.assert_array_equal(getattr(again, name), getattr(stats, name), err_msg=name)


def test_precision_policy_saves_as_v2_and_loads(tmp_path: Path):
    policy = compile_policy(low_calibration(), [0.2, 0.33], fits=FITS, entry_bytes=BYTES)
    policy.save(tmp_path / "p")
    meta = json.loads((tmp_path / "p" / "policy.json").read_text())
    assert meta["format"] == "pask-policy-v2" and meta["compile_options"]["entry_bytes"] == list(BYTES)
    buckets = meta["tables"][0]["buckets"]
    assert buckets["USER_TEXT"]["action"] == ["RETAIN_LOW"] * G
    assert buckets["TOOL_NAME"]["action"] == ["RETAIN_HIGH"] * G
    assert buckets["SCHEMA_PUNCT"]["action"] == ["RELEASE"] * G
    loaded = PersistencePolicy.load(tmp_path / "p")  # the statistics reproduce the actions too
    assert loaded.compile_options == policy.compile_options and loaded.stats.low_storage == "kivi2"
    for ours, theirs in zip(loaded.tables, policy.tables, strict=True):
        _same_table(ours, theirs)
        np.testing.assert_array_equal(ours.action, theirs.action)
    assert loaded.content_hash() == policy.content_hash()
    _same_table(loaded.table(0.27), compile_policy(low_calibration(), [0.27], entry_bytes=BYTES).table(0.27))
    assert loaded.table(0.27).action is not None  # compiled on load with the precision options
    action = policy.tables[0].action.copy()
    action[Role.DESCRIPTION, 0] = (action[Role.DESCRIPTION, 0] + 1) % 3  # another action, nothing else changed
    changed = dataclasses.replace(policy, tables=(dataclasses.replace(policy.tables[0], action=action),))
    assert changed.content_hash() != dataclasses.replace(policy, tables=policy.tables[:1]).content_hash()
    changed.save(tmp_path / "changed")  # an action the statistics do not give, every other field theirs
    with pytest.raises(PolicyError, match="do not reproduce the action of budget 0.2"):
        PersistencePolicy.load(tmp_path / "changed")
    # statistics that do not reproduce the actions, or cannot compile them, are refused
    other = low_calibration()
    other.task_error_low[Role.USER_TEXT] = 0.5
    other.save(tmp_path / "p" / "stats.json")
    with pytest.raises(PolicyError, match="do not reproduce the .* of budget 0.2.*remove it"):
        PersistencePolicy.load(tmp_path / "p")
    synthetic_calibration().save(tmp_path / "p" / "stats.json")
    with pytest.raises(PolicyError, match="lack task_error_low.*remove it"):
        PersistencePolicy.load(tmp_path / "p")


def test_a_method_config_action_table_replaces_the_policys():
    """A dev variant's own actions (a method-config section gives lists) over a policy's floors and priorities."""
    policy = compile_policy(low_calibration(), [0.33], fits=FITS, entry_bytes=BYTES)
    own = [[RETAIN_HIGH if r == Role.USER_TEXT else RETAIN_LOW] * G for r in range(R)]
    method = make_method("pask", {"action": own}, policy=policy, budget=0.33)
    assert method.action == tuple(map(tuple, own)) != PaskKV.from_policy(policy, 0.33).action
    assert method.floor == PaskKV.from_policy(policy, 0.33).floor and hash(method) is not None


@pytest.mark.parametrize("name", ["qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b"])
def test_presence_policies_stay_v1(tmp_path: Path, name: str):
    """Policies without actions still load, and saving one writes format v1, byte for byte (its hash unchanged)."""
    shipped = PersistencePolicy.load(SHIPPED_POLICIES / name)  # _check_statistics passes on load
    assert all(t.action is None for t in shipped.tables) and shipped.compile_options.entry_bytes is None
    shipped.save(tmp_path / "p")
    for file in ("policy.json", "stats.json"):
        assert (tmp_path / "p" / file).read_bytes() == (SHIPPED_POLICIES / name / file).read_bytes(), file
    again = PersistencePolicy.load(tmp_path / "p")
    assert json.loads((tmp_path / "p" / "policy.json").read_text())["format"] == "pask-policy-v1"
    assert again.content_hash() == shipped.content_hash() and again.tables[0].action is None


def test_older_taxonomy_answers_actions_by_stand_ins():
    shipped = PersistencePolicy.load(SHIPPED)  # roles pask-roles-v1: 19 rows
    t = shipped.tables[0]
    action = np.full(t.retain.shape, RETAIN_LOW, np.int8)
    action[Role.USER_TEXT] = RETAIN_HIGH
    older = dataclasses.replace(shipped, tables=(dataclasses.replace(t, action=action),), stats=None)
    upgraded = older.table(t.budget)
    assert upgraded.action.shape == (R, shipped.groups) and (upgraded.action[: len(action)] == action).all()
