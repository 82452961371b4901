"""A user's own calibration data: the OpenAI Batch lines `pask-jax run` reads, split by tool set.

Every line is checked (envelope, request body) before anything loads; a bad line is an error naming its line number
and custom_id (`CalibrationDataError`). Calibration measures structured answers, so requests whose answer follows no
grammar (no tools or tool_choice none, and no JSON response format) are left out, with a warning naming them.

Split (`split_requests`). Requests are grouped by their tool-set fingerprint (`tool_set_fingerprint`: sha256 of the
sorted function names with their canonical JSON parameter schemas, and of the JSON response schema; descriptions and
tool order do not count), so requests sharing a tool set land in the same part and the dev part's tool sets are never
calibrated on. The groups, in the order of their fingerprints, go to the dev part while that brings its request count
closer to `dev_fraction` of all requests; at least one group goes to each part when there are two or more. The split
depends only on the file's requests (not their order); a split that cannot separate tool sets (one tool set, a dev
fraction above 0) is an error saying what to do.

`write_split` puts the dev part next to the policy: `dev.jsonl` (those Batch lines, to run with `pask-jax run`) and
`split.json` (the custom_ids of both parts, the data file's sha256 and the fraction).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import warnings
from collections.abc import Sequence
from pathlib import Path

from pask_jax.batch_file import BATCH_URL, read_input
from pask_jax.requests import ChatRequest, PreparedRequest, RequestBuilder, parse_request

DEFAULT_DEV_FRACTION = 0.2
SPLIT_FILE, DEV_FILE = "split.json", "dev.jsonl"
SHOWN_ERRORS = 10  # bad lines named in one error


class CalibrationDataError(ValueError):
    """Calibration data that cannot be used; the message names the lines and what to do."""


@dataclasses.dataclass(frozen=True)
class CalibrationRequest:
    """One input line: where it is, its custom_id, its body and the request parsed from it."""

    line: int  # 1-based line number in the input
    custom_id: str
    body: dict
    request: ChatRequest
    tool_set: str  # tool_set_fingerprint(request)


@dataclasses.dataclass(frozen=True)
class RequestSplit:
    """The calibration and dev parts of one input, each in the file's order."""

    calibration: tuple[CalibrationRequest, ...]
    dev: tuple[CalibrationRequest, ...]
    dev_fraction: float  # the fraction asked for

    def tool_sets(self, part: str) -> int:
        return len({r.tool_set for r in getattr(self, part)})


def tool_set_fingerprint(request: ChatRequest) -> str:
    """sha256 of the request's sorted (function name, canonical JSON parameters) and of its JSON response schema."""
    tools = sorted(json.dumps([t["name"], t.get("parameters")], sort_keys=True) for t in request.tools)
    response = request.response_schema if request.response_json else None
    key = json.dumps({"tools": tools, "response": response}, sort_keys=True)
    return hashlib.sha256(key.encode("utf-8")).hexdigest()


def _raise_errors(path: Path, errors: list[str]) -> None:
    if errors:
        more = f"\n(and {len(errors) - SHOWN_ERRORS} more)" if len(errors) > SHOWN_ERRORS else ""
        raise CalibrationDataError(
            f"{path}: {len(errors)} line(s) cannot be calibrated on:\n" + "\n".join(errors[:SHOWN_ERRORS]) + more
        )


def read_requests(path: str | Path) -> list[CalibrationRequest]:
    """Every line of an OpenAI Batch input file, checked and parsed (CalibrationDataError naming each bad line)."""
    path = Path(path)
    if not path.is_file():
        raise CalibrationDataError(f"calibration data {path} does not exist")
    out, errors, free_text = [], [], []
    for entry in read_input(path):
        where = f"line {entry.line}" + (f" (custom_id {entry.custom_id!r})" if entry.custom_id else "")
        if entry.error is not None:  # the envelope's message may name the line itself
            errors.append(f"{where}: {entry.error[1].removeprefix(f'line {entry.line} ')}")
            continue
        try:
            request = parse_request(entry.body)
        except ValueError as e:
            errors.append(f"{where}: {e}")
            continue
        if not request.constrained:
            free_text.append(where)
            continue
        out.append(CalibrationRequest(entry.line, entry.custom_id, entry.body, request, tool_set_fingerprint(request)))
    _raise_errors(path, errors)
    if free_text:
        more = f" (and {len(free_text) - SHOWN_ERRORS} more)" if len(free_text) > SHOWN_ERRORS else ""
        warnings.warn(
            f"{path}: not calibrating on {len(free_text)} request(s) whose answer follows no grammar (no tools, or "
            f"tool_choice none, and no JSON response format): {'; '.join(free_text[:SHOWN_ERRORS])}{more}",
            stacklevel=2,
        )
    if not out:
        raise CalibrationDataError(
            f"{path} holds no request with a structured answer (tools, or response_format json_object / json_schema)"
        )
    return out


