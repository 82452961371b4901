"""BFCL v4 data, gold calls, output decoding and scoring, from the installed `bfcl-eval` package (installed with
--no-deps: we need its data and checker).

Data. The package's data files are JSON lines: `bfcl_eval/data/BFCL_v4_<category>.json` (questions and functions) and
`bfcl_eval/data/possible_answer/BFCL_v4_<category>.json` (ground truth). We locate them without importing
`bfcl_eval` (its `__init__` is empty, but its submodules import dozens of API clients).

Calibration / dev / evaluation split (fixed, `SPLIT_RULE` "schema"). Items are grouped so that a group holds every
item that shares a tool set (the sorted canonical JSON of the item's function dicts: names, schemas and descriptions)
or, for live items, a BFCL group number (the middle number of `live_simple_4-3-0`, across the four live categories)
with another item of the group, transitively, over all eight categories. A group goes whole to one part, by the
first 8 hex digits of sha256(the group's smallest item id) mod 10: 0 calibration, 1 dev, else evaluation (about
10 / 10 / 80 % of the items). So no evaluation item shares a tool set or a live group with a calibration or dev item.
Calibration items fit policies; dev items tune every method's hyper-parameters; evaluation items are only scored.
Each part keeps the file's order; `evaluation_sample(category, offset, limit)` is evaluation items
offset..offset+limit-1 of that order (default the first 25; all of a category when it has fewer).
The rule "item-hash" is the earlier per-item split (calibration iff `int(sha256(id)[:8], 16) % 5 == 0`, dev = the
calibration items, evaluation = the rest): it shares schemas across parts and is kept only to reproduce results
scored under it.

Scoring. Generated text is decoded by `parse_tool_calls` to BFCL's decoded-AST format `[{name: {arg: value}}]` and
judged by bfcl-eval's own `ast_checker`, called as BFCL's AST runner calls it (`score_item`, `score_text`).

Aggregation (`summarize`), following `bfcl_eval/eval_checker/eval_runner_helper.py`: "non_live" is the unweighted
mean of the 4 non-live category accuracies (BFCL's `calculate_unweighted_accuracy`; BFCL's "simple" also averages
Java and JavaScript, which we do not run), "live" is the mean of the 4 live categories weighted by item count
(`calculate_weighted_accuracy`), and "overall" is the unweighted mean of the 8 category accuracies: BFCL's own
overall also mixes in irrelevance, multi-turn and agentic scores, so it has no counterpart here.
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
from typing import NamedTuple

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
NON_LIVE = CATEGORIES[:4]
LIVE = CATEGORIES[4:]
SPLITS = ("evaluation", "dev")  # what `pask-jax bfcl --split` scores: evaluation_sample or dev_sample
SPLIT_RULES = ("schema", "item-hash")
SPLIT_RULE = "schema"
PARTS = ("calibration", "dev", "evaluation")
INSTALL_HINT = "pip install --no-deps bfcl-eval==2026.3.23"
# Golds that no call can satisfy under bfcl-eval 2026.3.23's checker (an empty allowed-value list for a required
# argument, or a gold argument the function does not declare): every model scores 0 on them.
UNSATISFIABLE = frozenset(
    {"live_simple_106-63-0", "live_simple_112-68-0", "live_multiple_862-181-3", "live_multiple_964-207-0"}
)


def data_dir() -> Path:
    spec = importlib.util.find_spec("bfcl_eval")
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError(f"bfcl-eval is not installed; install its data and checker with: {INSTALL_HINT}")
    return Path(next(iter(spec.submodule_search_locations))) / "data"


def _read_jsonl(path: Path) -> list[dict]:
    with path.open(encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def _check_category(category: str) -> None:
    if category not in CATEGORIES:
        raise ValueError(f"unknown BFCL category {category!r}; known: {', '.join(CATEGORIES)}")


def load_category(category: str) -> list[dict]:
    """All items of one category, in the file's order: {"id", "question": [[messages]], "function": [...]}."""
    _check_category(category)
    return _read_jsonl(data_dir() / f"BFCL_v4_{category}.json")


def load_answers(category: str) -> dict[str, dict]:
    """Ground truth of one category by item id."""
    _check_category(category)
    return {a["id"]: a for a in _read_jsonl(data_dir() / "possible_answer" / f"BFCL_v4_{category}.json")}


# ---- calibration / evaluation split ---------------------------------------------------------------------------------


