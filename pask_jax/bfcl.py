"""BFCL v4 data, read from the installed `bfcl-eval` package (installed with --no-deps: we need its data and checker).

The package's data files are JSON lines: `bfcl_eval/data/BFCL_v4_<category>.json` (questions and functions) and
`bfcl_eval/data/possible_answer/BFCL_v4_<category>.json` (ground truth). We locate them without importing
`bfcl_eval` (its `__init__` is empty, but its submodules import dozens of API clients).
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

CATEGORIES = (
    "simple_python",
    "multiple",
    "parallel",
    "parallel_multiple",
    "live_simple",
    "live_multiple",
    "live_parallel",
    "live_parallel_multiple",
)
INSTALL_HINT = "pip install --no-deps bfcl-eval==2026.3.23"


def data_dir() -> Path:
    spec = importlib.util.find_spec("bfcl_eval")
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError(f"bfcl-eval is not installed; install its data and checker with: {INSTALL_HINT}")
    return Path(next(iter(spec.submodule_search_locations))) / "data"


def _read_jsonl(path: Path) -> list[dict]:
    with path.open(encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def load_category(category: str) -> list[dict]:
    """All items of one category, in the file's order: {"id", "question": [[messages]], "function": [...]}."""
    if category not in CATEGORIES:
        raise ValueError(f"unknown BFCL category {category!r}; known: {', '.join(CATEGORIES)}")
    return _read_jsonl(data_dir() / f"BFCL_v4_{category}.json")


def load_answers(category: str) -> dict[str, dict]:
    """Ground truth of one category by item id."""
    if category not in CATEGORIES:
        raise ValueError(f"unknown BFCL category {category!r}; known: {', '.join(CATEGORIES)}")
    return {a["id"]: a for a in _read_jsonl(data_dir() / "possible_answer" / f"BFCL_v4_{category}.json")}
