"""The tables of docs/results/demo.md, your own requests: tool calls under ``auto`` on the own request set."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import jsonschema

from tools.report.common import ReportError, _block, _table

AUTO_REQUESTS = "examples/auto_requests.jsonl"
# the set's requests that need no call: a question no tool answers, or an answer the tool result already holds
NO_CALL_REQUESTS = frozenset(
    {"no-tool-fun-fact", "no-tool-arithmetic", "no-tool-sql-explain", "long-system-no-tool-baggage",
     "tool-result-answer-in-text"}
)  # fmt: skip
TOOL_CALL_RUNS = (  # (method, tool_choice, grammar, file)
    ("full KV", "auto", "text only", "results/auto/before_steering/full_auto.jsonl"),
    ("full KV", "auto", "steered", "results/auto/full_auto.jsonl"),
    ("full KV", "required", "", "results/auto/full_required.jsonl"),
    ("PASK, b = 0.33", "auto", "text only", "results/auto/before_steering/pask_auto.jsonl"),
    ("PASK, b = 0.33", "auto", "steered", "results/auto/pask_auto.jsonl"),
    ("PASK, b = 0.33", "auto", "steered, llguidance backend", "results/auto/pask_auto_llguidance.jsonl"),
    ("PASK, b = 0.33", "required", "", "results/auto/pask_required.jsonl"),
    ("SnapKV, b = 0.33", "auto", "text only", "results/auto/before_steering/snapkv_auto.jsonl"),
    ("SnapKV, b = 0.33", "auto", "steered", "results/auto/snapkv_auto.jsonl"),
    ("SnapKV, b = 0.33", "required", "", "results/auto/snapkv_required.jsonl"),
)


def _jsonl(root: Path, relative: str) -> list[dict]:
    path = root / relative
    if not path.is_file():
        raise ReportError(f"{relative}: no such results file")
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def tool_call_rates(root: Path) -> str:
    """Answers carrying `tool_calls` on the own request set, by method, tool_choice and the auto grammar, with the
    requests that need a call apart from those that need none; a call is schema-valid when `jsonschema` accepts its
    arguments against its tool's parameters."""
    tools = {
        line["custom_id"]: {t["function"]["name"]: t["function"].get("parameters", {}) for t in line["body"]["tools"]}
        for line in _jsonl(root, AUTO_REQUESTS)
    }
    need = len(tools.keys() - NO_CALL_REQUESTS)
    rows, rates = [], {}
    for method, choice, grammar, file in TOOL_CALL_RUNS:
        called, valid, calls = set(), 0, 0
        for line in _jsonl(root, file):
            message = line["response"]["body"]["choices"][0]["message"] if line.get("response") else {}
            for call in message.get("tool_calls") or []:
                called.add(line["custom_id"])
                schema = tools[line["custom_id"]].get(call["function"]["name"])
                calls += 1
                valid += schema is not None and jsonschema.Draft202012Validator(schema).is_valid(
                    json.loads(call["function"]["arguments"])
                )
        rates[(method, choice, grammar)] = len(called)
        rows.append([method, choice, grammar or "-", f"{len(called)} of {len(tools)}",
                     f"{len(called - NO_CALL_REQUESTS)} of {need}", f"{len(called & NO_CALL_REQUESTS)} of "
                     f"{len(NO_CALL_REQUESTS)}", f"{valid} of {calls}" if calls else "-"])  # fmt: skip
    claim = (
        f"Under `auto`, a call the model opens with {{ or a fence held to the schema (steered) takes PASK at b = 0.33 "
        f"from {rates[('PASK, b = 0.33', 'auto', 'text only')]} to {rates[('PASK, b = 0.33', 'auto', 'steered')]} "
        f"answers with tool calls of {len(tools)} (full KV {rates[('full KV', 'auto', 'text only')]} -> "
        f"{rates[('full KV', 'auto', 'steered')]}, SnapKV {rates[('SnapKV, b = 0.33', 'auto', 'text only')]} -> "
        f"{rates[('SnapKV, b = 0.33', 'auto', 'steered')]})."
    )
    head = ["method", "tool_choice", "auto grammar", "answers with tool_calls", "on requests needing a call",
            "on requests needing none", "schema-valid calls"]  # fmt: skip
    return _block(claim, _table(head, rows))


TABLES: dict[str, Callable[[Path], str]] = {
    "tool_call_rates": tool_call_rates,
}