class Split(NamedTuple):
    """One category's items by part, each in the file's order."""

    calibration: list[dict]
    dev: list[dict]
    evaluation: list[dict]


def _check_rule(rule: str) -> None:
    if rule not in SPLIT_RULES:
        raise ValueError(f"unknown split rule {rule!r}; known: {', '.join(SPLIT_RULES)}")


def _hash_mod(text: str, modulus: int) -> int:
    return int(hashlib.sha256(text.encode("utf-8")).hexdigest()[:8], 16) % modulus


def tool_set_key(functions: list[dict]) -> str:
    """The fingerprint of an item's tool set: sha256 of its function dicts as sorted canonical JSON."""
    canonical = sorted(json.dumps(f, sort_keys=True, ensure_ascii=False) for f in functions)
    return hashlib.sha256(json.dumps(canonical).encode("utf-8")).hexdigest()


_LIVE_GROUP = re.compile(r"^live_[a-z_]+_\d+-(\d+)-\d+$")


@functools.cache
def _schema_parts() -> dict[str, str]:
    """item id -> part under the "schema" rule (see the module docstring): union-find over shared keys."""
    parent: dict[str, str] = {}

    def find(x: str) -> str:
        parent.setdefault(x, x)
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    ids = []
    for category in CATEGORIES:
        for item in load_category(category):
            ids.append(item["id"])
            keys = ["tools:" + tool_set_key(item["function"])]
            if match := _LIVE_GROUP.match(item["id"]):
                keys.append("live-group:" + match.group(1))
            for key in keys:
                parent[find(item["id"])] = find(key)
    smallest: dict[str, str] = {}
    for item_id in ids:
        root = find(item_id)
        smallest[root] = min(smallest.get(root, item_id), item_id)
    return {item_id: PARTS[min(_hash_mod(smallest[find(item_id)], 10), 2)] for item_id in ids}


def part_of(item_id: str, rule: str = SPLIT_RULE) -> str:
    """ "calibration", "dev" or "evaluation": the part an item belongs to under `rule`."""
    _check_rule(rule)
    if rule == "item-hash":
        return "calibration" if _hash_mod(item_id, 5) == 0 else "evaluation"
    try:
        return _schema_parts()[item_id]
    except KeyError:
        raise ValueError(f"{item_id!r} is not a BFCL item of the eight categories") from None


def is_calibration(item_id: str, rule: str = SPLIT_RULE) -> bool:
    """Whether an item is for fitting policies (never scored as a result)."""
    return part_of(item_id, rule) == "calibration"


def split_items(category: str, rule: str = SPLIT_RULE) -> Split:
    """(calibration, dev, evaluation) items of one category, each in the file's order. Under "item-hash" the dev part
    is the calibration part (runs then pick a dev offset past a policy's own items)."""
    items = load_category(category)
    parts = {part: [it for it in items if part_of(it["id"], rule) == part] for part in PARTS}
    if rule == "item-hash":
        parts["dev"] = parts["calibration"]
    return Split(**parts)


def evaluation_sample(category: str, offset: int = 0, limit: int | None = 25, rule: str = SPLIT_RULE) -> list[dict]:
    """Evaluation items offset..offset+limit-1 of one category (fewer at its end; limit None: all from offset)."""
    return _slice(split_items(category, rule).evaluation, offset, limit)


def dev_sample(category: str, offset: int = 0, limit: int | None = 25, rule: str = SPLIT_RULE) -> list[dict]:
    """Dev items offset..offset+limit-1 of one category: for choosing any method's hyper-parameters without looking
    at evaluation items. Their scores are never reported as results."""
    return _slice(split_items(category, rule).dev, offset, limit)


def split_sample(
    split: str, category: str, offset: int = 0, limit: int | None = 25, rule: str = SPLIT_RULE
) -> list[dict]:
    """`evaluation_sample` or `dev_sample` by name (one of `SPLITS`)."""
    if split not in SPLITS:
        raise ValueError(f"split {split!r}; choose from {', '.join(SPLITS)}")
    return (dev_sample if split == "dev" else evaluation_sample)(category, offset, limit, rule)


def _slice(items: list[dict], offset: int, limit: int | None) -> list[dict]:
    if offset < 0 or (limit is not None and limit < 0):
        raise ValueError(f"offset and limit must be >= 0, got offset={offset}, limit={limit}")
    return items[offset:] if limit is None else items[offset : offset + limit]


