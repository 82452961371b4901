"""Calibration driver: items -> gold calls with roles -> jitted passes -> `CalibrationStats`.

Items are prepared requests: a user's own chat-completions requests (`calibrate_requests`, each rendered with the
model's chat template; `pask_jax.calibration.data` reads and splits them), or any other source of `Example`s
(`calibrate_examples`; the experiments calibrate on an evaluation suite's calibration part that way).

The gold (`target`): "own" (the only one for user requests, which carry no answer) teacher-forces the model's own
greedy, grammar-constrained call at full KV, so the baseline is right by construction and task error measures how
often removing a bucket changes the call the model would make (what a compressed cache must preserve); a source with
reference answers may teacher-force those instead ("canonical").

Per item (see `passes.py` for what one pass computes): the prompt is prefilled once; then every variant (role r,
layer group g, keep level lam) whose removal hides at least one entry is teacher-forced, in batches of `batch` rows
sharded over a 1-D device mesh (axis "data"; parameters and the item replicated). Variants that hide nothing equal the
baseline and count as 0 change. Sums over items are checkpointed with orbax every `save_every` items, so a rerun with
the same `checkpoint_dir` continues where a preempted one stopped (and refuses a different model / G / levels / data,
or a checkpoint holding items the run does not have).

Multi-host (TPU pods): run the same command on every host with `PASK_DISTRIBUTED=1` (JAX detects Cloud TPU and SLURM
clusters) or `JAX_COORDINATOR_ADDRESS=host:port JAX_NUM_PROCESSES=n JAX_PROCESS_ID=i`; `pask-jax calibrate` then
calls `jax.distributed.initialize()` first (`pask_jax.models.sharding.init_distributed`). Every host prepares the
same items (and computes own calls on its first local device); the mesh spans all devices of all hosts and only the
variant rows are split over them; results are all-gathered to every host, so every host ends with the same statistics.

Run: ``pask-jax calibrate --model DIR --data requests.jsonl --checkpoint ckpt/calib --out policies/my-model``
(statistics saved inside the policy as ``stats.json``).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import jax
import numpy as np
import orbax.checkpoint as ocp
from flax import nnx
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from tqdm.auto import tqdm

from pask_jax.calibration.passes import NO_ROLE, ItemArrays, PassPlan, baseline_pass, removed_entries, variant_pass
from pask_jax.kernels.quantize import PRESETS
from pask_jax.layers import layer_groups
from pask_jax.models.decoder import Decoder
from pask_jax.policy_compiler import LOW_STATS_ARRAYS, STATS_ARRAYS, CalibrationStats
from pask_jax.requests import PreparedRequest
from pask_jax.runtime.engine import Engine
from pask_jax.runtime.sampling import SamplingConfig
from pask_jax.storage import BLOCK_FORMATS
from pask_jax.structure.backend import grammar_constraint
from pask_jax.structure.roles import TAXONOMY_VERSION, num_roles

DEFAULT_LEVELS = (0.0, 0.25, 0.5, 0.75)
GOLD_BUCKET = 16  # fed tokens padded to a multiple of this; prompts to a power of two (>= 64)
OWN_CALL_TOKENS = 128  # an own call still unfinished after this many tokens is skipped (a runaway value)


@dataclasses.dataclass
class Example:
    """One item ready for the passes: token ids, roles and the grammar's mask before each gold token."""

    id: str
    prompt: np.ndarray  # i32[P]
    prompt_roles: np.ndarray  # i32[P], position 0 = SINK
    gold: np.ndarray  # i32[T]
    gold_roles: np.ndarray  # i32[T]
    allowed: np.ndarray  # i32[T, W] packed bits (token 32w + j: bit j of word w) the grammar allows before g_t
    consistent: np.ndarray  # i32[T, W] packed bits: tokens whose text is a prefix of the gold text from g_t on


