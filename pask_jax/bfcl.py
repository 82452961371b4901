"""BFCL v4 data, read from the installed `bfcl-eval` package (installed with --no-deps: we need its data and checker).

The package's data files are JSON lines: `bfcl_eval/data/BFCL_v4_<category>.json` (questions and functions) and
`bfcl_eval/data/possible_answer/BFCL_v4_<category>.json` (ground truth). We locate them without importing
`bfcl_eval` (its `__init__` is empty, but its submodules import dozens of API clients).
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import json
import re
import sys
import types
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


# ---------------------------------------------------------------------------------------------------------------------
# Canonical gold calls
# ---------------------------------------------------------------------------------------------------------------------


def _is_optional_marker(allowed: list) -> bool:
    return not allowed or allowed[0] == ""


def _canonical_value(value):
    """One allowed value rendered as the model would emit it.

    Dict-typed arguments are ground-truthed as a dict of allowed-value lists ({key: [values...]}, "" = key optional),
    and lists of such dicts for array-of-dict arguments; render those recursively, anything else is a literal.
    """
    if isinstance(value, dict) and value and all(isinstance(v, list) for v in value.values()):
        return {k: _canonical_value(v[0]) for k, v in value.items() if not _is_optional_marker(v)}
    if isinstance(value, list) and value and all(isinstance(v, dict) for v in value):
        return [_canonical_value(v) for v in value]
    return value


def canonical_calls(answer_entry: dict) -> list[tuple[str, dict]]:
    """The ground truth of one item as the calls a model would emit: [(function name, arguments)], in gold order.

    Each argument takes its first allowed value; an argument whose first allowed value is "" (BFCL's marker for
    "may be omitted") is omitted.
    """
    calls = []
    for gold in answer_entry["ground_truth"]:
        ((name, args),) = gold.items()
        calls.append((name, {k: _canonical_value(v[0]) for k, v in args.items() if not _is_optional_marker(v)}))
    return calls


# ---------------------------------------------------------------------------------------------------------------------
# Checker: bfcl-eval's own ast_checker
# ---------------------------------------------------------------------------------------------------------------------

CHECKER_MODEL_NAME = "pask-jax"  # the checker only uses it to look up `underscore_to_dot` (False, as for Qwen FC)


class _StandInConfigMapping(dict):
    """Stand-in for `bfcl_eval.constants.model_config.MODEL_CONFIG_MAPPING`: every model keeps dots in names."""

    def __missing__(self, key):
        return types.SimpleNamespace(underscore_to_dot=False)


@functools.cache
def _checker():
    data_dir()  # raises the install hint when bfcl-eval is missing
    name = "bfcl_eval.constants.model_config"
    if name not in sys.modules:  # the real module imports every API client; ast_checker only reads this mapping
        stand_in = types.ModuleType(name)
        stand_in.MODEL_CONFIG_MAPPING = _StandInConfigMapping()
        sys.modules[name] = stand_in
    from bfcl_eval.constants.enums import Language
    from bfcl_eval.eval_checker.ast_eval.ast_checker import ast_checker

    return ast_checker, Language.PYTHON


def _category_of(item_id: str) -> str:
    category = item_id.rsplit("_", 1)[0]
    if category not in CATEGORIES:
        raise ValueError(f"item {item_id!r} is not in a known BFCL category; known: {', '.join(CATEGORIES)}")
    return category


def score_item(item: dict, answer_entry: dict, calls: list[dict]) -> tuple[bool, str | None, list]:
    """Score decoded calls ([{name: {arg: value}}], BFCL's decoded-AST format) as BFCL's AST runner does.

    Returns (valid, error_type, error messages). The checker receives the item's functions as BFCL's runner passes
    them (unprocessed: `load_dataset_entry(..., include_language_specific_hint=False)`), language Python, and the
    category name as test_category.
    """
    if item["id"] != answer_entry["id"]:
        raise ValueError(f"item {item['id']!r} scored against the answer of {answer_entry['id']!r}")
    if not is_decoded_format(calls):
        return False, "ast_decoder:decoder_wrong_output_format", ["not a list of {function: {argument: value}}"]
    ast_checker, python = _checker()
    category = _category_of(item["id"])
    result = ast_checker(item["function"], calls, answer_entry["ground_truth"], python, category, CHECKER_MODEL_NAME)
    return bool(result["valid"]), result.get("error_type"), result.get("error", [])


def is_decoded_format(calls) -> bool:
    """BFCL's `is_function_calling_format_output`: a list of single-key dicts whose value is a dict."""
    return isinstance(calls, list) and all(
        isinstance(c, dict) and len(c) == 1 and isinstance(next(iter(c.values())), dict) for c in calls
    )