# ---- canonical gold calls -------------------------------------------------------------------------------------------


def _is_optional_marker(allowed: list) -> bool:
    return not allowed or allowed[0] == ""


def _canonical_value(value):
    """One allowed value as the model would emit it. Dict-typed arguments are ground-truthed as {key: [allowed...]}
    ("" = key optional), array-of-dict ones as lists of those: render them recursively; anything else is literal."""
    if isinstance(value, dict) and value and all(isinstance(v, list) for v in value.values()):
        return {k: _canonical_value(v[0]) for k, v in value.items() if not _is_optional_marker(v)}
    if isinstance(value, list) and value and all(isinstance(v, dict) for v in value):
        return [_canonical_value(v) for v in value]
    return value


def canonical_calls(answer_entry: dict, functions: list[dict] | None = None) -> list[tuple[str, dict]]:
    """The ground truth of one item as the calls a model would emit: [(function name, arguments)], in gold order.

    Every argument takes its first allowed value; "" among the allowed values is BFCL's marker for "may be omitted".
    Without `functions`, an argument whose first allowed value is "" is omitted. With the item's `functions` (pass
    them: a few golds need it), the rendering follows the schema as the checker does: an argument the function does
    not declare is omitted (the checker accepts that only when "" is allowed), a required argument takes its first
    non-"" value (or "" itself when that is all the gold allows), an optional one is omitted when "" comes first.
    The renderings of the golds in `UNSATISFIABLE` still fail the checker.
    """
    schemas = {f["name"]: f["parameters"] for f in functions or ()}
    calls = []
    for gold in answer_entry["ground_truth"]:
        ((name, args),) = gold.items()
        schema = schemas.get(name)
        out = {}
        for key, allowed in args.items():
            if schema is None:
                if not _is_optional_marker(allowed):
                    out[key] = _canonical_value(allowed[0])
            elif key in schema.get("properties", {}) and allowed:
                values = [v for v in allowed if v != ""]
                if key in schema.get("required", ()):
                    out[key] = _canonical_value(values[0]) if values else ""
                elif allowed[0] != "":
                    out[key] = _canonical_value(allowed[0])
        calls.append((name, out))
    return calls


# ---- decoding generated text ----------------------------------------------------------------------------------------


class ParseError(ValueError):
    """Generated text that does not decode to tool calls (scored as BFCL's "ast_decoder:decoder_failed")."""


_TOOL_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
_JSON_FENCE = re.compile(r"```(?:json)?[ \t]*\n(.*?)```", re.DOTALL)


def _reject_constant(name: str):
    raise ParseError(f"not strict JSON: {name}")


def _call(obj) -> dict:
    if not (isinstance(obj, dict) and set(obj) == {"name", "arguments"} and isinstance(obj["name"], str)):
        raise ParseError(f'a call must be {{"name": str, "arguments": {{...}}}}, got {obj!r}'[:300])
    if not isinstance(obj["arguments"], dict):
        raise ParseError(f"arguments of {obj['name']!r} are not a JSON object")
    return {obj["name"]: obj["arguments"]}


def parse_tool_calls(text: str) -> list[dict]:
    """Decode generated text to BFCL's decoded-AST format [{name: {arg: value}}], in order.

    Accepts `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks (one or more; whitespace around the
    JSON allowed; text outside the blocks ignored, as BFCL's Qwen FC decoder does) or, when there are none, ```json
    fences (also bare ```) each holding one call object or a list of them. Strict JSON (no NaN / Infinity). Raises
    ParseError when no call is found or any block fails to decode (BFCL's decoder silently drops such a block).
    """
    blocks = _TOOL_CALL.findall(text)
    fenced = not blocks
    if fenced:
        blocks = _JSON_FENCE.findall(text)
    if not blocks:
        raise ParseError("no <tool_call> block or ```json fence in the output")
    calls = []
    for block in blocks:
        try:
            obj = json.loads(block, parse_constant=_reject_constant)
        except json.JSONDecodeError as e:
            raise ParseError(f"invalid JSON in a tool call: {e}") from None
        objs = obj if fenced and isinstance(obj, list) else [obj]
        if not objs:
            raise ParseError("empty list of calls in a ```json fence")
        calls.extend(_call(o) for o in objs)
    return calls


# ---- checker: bfcl-eval's own ast_checker ---------------------------------------------------------------------------

