"""`pask-jax compare`: several `pask-jax run` outputs of one input, side by side.

For every custom_id: each output's tool calls (or content), finish reason and kept/full KV. Per output: answered
requests, calls made, the fraction of calls whose arguments validate against their tool's JSON Schema (checked by
the `jsonschema` package, independently of the grammar that produced them), and the mean kept/full KV fraction.
"""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema

from pask_jax.batch_file import read_input


def _tool_schemas(body: dict) -> dict[str, dict]:
    schemas = {}
    for tool in body.get("tools") or ():
        function = tool.get("function", tool) if isinstance(tool, dict) else {}
        if isinstance(function.get("name"), str):
            schemas[function["name"]] = function.get("parameters") or {"type": "object"}
    return schemas


def _answers(path: Path) -> dict[str, dict]:
    with path.open(encoding="utf-8") as f:
        records = [json.loads(line) for line in f if line.strip()]
    return {r["custom_id"]: r for r in records if r.get("custom_id") is not None}


def call_is_valid(call: dict, schemas: dict[str, dict]) -> bool:
    """A tool call names a tool of the request and its arguments validate against that tool's parameters."""
    function = call["function"]
    if function["name"] not in schemas:
        return False
    try:
        jsonschema.validate(json.loads(function["arguments"]), schemas[function["name"]])
    except (json.JSONDecodeError, jsonschema.ValidationError):
        return False
    return True


def compare_outputs(input_path: str | Path, output_paths: list[str | Path]) -> dict:
    """{"rows": [{custom_id, answers: [per output]}], "totals": [per output]} (see the module docstring)."""
    lines = [entry for entry in read_input(Path(input_path)) if entry.body is not None]
    outputs = [(str(p), _answers(Path(p))) for p in output_paths]
    rows, totals = (
        [],
        [{"output": name, "answered": 0, "calls": 0, "valid_calls": 0, "kept": []} for name, _ in outputs],
    )
    for entry in lines:
        schemas = _tool_schemas(entry.body)
        row = {"custom_id": entry.custom_id, "answers": []}
        for (_, answers), total in zip(outputs, totals, strict=True):
            record = answers.get(entry.custom_id)
            if record is None or record.get("response") is None:
                error = (record or {}).get("error") or {"message": "not answered"}
                row["answers"].append({"error": error["message"]})
                continue
            body = record["response"]["body"]
            choice = body["choices"][0]
            calls = choice["message"].get("tool_calls") or []
            valid = [call_is_valid(c, schemas) for c in calls]
            total["answered"] += 1
            total["calls"] += len(calls)
            total["valid_calls"] += sum(valid)
            total["kept"].append(body["pask"]["kept_ratio_mean"])
            row["answers"].append(
                {
                    "calls": [f"{c['function']['name']}({c['function']['arguments']})" for c in calls],
                    "valid": valid,
                    "content": choice["message"].get("content"),
                    "finish_reason": choice["finish_reason"],
                    "kept": body["pask"]["kept_ratio_mean"],
                    "method": f"{body['pask']['method']}@{body['pask']['budget']:g}",
                }
            )
        rows.append(row)
    for total in totals:
        kept = total.pop("kept")
        total["valid_fraction"] = total["valid_calls"] / total["calls"] if total["calls"] else None
        total["kept_ratio_mean"] = sum(kept) / len(kept) if kept else None
    return {"rows": rows, "totals": totals}


def format_comparison(result: dict, width: int = 100) -> str:
    if not result["rows"]:
        return "0 requests: the input holds no request lines, nothing to compare"
    out = []
    for row in result["rows"]:
        out.append(f"--- {row['custom_id']}")
        for answer in row["answers"]:
            if "error" in answer:
                out.append(f"    error: {answer['error'][:width]}")
                continue
            head = f"    [{answer['method']}, kept {answer['kept']:.2f}, {answer['finish_reason']}]"
            if answer["calls"]:
                for call, ok in zip(answer["calls"], answer["valid"], strict=True):
                    out.append(f"{head} {'' if ok else '(schema-invalid) '}{call[:width]}")
                    head = " " * len(head)
            else:
                out.append(f"{head} {json.dumps(answer['content'])[:width]}")
    out.append("")
    for total in result["totals"]:
        valid = "-" if total["valid_fraction"] is None else f"{total['valid_fraction']:.2f}"
        kept = "-" if total["kept_ratio_mean"] is None else f"{total['kept_ratio_mean']:.3f}"
        out.append(
            f"{total['output']}: {total['answered']} answered, {total['calls']} calls, schema-valid {valid}, "
            f"kept/full KV {kept}"
        )
    return "\n".join(out)
