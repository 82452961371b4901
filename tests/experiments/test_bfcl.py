"""BFCL harness: split, canonical gold calls, decoding, bfcl-eval's own checker, aggregation."""

import functools
import importlib.util
import json
import sys

import pytest

pytest.importorskip("bfcl_eval")

from pask_jax.experiments import bfcl  # noqa: E402

SIZES = {  # (calibration, dev, evaluation) under the schema split; totals are EVAL_MODELS.md's category sizes
    "simple_python": (30, 53, 317),
    "multiple": (25, 20, 155),
    "parallel": (14, 23, 163),
    "parallel_multiple": (22, 30, 148),
    "live_simple": (15, 10, 233),
    "live_multiple": (111, 111, 831),
    "live_parallel": (0, 4, 12),
    "live_parallel_multiple": (0, 1, 23),
}
ITEM_HASH_SIZES = {  # (calibration, evaluation) under the earlier per-item split
    "simple_python": (69, 331),
    "multiple": (45, 155),
    "parallel": (37, 163),
    "parallel_multiple": (48, 152),
    "live_simple": (54, 204),
    "live_multiple": (192, 861),
    "live_parallel": (3, 13),
    "live_parallel_multiple": (4, 20),
}


_answers = functools.cache(bfcl.load_answers)


def _answer(item):
    return _answers(bfcl.category_of(item["id"]))[item["id"]]


def _gold(item):
    return [{name: args} for name, args in bfcl.canonical_calls(_answer(item), item["function"])]


def _tool_calls(calls):
    return "".join(
        f"<tool_call>\n{json.dumps({'name': n, 'arguments': a})}\n</tool_call>\n" for c in calls for n, a in c.items()
    )


# ---- split ----------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("category", bfcl.CATEGORIES)
def test_split_is_fixed_disjoint_and_complete(category):
    items = bfcl.load_category(category)
    split = bfcl.split_items(category)
    assert tuple(len(part) for part in split) == SIZES[category]
    ids = [[it["id"] for it in part] for part in split]
    assert sorted(sum(ids, [])) == sorted(it["id"] for it in items)  # complete and disjoint
    order = {it["id"]: i for i, it in enumerate(items)}
    for part in ids:
        assert [order[i] for i in part] == sorted(order[i] for i in part)  # file order kept
    assert bfcl.split_items(category) == split


def test_evaluation_shares_no_tool_set_or_live_group_with_calibration_or_dev():
    seen: dict[str, dict[str, set]] = {"tools": {}, "group": {}}
    for category in bfcl.CATEGORIES:
        for part, items in bfcl.split_items(category)._asdict().items():
            for item in items:
                held_out = "evaluation" if part == "evaluation" else "fitting"
                seen["tools"].setdefault(bfcl.tool_set_key(item["function"]), set()).add(held_out)
                if category.startswith("live_"):
                    seen["group"].setdefault(item["id"].rsplit("-", 2)[1], set()).add(held_out)
    for kind, keys in seen.items():
        shared = [key for key, parts in keys.items() if len(parts) > 1]
        assert not shared, (kind, shared[:3])
    assert len(seen["tools"]) > 1000  # the keys really vary (not one key for every item)


def test_split_fractions_and_the_item_hash_rule():
    totals = [sum(sizes[i] for sizes in SIZES.values()) for i in range(3)]
    assert 0.07 < totals[0] / sum(totals) < 0.13 and 0.07 < totals[1] / sum(totals) < 0.13
    for category, (cal, evaluation) in ITEM_HASH_SIZES.items():
        split = bfcl.split_items(category, "item-hash")
        assert (len(split.calibration), len(split.evaluation)) == (cal, evaluation)
        assert split.dev == split.calibration  # item-hash dev runs pick an offset past a policy's items
    for item_id in ("simple_python_20", "simple_python_23", "multiple_1", "parallel_1", "live_simple_4-3-0"):
        assert bfcl.is_calibration(item_id, "item-hash")
    for item_id in ("simple_python_0", "simple_python_1", "multiple_0", "parallel_0", "live_multiple_0-0-0"):
        assert not bfcl.is_calibration(item_id, "item-hash")
    with pytest.raises(ValueError, match="unknown split rule"):
        bfcl.part_of("simple_python_0", "random")
    with pytest.raises(ValueError, match="not a BFCL item"):
        bfcl.part_of("simple_java_0")


