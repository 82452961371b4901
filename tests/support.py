"""Plain helpers the test modules share (fixtures live in conftest.py): tiny random models, synthetic calibration
statistics, and the method matrix of tests/methods/test_methods.py (its prompts, cases and memoized engines), which
tests/models/test_sharding.py runs on device meshes."""

from __future__ import annotations

import socket
import types
from collections.abc import Callable

import numpy as np
from flax import nnx

from pask_jax.calibration.compiler import compile_policy
from pask_jax.methods import KIVI, METHODS, DapQ, KVMethod, PaskKV, PyramidKV, SnapKV, TriAxialKV
from pask_jax.models.decoder import Decoder, ModelConfig
from pask_jax.runtime.engine import Engine
from pask_jax.runtime.rows import Generation
from pask_jax.runtime.sampling import SamplingConfig
from pask_jax.storage import Storage
from pask_jax.structure.roles import TAXONOMY_VERSION, Role, num_roles

QWEN_VOCAB = 151_936  # the Qwen2.5 checkpoints' embedding rows (the tokenizer's ids fit below it)
SYNTHETIC_LEVELS = (0.0, 0.25, 0.5, 0.75)


def tiny_model(architecture: str = "qwen3", seed: int = 0, **overrides) -> Decoder:
    """A random few-kB model of one of the three families (`ModelConfig.tiny` plus overrides)."""
    return Decoder(ModelConfig.tiny(architecture, **overrides), rngs=nnx.Rngs(seed))


def synthetic_stats(num_layers: int = 4, groups: int = 2) -> types.SimpleNamespace:
    """Calibration statistics by hand: USER_TEXT is fragile (any removal below 75% breaks the call), DESCRIPTION is
    harmless and cheap to drop, TOOL_NAME breaks only when all of it goes and distorts the most. At LOW precision
    (for precision actions) USER_TEXT still breaks the call, TOOL_NAME keeps it and most of its distortion goes."""
    r = num_roles()
    entries = np.zeros((r, groups))
    entries[[Role.TEMPLATE, Role.TOOL_NAME, Role.DESCRIPTION, Role.USER_TEXT, Role.SCHEMA_PUNCT]] = [
        [20] * groups,
        [5] * groups,
        [60] * groups,
        [15] * groups,
        [40] * groups,
    ]
    task_error = np.zeros((r, groups, len(SYNTHETIC_LEVELS)))
    task_error[Role.USER_TEXT] = [[0.5, 0.4, 0.2, 0.0]] * groups
    task_error[Role.TOOL_NAME] = [[0.3, 0.0, 0.0, 0.0]] * groups
    distortion = np.full((r, groups), 0.01)
    distortion[Role.TOOL_NAME] = 0.5
    distortion[Role.DESCRIPTION] = 0.001
    task_error_low = np.zeros((r, groups))
    task_error_low[Role.USER_TEXT] = 0.1
    return types.SimpleNamespace(
        entries=entries,
        task_error=task_error,
        distortion_per_entry=distortion,
        distortion=distortion * entries,
        task_error_low=task_error_low,
        task_error_strict_low=task_error_low,
        nll_delta_low=task_error_low,
        distortion_low=distortion * entries / 10,
        low_storage="kivi2",
        levels=SYNTHETIC_LEVELS,
        model="tiny-qwen3",
        num_layers=num_layers,
        groups=groups,
        taxonomy=TAXONOMY_VERSION,
        item_ids=["simple_python_3", "multiple_7"],
    )


# ---- the method matrix ----------------------------------------------------------------------------------------------

PROMPTS = [list(range(3, 40)), [7, 7, 120, 5, 9, 11, 13, 2, 2, 8, 100, 101], list(range(50, 75))]
NEW = 20
BUCKETS = (16, 64)
ROLES = [[Role.SINK] + [Role.DESCRIPTION if i % 3 else Role.USER_TEXT for i in range(1, len(p))] for p in PROMPTS]
BUDGET = 0.4  # every compressed invariant runs at this budget: one compiled plan per case besides budget 1
BUDGETS = (0.3, 0.4, 0.5, 1.0)  # the synthetic policy's tables (tests/models/test_sharding.py runs PASK at 0.33)
SYNTHETIC_POLICY = compile_policy(synthetic_stats(num_layers=4, groups=2), list(BUDGETS))
LOW_GROUP = 8  # LOW blocks of 8 tokens fill on PROMPTS (32 would not)
ACTION_POLICY = compile_policy(  # precision actions for the matrix model (head_dim 16)
    synthetic_stats(num_layers=4, groups=2),
    list(BUDGETS),
    entry_bytes=Storage.with_blocks("kivi2", 16, LOW_GROUP).action_bytes(16),
)

