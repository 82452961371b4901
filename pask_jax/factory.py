"""One engine factory: a method name, budget and policy in; an `Engine` whose method and budget agree out.

Every entry point (the `LLM` API, `pask-jax run`, calibration, the experiments and benchmarks) builds engines here, so a
PASK policy is always used at a budget it answers, full KV always runs at budget 1, and method hyper-parameters are
the method's dataclass defaults with a spec's overrides (a labelled variant of the method config, or the caller's).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

from jax.sharding import Mesh

from pask_jax.methods import METHODS, make_method
from pask_jax.models.decoder import Decoder
from pask_jax.policy import PersistencePolicy
from pask_jax.runtime.engine import Engine
from pask_jax.runtime.shapes import DEFAULT_LENGTH_BUCKETS, PREFILL_CHUNK
from pask_jax.storage import Storage

DEFAULT_GROUPS = 4


@dataclasses.dataclass(frozen=True)
class MethodSpec:
    """A method as a command line or a sweep names it: `NAME`, or `NAME:LABEL`, a labelled variant (its own
    method-config section `["NAME:LABEL"]`, or for PASK the policy labelled LABEL), resolved by `resolve_spec`."""

    name: str
    label: str = ""
    overrides: Mapping = dataclasses.field(default_factory=dict)  # hyper-parameters over the dataclass defaults
    policy: PersistencePolicy | None = None  # PASK's policy (None: uncalibrated, or not PASK)
    storage: str = ""  # `NAME@STORAGE`: what the cache stores entries as (empty: the method's own, else bf16)

    @property
    def method(self) -> str:
        """The method as `make_engine` takes it: NAME, or NAME@STORAGE."""
        return f"{self.name}@{self.storage}" if self.storage else self.name


def resolve_spec(
    spec: str, method_config: Mapping[str, dict], policies: Mapping[str, PersistencePolicy] | None = None
) -> MethodSpec:
    """`NAME` or `NAME:LABEL` -> its MethodSpec: hyper-parameters from the method's config section, then the spec's
    own; PASK's policy labelled LABEL, else the one labelled "pask". ValueError for an unknown method, a label with
    neither a config section nor a policy, or hyper-parameters the method refuses."""
    policies = policies or {}
    base, _, storage = spec.partition("@")
    if storage:
        Storage.parse(storage)  # ValueError naming the storages there are
    name, _, label = base.partition(":")
    if name not in METHODS:
        raise ValueError(f"unknown method {name!r} in {spec!r}; known: {', '.join(METHODS)}")
    if label and base not in method_config and not (name == "pask" and label in policies):
        variants = ", ".join(s for s in method_config if s.startswith(name + ":")) or "none"
        raise ValueError(
            f"{spec!r}: a label must name a method-config section [{spec!r}] (or, for pask, a --policy LABEL=PATH); "
            f"the config's {name} variants: {variants}"
        )
    policy = policies.get(label, policies.get("pask")) if name == "pask" else None
    overrides = method_config.get(name, {}) | method_config.get(base, {})
    make_method(name, overrides)  # a bad hyper-parameter (a name, a value) is an error here, before any model loads
    return MethodSpec(name, label, overrides, policy, storage)


def make_engine(
    model: Decoder,
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
    prefill_chunk: int = PREFILL_CHUNK,
) -> Engine:
    """An engine running `method` (a name in `METHODS`) at total KV budget `budget`.

    `overrides` replace the method's default hyper-parameters (its dataclass fields). `policy` (PASK only)
    must answer `budget`; the layer groups then come from it (`num_groups` must agree if given). Full KV keeps
    every entry: its budget must be 1. `mesh`: a (`data`, `model`) device mesh (`make_mesh`), see `Engine`.
    """
    method, _, stored = method.partition("@")
    storage = Storage.parse(stored) if stored else None
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
    return Engine(
        model,
        method=make_method(method, overrides, policy=policy, budget=budget),
        budget=budget,
        num_groups=num_groups or DEFAULT_GROUPS,
        use_kernel=use_kernel,
        stop_token_ids=stop_token_ids,
        max_context=max_context,
        mesh=mesh,
        length_buckets=length_buckets,
        prefill_chunk=prefill_chunk,
        storage=storage,
    )