def test_evaluation_sample_offsets():
    evaluation = bfcl.split_items("parallel").evaluation
    assert [it["id"] for it in bfcl.evaluation_sample("parallel")[:3]] == ["parallel_0", "parallel_2", "parallel_3"]
    assert bfcl.evaluation_sample("parallel") == evaluation[:25]
    assert bfcl.evaluation_sample("parallel", offset=25, limit=10) == evaluation[25:35]
    assert bfcl.evaluation_sample("parallel", offset=160, limit=25) == evaluation[160:]  # 3 left
    assert len(bfcl.evaluation_sample("live_parallel")) == 12  # fewer than 25: all of it
    assert bfcl.evaluation_sample("live_parallel", offset=12) == []
    assert len(bfcl.evaluation_sample("multiple", limit=None)) == 155
    assert all(bfcl.part_of(it["id"]) == "evaluation" for it in bfcl.evaluation_sample("live_multiple", limit=200))
    with pytest.raises(ValueError):
        bfcl.evaluation_sample("parallel", offset=-1)


def test_unknown_category():
    for call in (bfcl.load_category, bfcl.load_answers, bfcl.split_items, bfcl.evaluation_sample):
        with pytest.raises(ValueError, match="known: simple_python, multiple"):
            call("simple_java")
    with pytest.raises(ValueError, match="unknown BFCL category"):
        bfcl.summarize({"irrelevance": (1, 2)})


def test_calibration_items_are_never_scored():
    item = bfcl.split_items("simple_python").calibration[0]
    with pytest.raises(ValueError, match="calibration"):
        bfcl.score_item(item, _answer(item), _gold(item))
    with pytest.raises(ValueError, match="calibration"):
        bfcl.score_text(item, _answer(item), "garbage")
    assert bfcl.score_item(item, _answer(item), _gold(item), allow_calibration=True)[0]


# ---- canonical gold calls against the real checker ------------------------------------------------------------------


@pytest.mark.parametrize("category", bfcl.CATEGORIES)
def test_canonical_calls_pass_the_checker(category):
    for item in bfcl.load_category(category)[:20]:
        valid, error_type, errors = bfcl.score_item(item, _answer(item), _gold(item), allow_calibration=True)
        assert valid, (item["id"], error_type, errors)
        assert bfcl.score_text(item, _answer(item), _tool_calls(_gold(item)), allow_calibration=True)[0]


def test_canonical_calls_of_every_item():
    """Every gold in the data renders to calls the checker accepts, except the few no call can satisfy."""
    failing = set()
    for category in bfcl.CATEGORIES:
        for item in bfcl.load_category(category):
            if not bfcl.score_item(item, _answer(item), _gold(item), allow_calibration=True)[0]:
                failing.add(item["id"])
    assert failing == bfcl.UNSATISFIABLE


def test_canonical_calls_rendering():
    answer = {"id": "x", "ground_truth": [{"f.g": {"a": [1, 2], "b": ["", "x"], "c": ["y", ""], "d": [{"k": ["v"]}]}}]}
    assert bfcl.canonical_calls(answer) == [("f.g", {"a": 1, "c": "y", "d": {"k": "v"}})]
    schema = {"properties": {k: {} for k in "abcd"}, "required": ["a", "b"]}
    # with the schema: a required argument whose gold allows omission still gets its first real value
    assert bfcl.canonical_calls(answer, [{"name": "f.g", "parameters": schema}]) == [
        ("f.g", {"a": 1, "b": "x", "c": "y", "d": {"k": "v"}})
    ]
    # simple_python_200: fuel_efficiency is required though its gold starts with ""
    item = next(it for it in bfcl.load_category("simple_python") if it["id"] == "simple_python_200")
    assert bfcl.canonical_calls(_answer(item), item["function"])[0][1]["fuel_efficiency"] == 25.0
    assert not bfcl.score_item(item, _answer(item), [dict([c]) for c in bfcl.canonical_calls(_answer(item))])[0]