# A case is a method instance built for the budget it runs at (PASK's policy tables are per budget), so variants of
# one method (a small SnapKV window, DapQ's content choices, PASK with a synthetic policy or DapQ ranking) are cases.
CASES: dict[str, Callable[[float], KVMethod]] = {
    # every method at its defaults, but fp8 (int8's per-token slot path in another format, checked in
    # tests/runtime/test_storage.py) and kivi / triaxialkv (their 32-token blocks never fill on these prompts: the
    # group-8 cases do)
    **{
        name: (lambda budget, cls=cls: cls())
        for name, cls in METHODS.items()
        if name not in ("fp8", "kivi", "triaxialkv")
    },
    "snapkv_window8_avg": lambda budget: SnapKV(window=8, pooling="avg"),
    "pyramidkv_window4": lambda budget: PyramidKV(window=4),
    "pyramidkv_window_inside": lambda budget: PyramidKV(window=4, allotment="pyramid"),
    "kivi_group8": lambda budget: KIVI(group=8, residual=8),  # blocks and window flushes within PROMPTS + NEW
    # two block pools: the prompt's USER_TEXT and what is generated (role 0 without a grammar) at INT4, the rest INT2
    "triaxialkv_group8": lambda budget: TriAxialKV(int4=("USER_TEXT", "TEMPLATE"), group=8, residual=8),
    "dapq_last": lambda budget: DapQ(content="last", num_pseudo=8),
    "dapq_random": lambda budget: DapQ(content="random", num_pseudo=8),
    "dapq_max_pooled": lambda budget: DapQ(num_pseudo=8, pooling="max"),
    "pask_policy": lambda budget: PaskKV.from_policy(SYNTHETIC_POLICY, budget),
    # DapQ's rank inside a level, ordered by both queries (the pseudo queries and SnapKV's observation window)
    "pask_policy_dapq_rank_both_queries": lambda budget: PaskKV.from_policy(
        SYNTHETIC_POLICY, budget, rank="dapq", query="both"
    ),
    "pask_actions": lambda budget: PaskKV.from_policy(ACTION_POLICY, budget, low_group=LOW_GROUP, high_window=8),
    # HIGH a 4-bit block pool beside the 2-bit one (the pool chosen per bucket and layer group), a window of 8
    "pask_actions_two_pools": lambda budget: PaskKV.from_policy(
        ACTION_POLICY, budget, low_group=LOW_GROUP, high_window=8, high_storage="kivi4"
    ),
    "pask_policy_v1": lambda budget: PaskKV.from_policy(
        SYNTHETIC_POLICY, budget, rank="recency", system_as_request=False
    ),
}


def matrix_model() -> Decoder:
    """The matrix's model: 4 layers in 2 groups of 2, so a group holds layers of different fractions."""
    return Decoder(ModelConfig.tiny("qwen3", num_layers=4, vocab_size=256), rngs=nnx.Rngs(5))


def make(model: Decoder, case: str, budget: float) -> Engine:
    return Engine(model, method=CASES[case](budget), budget=budget, num_groups=2, length_buckets=BUCKETS)


class Matrix:
    """One engine per (case, budget) over one model, and its static generation of PROMPTS (NEW tokens, ROLES), each
    made once: tests of one module share them, and so their compiled steps. Generations are not to be mutated."""

    def __init__(self, model: Decoder):
        self.model = model
        self._engines: dict[tuple[str, float], Engine] = {}
        self._static: dict[tuple[str, float], list[Generation]] = {}

    def engine(self, case: str, budget: float) -> Engine:
        key = (case, budget)
        if key not in self._engines:
            self._engines[key] = make(self.model, case, budget)
        return self._engines[key]

    def static(self, case: str, budget: float) -> list[Generation]:
        key = (case, budget)
        if key not in self._static:
            engine = self.engine(case, budget)
            self._static[key] = engine.generate(PROMPTS, SamplingConfig(max_new_tokens=NEW), prompt_roles=ROLES)
        return self._static[key]


def free_port() -> int:
    """A localhost port free now, for a `jax.distributed` coordinator."""
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]