CHECKER_MODEL_NAME = "pask-jax"  # the checker only uses it to look up `underscore_to_dot` (False, as for Qwen FC)


class _StandInConfigMapping(dict):
    """Stand-in for `bfcl_eval.constants.model_config.MODEL_CONFIG_MAPPING`: every model keeps dots in names."""

    def __missing__(self, key):
        return types.SimpleNamespace(underscore_to_dot=False)


@functools.cache
def _checker():
    data_dir()  # raises the install hint when bfcl-eval is missing
    name = "bfcl_eval.constants.model_config"
    if name not in sys.modules:  # the real module imports every API client; ast_checker reads only this mapping
        stand_in = types.ModuleType(name)
        stand_in.MODEL_CONFIG_MAPPING = _StandInConfigMapping()
        sys.modules[name] = stand_in
    from bfcl_eval.constants.enums import Language
    from bfcl_eval.eval_checker.ast_eval.ast_checker import ast_checker

    return ast_checker, Language.PYTHON


def category_of(item_id: str) -> str:
    category = item_id.rsplit("_", 1)[0]
    _check_category(category)
    return category


def is_decoded_format(calls) -> bool:
    """BFCL's `is_function_calling_format_output`: a list of single-key dicts whose value is a dict."""
    return isinstance(calls, list) and all(
        isinstance(c, dict) and len(c) == 1 and isinstance(next(iter(c.values())), dict) for c in calls
    )


def _refuse_calibration(item: dict, allow_calibration: bool, rule: str) -> None:
    if is_calibration(item["id"], rule) and not allow_calibration:
        raise ValueError(f"{item['id']!r} is a calibration item; calibration items are never scored")


def score_item(
    item: dict, answer_entry: dict, calls: list[dict], *, allow_calibration: bool = False, rule: str = SPLIT_RULE
):
    """Judge decoded calls [{name: {arg: value}}] as BFCL's AST runner does: (valid, error_type | None, errors).

    The checker gets the item's functions unprocessed (BFCL's runner loads them with
    `include_language_specific_hint=False`), language Python, and the category name as test_category. Scoring a
    calibration item (under the split `rule`) is refused unless `allow_calibration` (for checks of the data and
    checker themselves, and dev runs under the "item-hash" rule, whose dev items are calibration items).
    """
    _refuse_calibration(item, allow_calibration, rule)
    if item["id"] != answer_entry["id"]:
        raise ValueError(f"item {item['id']!r} scored against the answer of {answer_entry['id']!r}")
    if not is_decoded_format(calls):
        return False, "ast_decoder:decoder_wrong_output_format", ["not a list of {function: {argument: value}}"]
    ast_checker, python = _checker()
    category = category_of(item["id"])
    result = ast_checker(item["function"], calls, answer_entry["ground_truth"], python, category, CHECKER_MODEL_NAME)
    if result["valid"]:
        return True, None, []
    return False, result.get("error_type"), result.get("error", [])


def score_text(item: dict, answer_entry: dict, text: str, *, allow_calibration: bool = False, rule: str = SPLIT_RULE):
    """`parse_tool_calls` then `score_item`; undecodable text scores "ast_decoder:decoder_failed", as in BFCL."""
    _refuse_calibration(item, allow_calibration, rule)
    try:
        calls = parse_tool_calls(text)
    except ParseError as e:
        return False, "ast_decoder:decoder_failed", [str(e)]
    return score_item(item, answer_entry, calls, allow_calibration=allow_calibration, rule=rule)


# ---- aggregation ----------------------------------------------------------------------------------------------------


def summarize(per_category: dict[str, tuple[int, int]]) -> dict[str, float | None]:
    """{"non_live", "live", "overall"} from {category: (correct, n)} (see the module docstring for the weighting).

    A mean is None unless every category it covers is present with n > 0 (the live mean needs them present, and a
    positive total).
    """
    for category in per_category:
        _check_category(category)
    acc = {c: k / n for c, (k, n) in per_category.items() if n > 0}

    def unweighted(cats):
        return sum(acc[c] for c in cats) / len(cats) if all(c in acc for c in cats) else None

    live = None
    if all(c in per_category for c in LIVE) and sum(per_category[c][1] for c in LIVE) > 0:
        live = sum(per_category[c][0] for c in LIVE) / sum(per_category[c][1] for c in LIVE)
    return {"non_live": unweighted(NON_LIVE), "live": live, "overall": unweighted(CATEGORIES)}