# ---- checker verdicts -----------------------------------------------------------------------------------------------


def test_wrong_calls_fail_with_bfcl_error_types():
    item = bfcl.evaluation_sample("simple_python", limit=1)[0]  # calculate_triangle_area(base=10, height=5)
    answer = _answer(item)
    assert bfcl.score_item(item, answer, [{"calculate_triangle_area": {"base": 10, "height": 5}}]) == (True, None, [])
    cases = {
        "simple_function_checker:wrong_func_name": [{"triangle_area": {"base": 10, "height": 5}}],
        "value_error:others": [{"calculate_triangle_area": {"base": 11, "height": 5}}],
        "value_error:string": [{"calculate_triangle_area": {"base": 10, "height": 5, "unit": "cm"}}],
        "type_error:simple": [{"calculate_triangle_area": {"base": 10.5, "height": 5}}],
        "simple_function_checker:missing_required": [{"calculate_triangle_area": {"base": 10}}],
        "simple_function_checker:unexpected_param": [{"calculate_triangle_area": {"base": 10, "height": 5, "x": 1}}],
        "simple_function_checker:wrong_count": [],
        "ast_decoder:decoder_wrong_output_format": [{"calculate_triangle_area": 10}],
    }
    for error_type, calls in cases.items():
        valid, got, errors = bfcl.score_item(item, answer, calls)
        assert (valid, got) == (False, error_type), (calls, errors)
    assert bfcl.score_text(item, answer, "The area is 25.")[:2] == (False, "ast_decoder:decoder_failed")


def test_parallel_calls_any_order():
    item = bfcl.evaluation_sample("parallel", limit=1)[0]  # spotify.play x2
    answer = _answer(item)
    gold = _gold(item)
    assert bfcl.score_item(item, answer, gold[::-1])[0]
    assert bfcl.score_text(item, answer, _tool_calls(gold))[0]
    assert bfcl.score_item(item, answer, gold[:1])[1] == "parallel_function_checker_no_order:wrong_count"
    wrong = [gold[0], {"spotify.play": {"artist": "Maroon 5", "duration": 16}}]
    assert bfcl.score_item(item, answer, wrong)[1] == "parallel_function_checker_no_order:cannot_find_match"


def test_checker_uses_the_stand_in_model_config():
    bfcl._checker()
    stand_in = sys.modules["bfcl_eval.constants.model_config"]
    assert stand_in.MODEL_CONFIG_MAPPING["any/model"].underscore_to_dot is False
    assert "bfcl_eval.model_handler" not in sys.modules  # no API clients pulled in


def test_missing_bfcl_eval(monkeypatch):
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "bfcl_eval" else find_spec(name))
    for call in (bfcl.data_dir, lambda: bfcl.load_category("parallel"), bfcl._checker.__wrapped__):
        with pytest.raises(ModuleNotFoundError, match=r"pip install --no-deps bfcl-eval==2026\.3\.23"):
            call()


# ---- decoding -------------------------------------------------------------------------------------------------------


def test_parse_tool_call_framing():
    one = '<tool_call>\n{"name": "math.gcd", "arguments": {"a": 12, "b": 18}}\n</tool_call>'
    assert bfcl.parse_tool_calls(one) == [{"math.gcd": {"a": 12, "b": 18}}]
    two = (
        one + '\n<tool_call>\n{"name": "f", "arguments": {"s": "x", "l": [1.5, null], "d": {"k": true}}}\n</tool_call>'
    )
    assert bfcl.parse_tool_calls(two) == [
        {"math.gcd": {"a": 12, "b": 18}},
        {"f": {"s": "x", "l": [1.5, None], "d": {"k": True}}},
    ]
    assert bfcl.parse_tool_calls("Sure.\n" + one + "<|im_end|>") == [{"math.gcd": {"a": 12, "b": 18}}]


