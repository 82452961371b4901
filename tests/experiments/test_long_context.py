"""Long tool-calling prompts: distractor tools up to a target length, the question before or after the tools."""

from __future__ import annotations

import pytest

from pask_jax import load_tokenizer
from pask_jax.experiments import bfcl
from pask_jax.experiments.bfcl.long_context import (
    QUESTION_FIRST_ASK,
    distractor_pool,
    item_of_prompt,
    item_seed,
    long_context_prompt,
    prompt_id,
    question_messages,
)
from pask_jax.experiments.bfcl.prompt import bfcl_prompt, format_tool_prompt
from pask_jax.structure import prompt_roles


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer("qwen")


@pytest.mark.parametrize("layout", ["question_last", "question_first"])
def test_the_tools_list_fills_up_to_the_target(tokenizer, layout: str):
    item = bfcl.evaluation_sample("simple_python", 0, 1)[0]
    messages, tools = long_context_prompt(item, tokenizer, 2048, seed=0, layout=layout)
    text = format_tool_prompt(messages, tools)
    n = len(tokenizer.encode(text))
    assert 0.9 * 2048 <= n <= 2048, n
    names = [t["name"] for t in tools]
    assert item["function"][0]["name"] in names and len(names) == len(set(names)) > 5
    assert len(prompt_roles(text, tokenizer, messages, tools)) == n
    assert n > 3 * len(tokenizer.encode(bfcl_prompt(item)))
    question = item["question"][0][-1]["content"]
    tools_at = text.index("<tools>")
    if layout == "question_first":  # the question sits before the tools list, the last turn only asks for the call
        assert text.index(question) < tools_at and text.rindex(QUESTION_FIRST_ASK) > tools_at
    else:
        assert text.rindex(question) > tools_at
    assert long_context_prompt(item, tokenizer, 2048, seed=0, layout=layout) == (messages, tools)  # deterministic


def test_question_first_keeps_a_system_message_and_refuses_unknown_layouts():
    item = {"question": [[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather?"}]]}
    (system, user) = question_messages(item, "question_first")
    assert system["content"].startswith("Be brief.\n\n") and system["content"].endswith("Weather?")
    assert user == {"role": "user", "content": QUESTION_FIRST_ASK}
    assert question_messages(item, "question_last") == item["question"][0]
    with pytest.raises(ValueError, match="layout"):
        question_messages(item, "middle")
    assert item_seed("simple_python_1") == item_seed("simple_python_1") != item_seed("simple_python_2")


def test_dev_prompts_take_their_distractors_from_dev_items_only(tokenizer):
    """Tuning on long dev prompts must not show evaluation schemas: every tool of a dev prompt is a dev function."""
    dev_names = {f["name"] for f, _ in distractor_pool(tokenizer, "dev")}
    evaluation_names = {f["name"] for f, _ in distractor_pool(tokenizer, "evaluation")}
    item = bfcl.dev_sample("live_multiple", 0, 1)[0]
    _, tools = long_context_prompt(item, tokenizer, 2048, seed=0, split="dev")
    assert len(tools) > 5 and {t["name"] for t in tools} <= dev_names
    assert {t["name"] for t in tools} - evaluation_names  # not merely names both splits share
    with pytest.raises(ValueError, match="split 'train'"):
        distractor_pool(tokenizer, "train")


def test_calibration_prompts_take_their_distractors_from_calibration_items_only(tokenizer):
    """Long calibration prompts show no dev or evaluation schema that the calibration part does not also have."""
    pools = {part: {f["name"] for f, _ in distractor_pool(tokenizer, part)} for part in bfcl.PARTS}
    item = bfcl.split_items("multiple").calibration[0]
    _, tools = long_context_prompt(item, tokenizer, 2048, seed=item_seed(item["id"]), split="calibration")
    names = {t["name"] for t in tools}
    assert len(names) > 5 and names <= pools["calibration"]
    assert names - pools["dev"] and names - pools["evaluation"]
    assert prompt_id(item["id"]) == item["id"] == item_of_prompt(prompt_id(item["id"], 2048, "question_first"))
    assert prompt_id(item["id"], 0, "question_first") == item["id"] + "@0:question_first"
