"""One engine factory: a method name, budget and policy in; an `Engine` whose method and budget agree out.

Every entry point (the `LLM` API, `pask-jax run`, BFCL evaluation, calibration, benchmarks) builds engines here, so a
PASK policy is always used at a budget it answers, full KV always runs at budget 1, and method hyper-parameters come
from one place (the packaged `configs/methods.toml`, overridden per call).
"""

from __future__ import annotations

from collections.abc import Sequence

from jax.sharding import Mesh

from pask_jax.engine import DEFAULT_LENGTH_BUCKETS, Engine
from pask_jax.methods import METHODS, load_method_config, make_method
from pask_jax.models.qwen3 import Qwen3
from pask_jax.policy import PersistencePolicy

DEFAULT_GROUPS = 4


def make_engine(
    model: Qwen3,
    method: str = "full",
    budget: float = 1.0,
    *,
    policy: PersistencePolicy | None = None,
    overrides: dict | None = None,
    num_groups: int | None = None,
    use_kernel: bool = False,
    stop_token_ids: Sequence[int] = (),
    max_context: int | None = None,
    mesh: Mesh | None = None,
    length_buckets: Sequence[int] = DEFAULT_LENGTH_BUCKETS,
) -> Engine:
    """An engine running `method` (a name in `METHODS`) at total KV budget `budget`.

    `overrides` replace hyper-parameters of the method's section in the default method config. `policy` (PASK only)
    must answer `budget`; the layer groups then come from it (`num_groups` must agree if given). Full KV keeps
    every entry: its budget must be 1. `mesh`: a (`data`, `model`) device mesh (`make_mesh`), see `Engine`.
    """
    if method not in METHODS:
        raise ValueError(f"unknown method {method!r}; known: {', '.join(METHODS)}")
    if not 0.0 < budget <= 1.0:
        raise ValueError(f"budget={budget} must be in (0, 1]")
    if method == "full" and budget != 1.0:
        raise ValueError(f"full KV keeps every entry: its budget is 1.0, not {budget}")
    if policy is not None and method != "pask":
        raise ValueError(f"a persistence policy is for method 'pask', not {method!r}")
    if policy is not None:
        policy.table(budget)  # PolicyError naming the budgets it answers
        if num_groups is not None and num_groups != policy.groups:
            raise ValueError(f"num_groups={num_groups}, but the policy was calibrated with {policy.groups} groups")
        num_groups = policy.groups
    params = load_method_config().get(method, {}) | dict(overrides or {})
    return Engine(
        model,
        method=make_method(method, params, policy=policy, budget=budget),
        budget=budget,
        num_groups=num_groups or DEFAULT_GROUPS,
        use_kernel=use_kernel,
        stop_token_ids=stop_token_ids,
        max_context=max_context,
        mesh=mesh,
        length_buckets=length_buckets,
    )