def test_parse_json_fence_framing():
    single = '```json\n{"name": "math.gcd", "arguments": {"a": 12, "b": 18}}\n```'
    assert bfcl.parse_tool_calls(single) == [{"math.gcd": {"a": 12, "b": 18}}]
    many = '```json\n[{"name": "f", "arguments": {}}, {"name": "g", "arguments": {"x": "y"}}]\n```'
    assert bfcl.parse_tool_calls(many) == [{"f": {}}, {"g": {"x": "y"}}]
    assert bfcl.parse_tool_calls('Here:\n```\n{"name": "f", "arguments": {}}\n```\n') == [{"f": {}}]


@pytest.mark.parametrize(
    "text",
    [
        "",
        "The answer is 6.",
        '{"name": "f", "arguments": {}}',  # no framing
        "<tool_call>\nmath.gcd(a=12, b=18)\n</tool_call>",  # Python syntax, not JSON
        "<tool_call>\n{'name': 'f', 'arguments': {}}\n</tool_call>",  # not strict JSON
        '<tool_call>\n{"name": "f", "arguments": {"x": NaN}}\n</tool_call>',
        '<tool_call>\n{"name": "f", "arguments": {"x": 1}\n</tool_call>',  # truncated
        '<tool_call>\n{"name": "f", "arguments": "{\\"x\\": 1}"}\n</tool_call>',  # arguments as a string
        '<tool_call>\n{"name": "f"}\n</tool_call>',
        '<tool_call>\n[{"name": "f", "arguments": {}}]\n</tool_call>',
        "```json\n[]\n```",
        '<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call><tool_call>\n{"name": \n</tool_call>',
    ],
)
def test_parse_rejects_garbage(text):
    with pytest.raises(bfcl.ParseError):
        bfcl.parse_tool_calls(text)


# ---- aggregation ----------------------------------------------------------------------------------------------------


def test_summarize():
    per = {
        "simple_python": (20, 25),  # 0.8
        "multiple": (15, 25),  # 0.6
        "parallel": (10, 25),  # 0.4
        "parallel_multiple": (5, 25),  # 0.2
        "live_simple": (20, 25),  # 0.8
        "live_multiple": (10, 25),  # 0.4
        "live_parallel": (13, 13),  # 1.0
        "live_parallel_multiple": (0, 20),  # 0.0
    }
    s = bfcl.summarize(per)
    assert s["non_live"] == pytest.approx(0.5)  # unweighted over the 4
    assert s["live"] == pytest.approx(43 / 83)  # weighted by count
    assert s["overall"] == pytest.approx((0.8 + 0.6 + 0.4 + 0.2 + 0.8 + 0.4 + 1.0 + 0.0) / 8)
    partial = bfcl.summarize({k: per[k] for k in bfcl.NON_LIVE})
    assert partial == {"non_live": pytest.approx(0.5), "live": None, "overall": None}
    assert bfcl.summarize({**per, "multiple": (0, 0)})["non_live"] is None


def test_dev_sample_is_its_own_part():
    assert bfcl.dev_sample("multiple", offset=2, limit=5) == bfcl.split_items("multiple").dev[2:7]
    assert all(bfcl.part_of(it["id"]) == "dev" for it in bfcl.dev_sample("live_simple", 0, None))
    assert bfcl.dev_sample("multiple", 8, 5, rule="item-hash") == bfcl.split_items("multiple", "item-hash").dev[8:13]
    with pytest.raises(ValueError, match="offset"):
        bfcl.dev_sample("multiple", offset=-2)