def split_requests(requests: Sequence[CalibrationRequest], dev_fraction: float = DEFAULT_DEV_FRACTION) -> RequestSplit:
    """Calibration and dev parts with no tool set in common (see the module docstring)."""
    if not 0.0 <= dev_fraction < 1.0:
        raise CalibrationDataError(f"dev_fraction={dev_fraction} must be in [0, 1)")
    sizes: dict[str, int] = {}
    for r in requests:
        sizes[r.tool_set] = sizes.get(r.tool_set, 0) + 1
    if dev_fraction > 0 and len(sizes) < 2:
        raise CalibrationDataError(
            f"all {len(requests)} requests share one tool set, so no dev part with other tool sets can be split off: "
            "pass --dev-fraction 0 to calibrate on all of them (then check the policy on requests with other tools)"
        )
    target, dev, count = dev_fraction * len(requests), [], 0
    for key in sorted(sizes):
        if count + sizes[key] / 2 < target:  # taking the group brings the dev count closer to the target
            dev.append(key)
            count += sizes[key]
    if dev_fraction > 0 and not dev:  # every group is larger than twice the target: the smallest one
        dev = [min(sorted(sizes), key=sizes.__getitem__)]
    if len(dev) == len(sizes):  # the calibration part keeps at least one group
        dev.pop()
    dev_keys = set(dev)
    return RequestSplit(
        calibration=tuple(r for r in requests if r.tool_set not in dev_keys),
        dev=tuple(r for r in requests if r.tool_set in dev_keys),
        dev_fraction=dev_fraction,
    )


def prepare_requests(
    builder: RequestBuilder, requests: Sequence[CalibrationRequest], source: str | Path
) -> list[tuple[str, PreparedRequest]]:
    """(custom_id, rendered + tokenized + compiled request) for each request; CalibrationDataError naming every line
    the chat template, the context limit or the grammar refuses."""
    if builder.template is None:
        raise CalibrationDataError(
            "this model ships no chat template: give the checkpoint's tokenizer_config.json one (calibration renders "
            "each request with the model's own template)"
        )
    out, errors = [], []
    for r in requests:
        try:
            out.append((r.custom_id, builder.prepare(r.request)))
        except ValueError as e:  # RequestError, GrammarError
            errors.append(f"line {r.line} (custom_id {r.custom_id!r}): {e}")
    _raise_errors(Path(source), errors)
    return out


def data_digest(requests: Sequence[CalibrationRequest]) -> str:
    """sha256 over the custom_ids and canonical bodies of `requests` (what a resumed calibration must match)."""
    digest = hashlib.sha256()
    for r in requests:
        digest.update(json.dumps([r.custom_id, r.body], sort_keys=True).encode("utf-8") + b"\n")
    return digest.hexdigest()


def write_split(directory: str | Path, split: RequestSplit, source: str | Path) -> tuple[Path, Path]:
    """`dev.jsonl` (the dev part's Batch lines) and `split.json` (both parts' custom_ids) in `directory`."""
    directory, source = Path(directory), Path(source)
    directory.mkdir(parents=True, exist_ok=True)
    dev_path, split_path = directory / DEV_FILE, directory / SPLIT_FILE
    lines = [
        json.dumps({"custom_id": r.custom_id, "method": "POST", "url": BATCH_URL, "body": r.body}, ensure_ascii=False)
        for r in split.dev
    ]
    dev_path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    summary = {
        "data": source.name,
        "data_sha256": hashlib.sha256(source.read_bytes()).hexdigest(),
        "dev_fraction": split.dev_fraction,
        "tool_sets": {part: split.tool_sets(part) for part in ("calibration", "dev")},
        "calibration": [r.custom_id for r in split.calibration],
        "dev": [r.custom_id for r in split.dev],
    }
    split_path.write_text(json.dumps(summary, indent=1) + "\n")
    return dev_path, split_path
