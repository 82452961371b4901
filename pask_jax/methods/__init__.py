"""KV-compression methods: each decides which prompt entries a cache keeps and what leaves during decode."""

import dataclasses
import importlib.resources
import tomllib
from pathlib import Path

from pask_jax.methods.base import KVMethod
from pask_jax.methods.dapq import DapQ
from pask_jax.methods.full import FullKV
from pask_jax.methods.h2o import H2O
from pask_jax.methods.kivi import KIVI
from pask_jax.methods.pask import PaskKV
from pask_jax.methods.per_token import FP8KV, Int8KV
from pask_jax.methods.pyramidkv import PyramidKV
from pask_jax.methods.random_kv import RandomKV
from pask_jax.methods.snapkv import SnapKV
from pask_jax.methods.streamingllm import StreamingLLM
from pask_jax.methods.triaxialkv import TriAxialKV

DEFAULT_METHOD_CONFIG = importlib.resources.files("pask_jax") / "configs" / "methods.toml"
METHODS: dict[str, type[KVMethod]] = {
    m.name: m
    for m in (FullKV, RandomKV, StreamingLLM, H2O, SnapKV, PyramidKV, DapQ, PaskKV, KIVI, Int8KV, FP8KV, TriAxialKV)
}


def load_method_config(path: str | Path | None = None) -> dict[str, dict]:
    """Hyper-parameter overrides per section: the packaged `pask_jax/configs/methods.toml` (labelled variants; the
    defaults are the dataclass fields), with a TOML file's values on top (a section of `path` updates the packaged
    section of the same name key by key).

    A section is a method name, or `name:LABEL` for one labelled variant in a sweep (e.g. `["pask:release"]`)."""
    config = _read_method_config(DEFAULT_METHOD_CONFIG.read_text(), DEFAULT_METHOD_CONFIG)
    if path is not None:
        path = Path(path)
        if not path.exists():
            raise ValueError(f"method config {path} does not exist")
        for section, values in _read_method_config(path.read_text(), path).items():
            config[section] = config.get(section, {}) | values
    return config


def _read_method_config(text: str, path) -> dict[str, dict]:
    config = tomllib.loads(text)
    unknown = sorted(s for s in config if s.partition(":")[0] not in METHODS)
    if unknown:
        raise ValueError(f"{path}: unknown method(s) {unknown}; known: {', '.join(METHODS)}")
    return config


def make_method(name: str, overrides: dict | None = None, *, policy=None, budget: float = 1.0) -> KVMethod:
    """Build a method by name with hyper-parameter overrides; PASK takes its compiled policy for `budget`."""
    if name not in METHODS:
        raise ValueError(f"unknown method {name!r}; known: {', '.join(METHODS)}")
    overrides = dict(overrides or {})
    fields = {f.name for f in dataclasses.fields(METHODS[name])}
    bad = sorted(set(overrides) - fields)
    if bad:
        raise ValueError(f"method {name!r} has no hyper-parameter(s) {bad}; it has: {sorted(fields)}")
    if name == "pask" and policy is not None:
        return PaskKV.from_policy(policy, budget, **overrides)
    return METHODS[name](**overrides)


__all__ = [
    "METHODS",
    "DapQ",
    "FP8KV",
    "FullKV",
    "H2O",
    "KIVI",
    "Int8KV",
    "KVMethod",
    "PaskKV",
    "PyramidKV",
    "RandomKV",
    "SnapKV",
    "StreamingLLM",
    "TriAxialKV",
    "load_method_config",
    "make_method",
]