def pack_bits(token_sets: Sequence[Sequence[int]], vocab_size: int) -> np.ndarray:
    """Token-id sets -> packed bits i32[len(token_sets), ceil(vocab_size / 32)]."""
    words = np.zeros((len(token_sets), -(-vocab_size // 32)), np.uint32)
    for row, tokens in enumerate(token_sets):
        tokens = np.asarray(list(tokens), np.int64)
        np.bitwise_or.at(words[row], tokens >> 5, np.uint32(1) << (tokens & 31).astype(np.uint32))
    return words.view(np.int32)


@functools.lru_cache(maxsize=4)
def _tokens_by_bytes(tokenizer) -> tuple[dict[bytes, list[int]], int]:
    index: dict[bytes, list[int]] = {}
    for token, raw in enumerate(tokenizer.all_token_bytes()):
        if raw:
            index.setdefault(raw, []).append(token)
    return index, max(map(len, index))


def text_consistent(gold: Sequence[int], tokenizer, vocab_size: int) -> np.ndarray:
    """i32[T, W] packed: before gold token t, the tokens whose bytes are a prefix of the gold text from t on."""
    index, longest = _tokens_by_bytes(tokenizer)
    pieces = [tokenizer.token_bytes(int(t)) for t in gold]
    sets = []
    for t in range(len(gold)):
        rest = b"".join(pieces[t:])[:longest]
        sets.append([tok for n in range(1, len(rest) + 1) for tok in index.get(rest[:n], ())])
    return pack_bits(sets, vocab_size)


def example_from_prepared(
    example_id: str, prepared: PreparedRequest, renderings: Sequence[Sequence[int]], tokenizer, vocab_size: int
) -> Example:
    """The example of a prepared request answered by the first of `renderings` (token ids) its grammar accepts
    (ValueError if it accepts none)."""
    ids, roles = np.asarray(prepared.ids, np.int32), np.asarray(prepared.roles, np.int32)
    for attempt, tokens in enumerate(np.asarray(r, np.int32) for r in renderings):
        constraint = grammar_constraint([prepared.grammar], vocab_size)
        allowed, gold_roles = [], []
        try:
            for token in tokens:
                allowed.append(constraint.mask()[0])
                gold_roles.append(constraint.advance(np.array([token]))[0])
            break
        except ValueError:
            if attempt == len(renderings) - 1:
                raise
    consistent = text_consistent(tokens, tokenizer, vocab_size)
    return Example(example_id, ids, roles, tokens, np.asarray(gold_roles, np.int32), np.stack(allowed), consistent)


def own_call(engine: Engine, prompt: np.ndarray, grammar, max_new_tokens: int = OWN_CALL_TOKENS) -> np.ndarray:
    """i32[T]: the model's own greedy answer to the prompt (i32[P]) under `grammar` at full KV, end of turn included
    (ValueError if it does not finish within `max_new_tokens`)."""
    constraint = grammar_constraint([grammar], engine.cfg.vocab_size)
    (gen,) = engine.generate([prompt], SamplingConfig(max_new_tokens=max_new_tokens), constraint=constraint)
    if gen.finish_reason != "stop":
        raise ValueError(f"own call unfinished after {max_new_tokens} tokens")
    return np.asarray(gen.tokens, np.int32)


def item_arrays(ex: Example) -> ItemArrays:
    """Pad an example to its (Pb, Tb) bucket (numpy)."""
    p, t = len(ex.prompt), len(ex.gold) - 1  # fed tokens: g_0..g_{T-2}
    if t < 1:
        raise ValueError(f"{ex.id}: a gold call needs at least 2 tokens")
    pb, tb = max(64, 1 << (p - 1).bit_length()), -(-t // GOLD_BUCKET) * GOLD_BUCKET
    pad = lambda a, n, fill=0: np.concatenate([a, np.full((n - len(a), *a.shape[1:]), fill, a.dtype)])  # noqa: E731
    return ItemArrays(
        prompt=pad(ex.prompt, pb),
        prompt_len=np.int32(p),
        fed=pad(ex.gold[:-1], tb),
        fed_len=np.int32(t),
        key_roles=np.concatenate([pad(ex.prompt_roles, pb, NO_ROLE), pad(ex.gold_roles[:-1], tb, NO_ROLE)]),
        targets=pad(ex.gold, tb + 1),
        allowed=pad(ex.allowed, tb + 1, -1),
        consistent=pad(ex.consistent, tb + 1),
    )


def _put(tree, sharding: NamedSharding):
    if jax.process_count() == 1:
        return jax.device_put(tree, sharding)
    host = jax.tree.map(np.asarray, tree)
    return jax.tree.map(lambda a: jax.make_array_from_callback(a.shape, sharding, lambda i: a[i]), host)


def _get(tree):
    return jax.tree.map(np.asarray, tree if jax.process_count() == 1 else multihost_utils.process_allgather(tree, True))


def _calibrate_item(plan: PassPlan, params, ex: Example, levels, batch: int, mesh: Mesh, sums: dict) -> None:
    """Run one example's passes and add its contributions to `sums` (in place); with LOW statistics in `sums`, the
    low variants of every present bucket too."""
    r_all, n_lv = num_roles(), len(levels)
    replicated, rows = NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))
    arrays = _put(item_arrays(ex), replicated)
    keys = np.concatenate([ex.prompt_roles, ex.gold_roles[:-1]])
    entries = np.bincount(keys, minlength=r_all)[:r_all].astype(np.float64)
    base = baseline_pass(plan, params, arrays)  # replicated like its inputs
    b = _get({k: base[k] for k in ("error", "error_strict", "nll", "out_sq")})
    grid_r, grid_l = np.repeat(np.arange(r_all), n_lv), np.tile(np.asarray(levels, np.float32), r_all)
    removed = _get(removed_entries(arrays, _put(grid_r.astype(np.int32), replicated), _put(grid_l, replicated)))
    removed = removed.reshape(r_all, n_lv)
    feed = {k: base[k] for k in ("prompt_k", "prompt_v", "first_logits", "outs")}
    whole = levels.index(0.0)

    def run(todo: list[tuple[int, int, int]], low: bool):  # (role, group, level index) -> per variant outputs
        for start in range(0, len(todo), batch):
            chunk = todo[start : start + batch]
            spec = np.array(chunk + [(NO_ROLE, 0, 0)] * (batch - len(chunk)))  # padding rows change nothing
            role, group = spec[:, 0].astype(np.int32), spec[:, 1].astype(np.int32)
            level = np.asarray(levels, np.float32)[spec[:, 2]]
            out = _get(variant_pass(plan, params, arrays, feed, *(_put(a, rows) for a in (role, group, level)), low))
            for i, (r, g, li) in enumerate(chunk):
                a, z = plan.groups[g]
                distortion = math.sqrt(out["diff_sq"][i, a:z].sum() / max(b["out_sq"][a:z].sum(), 1e-30))
                changes = [float(out[k][i]) - float(b[k]) for k in ("error", "error_strict", "nll")]
                yield r, g, li, changes, distortion

    todo = [(r, g, li) for r, li in zip(*np.nonzero(removed), strict=True) for g in range(len(plan.groups))]
    for r, g, li, changes, d in run(todo, low=False):
        for name, change in zip(("task_error", "task_error_strict", "nll_delta"), changes, strict=True):
            sums[name][r, g, li] += change
        if li == whole:
            sums["distortion"][r, g] += d
            sums["distortion_per_entry"][r, g] += d / removed[r, li]
    if "distortion_low" in sums:
        present = [(r, g, whole) for r in np.nonzero(removed[:, whole])[0] for g in range(len(plan.groups))]
        for r, g, _, changes, d in run(present, low=True):
            for name, change in zip(LOW_STATS_ARRAYS[:3], changes, strict=True):
                sums[name][r, g] += change
            sums["distortion_low"][r, g] += d
    sums["entries"] += entries[:, None]
    sums["present"] += (entries > 0)[:, None]
    sums["baseline"] += [float(b["error"]), float(b["error_strict"]), float(b["nll"]), 1.0]


def _checkpoint(directory: str | Path | None, config: dict, state: dict) -> Callable[[], None]:
    """Restore `state` (sums, done, skipped, wall_s) from the latest orbax checkpoint in place; return its saver."""
    if directory is None:
        return lambda: None
    options = ocp.CheckpointManagerOptions(max_to_keep=2, enable_async_checkpointing=False)
    manager = ocp.CheckpointManager(Path(directory).absolute(), options=options, item_names=("sums", "meta"))
    if manager.latest_step() is not None:
        args = ocp.args.Composite(sums=ocp.args.StandardRestore(), meta=ocp.args.JsonRestore())
        restored = manager.restore(manager.latest_step(), args=args)
        if restored["meta"]["config"] != config:
            raise ValueError(f"checkpoint {directory} is for {restored['meta']['config']}, not {config}")
        state |= restored["meta"] | {"sums": {k: np.asarray(v, np.float64) for k, v in restored["sums"].items()}}

    def save() -> None:
        meta = {k: state[k] for k in ("config", "done", "skipped", "wall_s")}
        args = ocp.args.Composite(sums=ocp.args.StandardSave(state["sums"]), meta=ocp.args.JsonSave(meta))
        manager.save(len(state["done"]) + len(state["skipped"]), args=args, force=True)
        manager.wait_until_finished()

    return save


def calibrate_examples(
    model: Decoder,
    examples: Sequence[tuple[str, Callable[[], Example]]],  # (item id, builds the example; may raise ValueError)
    *,
    groups: int = 4,
    levels: Sequence[float] = DEFAULT_LEVELS,
    checkpoint_dir: str | Path | None = None,
    max_items: int | None = None,  # calibrate only the first max_items examples (a later run may continue)
    batch: int = 32,  # variant rows per pass (rounded up to a multiple of the device count)
    save_every: int = 4,
    progress: bool = True,
    target: str = "canonical",  # what the examples' gold is (recorded in the statistics and the checkpoint)
    data: str | None = None,  # a digest of the data the examples come from (a checkpoint for other data is refused)
    low_storage: str | None = None,  # also measure every bucket stored at this LOW precision ("kivi2", "kivi4")
) -> CalibrationStats:
    """The calibration loop over prepared examples (`calibrate_requests` builds them from chat-completions requests),
    with a progress bar (ETA) on the first process."""
    if 0.0 not in levels:
        raise ValueError(f"levels={levels} must include 0.0 (bucket removed: distortion is measured there)")
    if low_storage is not None and low_storage not in BLOCK_FORMATS:
        raise ValueError(f"low_storage={low_storage!r}: a LOW precision is a block format, one of {BLOCK_FORMATS}")
    cfg, levels = model.config, tuple(float(x) for x in levels)
    graphdef, params = nnx.split(model)
    plan = PassPlan(graphdef, layer_groups(cfg.num_layers, groups), *([PRESETS[low_storage]] if low_storage else []))
    mesh = Mesh(np.asarray(jax.devices()), ("data",))
    params = _put(params, NamedSharding(mesh, P()))
    batch = -(-batch // mesh.size) * mesh.size
    config = (
        dict(
            model=cfg.name,
            num_layers=cfg.num_layers,
            groups=groups,
            levels=list(levels),
            taxonomy=TAXONOMY_VERSION,
            target=target,
        )
        | ({} if data is None else {"data": data})
        | ({} if low_storage is None else {"low_storage": low_storage})
    )
    shape = (num_roles(), groups)
    sums = {
        k: np.zeros(shape + ((len(levels),) if k.startswith(("task", "nll")) else ()), np.float64) for k in STATS_ARRAYS
    } | {k: np.zeros(shape, np.float64) for k in (LOW_STATS_ARRAYS if low_storage else ())}
    state = {"config": config, "done": [], "skipped": {}, "wall_s": 0.0, "sums": sums | {"baseline": np.zeros(4)}}
    save = _checkpoint(checkpoint_dir, config, state)
    examples = list(examples)
    known = {item_id for item_id, _ in examples}
    foreign = [i for i in [*state["done"], *state["skipped"]] if i not in known]
    if foreign:
        raise ValueError(
            f"checkpoint {checkpoint_dir} holds {len(foreign)} items this run does not calibrate ({foreign[:3]}): "
            "resume with the same items, or start another checkpoint directory"
        )

    selected = examples[:max_items]
    todo = [(i, build) for i, build in selected if i not in state["done"] and i not in state["skipped"]]
    bar = tqdm(
        total=len(selected),
        initial=len(selected) - len(todo),  # resumed items: not counted in the rate, so the ETA holds
        desc="calibrate",
        unit="item",
        disable=not progress or jax.process_index() > 0,
    )
    for n, (item_id, build) in enumerate(todo, 1):
        start = time.perf_counter()
        try:
            ex = build()
        except ValueError as exc:  # e.g. the grammar refuses the rendered gold
            state["skipped"][item_id] = str(exc)[:300]
        else:
            _calibrate_item(plan, params, ex, levels, batch, mesh, state["sums"])
            state["done"].append(item_id)
        state["wall_s"] += time.perf_counter() - start
        bar.set_postfix(skipped=len(state["skipped"]), refresh=False)
        bar.update()
        if n % save_every == 0 or n == len(todo):
            save()
    bar.close()

    sums = state["sums"]
    n = max(sums["baseline"][3], 1.0)
    present = np.maximum(sums["present"], 1)
    measured = [*STATS_ARRAYS[:5], *(LOW_STATS_ARRAYS if low_storage else ())]
    means = {k: sums[k] / (present[..., None] if sums[k].ndim == 3 else present) for k in measured}
    return CalibrationStats(
        **means,
        entries=sums["entries"] / n,
        present=sums["present"].astype(np.int64),
        baseline_error=sums["baseline"][0] / n,
        baseline_error_strict=sums["baseline"][1] / n,
        baseline_nll=sums["baseline"][2] / n,
        n_items=int(sums["baseline"][3]),
        **{k: v for k, v in config.items() if k not in ("levels", "data")},
        levels=levels,
        item_ids=list(state["done"]),
        skipped=dict(state["skipped"]),
        wall_s=state["wall_s"],
    )


def calibrate_requests(
    model: Decoder, tokenizer, prepared: Sequence[tuple[str, PreparedRequest]], **options
) -> CalibrationStats:
    """Calibrate on prepared chat-completions requests ((custom_id, request) pairs, e.g. the calibration part of a
    user's batch file, `pask_jax.calibration.data`) against the model's own full-KV answer under each request's
    grammar, within its max_tokens (requests whose answer does not finish are skipped). Options as
    `calibrate_examples`."""
    vocab = model.config.vocab_size
    engine = Engine(model, stop_token_ids=tokenizer.eos_token_ids)

    def build(request: PreparedRequest, custom_id: str) -> Example:
        answer = own_call(engine, np.asarray(request.ids, np.int32), request.grammar, request.request.max_tokens)
        return example_from_prepared(custom_id, request, [answer], tokenizer, vocab)

    examples = [(custom_id, functools.partial(build, request, custom_id)) for custom_id, request in prepared]
    return calibrate_examples(model, examples, target="own", **options)
