"""Golden record of the method matrix: greedy tokens, the prompt entries each cache keeps after prefill and the kept
ratio after every step, for every case, recorded from the engine and compared exactly. A refactor of the runtime must
leave them identical; a deliberate change of behaviour re-records them (`PASK_JAX_RECORD_GOLDEN=1 pytest` this file)
and says why in its commit."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import numpy as np
import pytest
from support import BUDGET, CASES, NEW, PROMPTS, ROLES, Matrix

GOLDEN = Path(__file__).resolve().parents[1] / "data" / "golden_matrix.json"
RECORD = os.environ.get("PASK_JAX_RECORD_GOLDEN") == "1"
pytestmark = pytest.mark.usefixtures("quick_compiles")


def kept_positions_digest(matrix: Matrix, case: str) -> str:
    """sha256 of the sorted original positions each (layer, row, KV head) keeps after prefill."""
    engine = matrix.engine(case, BUDGET)
    shape = engine.batch_shape([len(p) for p in PROMPTS], NEW)
    tokens, lengths, roles = shape.pad(PROMPTS, ROLES)
    _, caches, _ = engine.prefill(tokens, lengths, roles, shape.capacities)
    kept = [np.sort(np.asarray(cache.pos), axis=-1)[:, : len(PROMPTS)] for cache in caches]
    return hashlib.sha256(b"".join(k.tobytes() for k in kept)).hexdigest()


def record(matrix: Matrix, case: str) -> dict:
    gens = matrix.static(case, BUDGET)
    return {
        "tokens": [g.tokens for g in gens],
        "kept_ratios": [[round(r, 12) for r in g.stats.kept_ratios] for g in gens],
        "prefill_kept_positions": kept_positions_digest(matrix, case),
    }


@pytest.fixture(scope="module")
def golden() -> dict:
    if RECORD:
        return {}
    if not GOLDEN.exists():
        pytest.fail(f"{GOLDEN} is missing: record it with PASK_JAX_RECORD_GOLDEN=1")
    return json.loads(GOLDEN.read_text())


@pytest.mark.parametrize("case", sorted(CASES))
def test_matrix_matches_the_golden_record(matrix: Matrix, golden: dict, case: str):
    got = record(matrix, case)
    if RECORD:
        saved = json.loads(GOLDEN.read_text()) if GOLDEN.exists() else {}
        GOLDEN.write_text(json.dumps({**saved, case: got}, indent=1, sort_keys=True) + "\n")
        return
    assert case in golden, f"no golden record for {case!r}: record it with PASK_JAX_RECORD_GOLDEN=1"
    assert got == golden[case]
