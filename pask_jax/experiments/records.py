"""Long structured outputs: every record of a generated shipping manifest, extracted into one JSON array.

    pask-jax records --methods full,snapkv,kivi --budgets 0.1,0.33 --split dev --items 20 --out results/records.json

BFCL's answers are short (at most 128 tokens), so the KV of the generated tokens is a small part of the cache. Here
the answer is long (512-2,048 tokens): the generated tokens dominate the cache, and a method that forgets which
records it already wrote, or mangles a field it copied, shows it.

- **Items from seeds.** Item ``index`` of split ``split`` is drawn from the seed ``SPLIT_SEEDS[split] + index``
  (dev: 0 .., evaluation: 1,000,000 ..; an index below ``SPLIT_SIZE``, so the splits never share a seed). It holds
  ``MIN_RECORDS``..``MAX_RECORDS`` shipment records (``RECORD_SCHEMA``: an id, the goods (an enum of ``GOODS``), a
  quantity, a weight, a status enum, a fragile flag, a ship date, a recipient and a nested destination), written as
  a manifest: one or two sentences per record from one of ``TEMPLATES`` (dates as "March 5, 2024", statuses as
  phrases), with a distractor sentence (``DISTRACTORS``: cancelled orders, notes about the warehouse) after about
  every third record.
- **The prompt** is one user message (``INSTRUCTION``, ``ANSWER_SCHEMA`` as JSON, the manifest) in the checkpoint's
  chat template; the answer is decoded under ``ANSWER_SCHEMA``'s grammar (a ``response_format`` json_schema, as
  `pask-jax run` decodes one), whose parser states give PASK the roles of the generated tokens.
- **Scoring is exact.** The answer is parsed (an answer the token limit cut keeps the records it wrote whole); a
  record is correct when every field equals the gold record's (numbers by value, booleans only as booleans). Answer
  and gold records are matched in order: the longest common subsequence of equal records, so a skipped or extra
  record costs itself, not the records after it. Fields are scored too, each gold record against the answer's
  record with its id (a small model that gets one field of a record wrong still shows what it copied): field F1
  over the records' scalar fields (``leaf_fields``). Per item: correct records, record precision / recall / F1,
  correct fields and field F1, exact (every gold record, in order, nothing else), valid JSON and schema-valid
  (``jsonschema``, formats checked: a "2024-02-30" is invalid). A resumed file's cells are scored again from their
  answers, so a scoring rule applies to every cell without a rerun. Per (method, budget): mean record F1, the exact-item
  rate, time per output token (decode seconds / generated tokens) and the KV bytes ratio as the BFCL harness reports
  it (``kv_bytes_ratio_mean``: mean over items; ``_max``: max over items).

Methods, budgets, the shared prefill and the resumable results file are as in `niah`: one cell per (method, budget,
item), a ``summary`` per (method, budget), the file rewritten after every batch; a rerun computes only missing cells
and refuses a file made under other settings.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import datetime
import hashlib
import json
from collections.abc import Mapping, Sequence
from pathlib import Path

import jax
import jsonschema
import numpy as np
from tqdm.auto import tqdm

from pask_jax.arguments import method_spec
from pask_jax.experiments.bench.machine import write_json
from pask_jax.experiments.bfcl.evaluate import EvalConfig, build_engines
from pask_jax.experiments.niah import check_methods, generation_fields, read_results, workload_config
from pask_jax.experiments.sweep import generate_shared
from pask_jax.models.decoder import Decoder
from pask_jax.models.tokenizer import Tokenizer
from pask_jax.policy import ModelFingerprint, PersistencePolicy
from pask_jax.requests import PreparedRequest, RequestBuilder, parse_request
from pask_jax.runtime.rows import Generation
from pask_jax.runtime.sampling import SamplingConfig
from pask_jax.runtime.shapes import length_bucket
from pask_jax.structure.backend import grammar_constraint

FORMAT = "pask-records-v1"
SPLITS = ("dev", "evaluation")
SPLIT_SIZE = 1_000_000  # items per split: the seed ranges [0, 1e6) and [1e6, 2e6) never meet
SPLIT_SEEDS = {"dev": 0, "evaluation": SPLIT_SIZE}
# Records per manifest, uniform. A record is ~95 Qwen tokens as json.dumps writes it (~74 without spaces), so the gold
# answer is 658-2,011 tokens (518-1,591 without spaces) over the first 200 items of each split (tested: 512-2,048).
MIN_RECORDS, MAX_RECORDS = 7, 21
STATUS_PHRASES = {
    "pending": "is awaiting pickup",
    "in_transit": "is in transit",
    "delivered": "has been delivered",
    "delayed": "is delayed",
    "returned": "was returned to the sender",
}
FRAGILE_PHRASES = {True: "is marked fragile", False: "is not fragile"}
TEMPLATES = (
    "Shipment {id} carries {quantity} {goods} ({weight_kg} kg) to {recipient} in {city}, {country}. It left on "
    "{date}, {fragile}, and {status}.",
    "On {date}, {quantity} {goods} weighing {weight_kg} kg were sent to {recipient} in {city}, {country} as shipment "
    "{id}; the package {fragile} and {status}.",
    "Shipment {id} ({quantity} {goods}, {weight_kg} kg in total) went out on {date} to {recipient} in {city}, "
    "{country}. It {status} and {fragile}.",
)
GOODS = (
    "ceramic vases", "desk lamps", "bicycle tires", "wool blankets", "espresso machines", "garden hoses",
    "office chairs", "printer cartridges", "yoga mats", "cast iron pans", "solar panels", "hiking boots",
    "glass bottles", "paint rollers", "laptop stands", "copper pipes", "tea kettles", "picture frames",
    "folding tables", "rain jackets", "water filters", "kitchen scales", "wall clocks", "ski helmets",
)  # fmt: skip
PLACES = (
    ("Lyon", "France"), ("Porto", "Portugal"), ("Graz", "Austria"), ("Utrecht", "Netherlands"),
    ("Bergen", "Norway"), ("Krakow", "Poland"), ("Valencia", "Spain"), ("Turin", "Italy"), ("Ghent", "Belgium"),
    ("Leipzig", "Germany"), ("Aarhus", "Denmark"), ("Tampere", "Finland"), ("Cork", "Ireland"),
    ("Brno", "Czechia"), ("Osaka", "Japan"), ("Busan", "South Korea"), ("Quebec City", "Canada"),
    ("Austin", "United States"), ("Curitiba", "Brazil"), ("Perth", "Australia"),
)  # fmt: skip
FIRST_NAMES = (
    "Maria", "Jonas", "Aiko", "Liam", "Sofia", "Mateo", "Ingrid", "Omar", "Chloe", "Pavel", "Nadia", "Tomas",
    "Elena", "Kenji", "Amara", "Lucas",
)  # fmt: skip
LAST_NAMES = (
    "Lopez", "Berg", "Tanaka", "Murphy", "Rossi", "Silva", "Novak", "Haddad", "Dubois", "Kowalski", "Jensen",
    "Moreau", "Fischer", "Costa", "Okafor", "Larsen",
)  # fmt: skip
COMPANIES = ("Northwind Freight", "Bluewater Logistics", "Harbor & Rail", "Meridian Cargo")
# Sentences that look like records but are none, and notes about the warehouse: not extracted.
DISTRACTORS = (
    "A request for 40 office chairs to Porto was cancelled before it shipped, so it has no shipment number.",
    "The night crew finished loading bay 3 before midnight.",
    "Customs paperwork for the week was filed on time.",
    "Forklift 2 was out of service for two days and has been repaired.",
    "A quote for 12 solar panels to Bergen is still being negotiated and has not been booked.",
    "The loading dock doors were repainted on the weekend.",
    "Storms on the coastal route slowed several trucks, but none of the shipments listed here were affected.",
    "Two new pallet jacks arrived for the east warehouse.",
    "An order of 250 glass bottles for Lyon was put on hold by the customer and never left the warehouse.",
    "The warehouse thermostat was set to 18 degrees for the winter.",
    "Staff training on the new scanners took place on Tuesday.",
    "A duplicate booking for 8 espresso machines was deleted from the system.",
)
MONTHS = (
    "January", "February", "March", "April", "May", "June", "July", "August", "September", "October", "November",
    "December",
)  # fmt: skip
RECORD_SCHEMA = {
    "type": "object",
    "properties": {
        "id": {"type": "string", "pattern": "SH-[0-9]{5}"},
        "goods": {"type": "string", "enum": list(GOODS)},  # a catalog: the goods named apart from their quantity
        "quantity": {"type": "integer"},
        "weight_kg": {"type": "number"},
        "status": {"type": "string", "enum": list(STATUS_PHRASES)},
        "fragile": {"type": "boolean"},
        "ship_date": {"type": "string", "format": "date"},
        "recipient": {"type": "string"},
        "destination": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "country": {"type": "string"}},
            "required": ["city", "country"],
            "additionalProperties": False,
        },
    },
    "required": ["id", "goods", "quantity", "weight_kg", "status", "fragile", "ship_date", "recipient", "destination"],
    "additionalProperties": False,
}
ANSWER_SCHEMA = {
    "type": "object",
    "properties": {"records": {"type": "array", "items": RECORD_SCHEMA}},
    "required": ["records"],
    "additionalProperties": False,
}
INSTRUCTION = (
    "Below is a shipping manifest. Extract every shipment it describes, in the order they appear, as one JSON object "
    'whose "records" array holds one object per shipment. Write the ship date as YYYY-MM-DD, the weight in '
    "kilograms, and the status as one of: " + ", ".join(STATUS_PHRASES) + ". Sentences that describe no shipment "
    "with a shipment number (cancelled or unbooked orders, notes about the warehouse) are not records. The answer "
    "follows this JSON schema:"
)


DEFAULT_METHODS = ("full", "snapkv", "h2o", "streamingllm", "kivi", "pask")
DEFAULT_BUDGETS = (0.1, 0.33)
# The longest gold answer is ~2,000 tokens written with spaces (as json.dumps writes it): room for it and some more.
DEFAULT_MAX_NEW_TOKENS = 2304
_VALIDATOR = jsonschema.Draft202012Validator(
    ANSWER_SCHEMA, format_checker=jsonschema.Draft202012Validator.FORMAT_CHECKER
)


class RecordsError(ValueError):
    """A records run that cannot be set up: the message names the setting and what to do."""


@dataclasses.dataclass(frozen=True)
class RecordsConfig:
    """What a run covers: items ``offset .. offset + items - 1`` of ``split``, through every (method, budget)."""

    methods: tuple[str, ...] = DEFAULT_METHODS
    budgets: tuple[float, ...] = DEFAULT_BUDGETS
    split: str = "dev"
    items: int = 20
    offset: int = 0
    batch_size: int = 4
    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS
    num_groups: int = 4

    def __post_init__(self) -> None:
        for name in ("methods", "budgets"):
            values = getattr(self, name)
            if not values:
                raise RecordsError(f"{name}: give at least one")
            if len(set(values)) != len(values):
                raise RecordsError(f"{name}: {list(values)} lists a value twice")
        for spec in self.methods:
            try:
                method_spec(spec)
            except argparse.ArgumentTypeError as exc:
                raise RecordsError(str(exc)) from None
        for budget in self.budgets:
            if not 0.0 < budget <= 1.0:
                raise RecordsError(f"budget {budget} must be in (0, 1]")
        if self.split not in SPLITS:
            raise RecordsError(f"unknown split {self.split!r}; choose from {', '.join(SPLITS)}")
        if self.items < 1 or self.offset < 0 or self.offset + self.items > SPLIT_SIZE:
            raise RecordsError(
                f"items={self.items} from offset={self.offset}: give at least one item, within the split's "
                f"items 0..{SPLIT_SIZE - 1}"
            )
        if self.batch_size < 1 or self.max_new_tokens < 1 or self.num_groups < 1:
            raise RecordsError(
                f"batch_size={self.batch_size}, max_new_tokens={self.max_new_tokens} and groups={self.num_groups} "
                "must each be >= 1"
            )

    @property
    def indices(self) -> range:
        return range(self.offset, self.offset + self.items)


def item_seed(split: str, index: int) -> int:
    """The seed item `index` of `split` is drawn from (the splits' seed ranges are disjoint)."""
    if split not in SPLITS:
        raise RecordsError(f"unknown split {split!r}; choose from {', '.join(SPLITS)}")
    if not 0 <= index < SPLIT_SIZE:
        raise RecordsError(f"item {index} is outside its split's items 0..{SPLIT_SIZE - 1}")
    return SPLIT_SEEDS[split] + index


@dataclasses.dataclass(frozen=True, eq=False)
class RecordsItem:
    """One manifest and the records it was written from."""

    split: str
    index: int
    company: str
    records: tuple[dict, ...]  # the gold records, in the order the manifest gives them
    sentences: tuple[str, ...]  # the manifest's sentences: one or two per record, and the distractors

    @property
    def seed(self) -> int:
        return item_seed(self.split, self.index)

    @property
    def gold(self) -> dict:
        """The gold answer (valid under ``ANSWER_SCHEMA``), a copy."""
        return {"records": copy.deepcopy(list(self.records))}

    @property
    def document(self) -> str:
        return f"Shipping manifest of {self.company}.\n" + "\n".join(self.sentences)

    @property
    def prompt(self) -> str:
        """The user message: instruction, answer schema, manifest."""
        return f"{INSTRUCTION}\n{json.dumps(ANSWER_SCHEMA)}\n\n{self.document}"


def _long_date(iso: str) -> str:
    date = datetime.date.fromisoformat(iso)
    return f"{MONTHS[date.month - 1]} {date.day}, {date.year}"


def record_sentence(record: Mapping, template: int) -> str:
    """How the manifest writes `record`: template `template` of ``TEMPLATES``, the date spelled out, the status and
    the fragile flag as phrases."""
    return TEMPLATES[template].format(
        id=record["id"],
        quantity=record["quantity"],
        goods=record["goods"],
        weight_kg=f"{record['weight_kg']:.1f}",
        recipient=record["recipient"],
        city=record["destination"]["city"],
        country=record["destination"]["country"],
        date=_long_date(record["ship_date"]),
        fragile=FRAGILE_PHRASES[record["fragile"]],
        status=STATUS_PHRASES[record["status"]],
    )


def make_item(split: str, index: int) -> RecordsItem:
    """Item `index` of `split`: a function of its seed alone."""
    rng = np.random.default_rng(item_seed(split, index))
    count = int(rng.integers(MIN_RECORDS, MAX_RECORDS + 1))
    ids = rng.choice(90_000, size=count, replace=False) + 10_000  # unique within the manifest
    dates = sorted(int(d) for d in rng.integers(0, 366, size=count))  # a manifest runs forward in time
    records = []
    for k in range(count):
        city, country = PLACES[rng.integers(len(PLACES))]
        goods = GOODS[rng.integers(len(GOODS))]
        quantity, weight_kg = int(rng.integers(2, 500)), round(float(rng.uniform(0.5, 900.0)), 1)
        status, fragile = list(STATUS_PHRASES)[rng.integers(len(STATUS_PHRASES))], bool(rng.integers(2))
        recipient = f"{FIRST_NAMES[rng.integers(len(FIRST_NAMES))]} {LAST_NAMES[rng.integers(len(LAST_NAMES))]}"
        records.append(
            {
                "id": f"SH-{ids[k]}",
                "goods": goods,
                "quantity": quantity,
                "weight_kg": weight_kg,
                "status": status,
                "fragile": fragile,
                "ship_date": (datetime.date(2024, 1, 1) + datetime.timedelta(days=dates[k])).isoformat(),
                "recipient": recipient,
                "destination": {"city": city, "country": country},
            }
        )
    sentences = [record_sentence(r, int(rng.integers(len(TEMPLATES)))) for r in records]
    distractors = rng.choice(len(DISTRACTORS), size=count // 3, replace=False)
    after = rng.choice(count, size=len(distractors), replace=False)  # each after a distinct record
    for at, which in sorted(zip(after, distractors, strict=True), reverse=True):  # from the back: positions hold
        sentences.insert(int(at) + 1, DISTRACTORS[which])
    company = COMPANIES[rng.integers(len(COMPANIES))]
    return RecordsItem(split, index, company, tuple(records), tuple(sentences))


def generator_hash() -> str:
    """sha256 (16 hex digits) of what items are drawn from: a changed pool or template makes other items."""
    pools = (MIN_RECORDS, MAX_RECORDS, STATUS_PHRASES, list(FRAGILE_PHRASES.values()), TEMPLATES, GOODS, PLACES)
    pools += (FIRST_NAMES, LAST_NAMES, COMPANIES, DISTRACTORS, SPLIT_SEEDS)
    return hashlib.sha256(json.dumps(pools).encode()).hexdigest()[:16]


def gold_text(item: RecordsItem) -> str:
    """The gold answer as ``json.dumps`` writes it (a space after every comma and colon, as the grammar allows)."""
    return json.dumps(item.gold)


@dataclasses.dataclass(frozen=True, eq=False)
class RecordsPrompt:
    """One item rendered, tokenized and with its answer grammar compiled."""

    item: RecordsItem
    prepared: PreparedRequest  # ids, prompt roles, the grammar of ANSWER_SCHEMA
    gold_tokens: int  # tokens of `gold_text` under the model's tokenizer


def build_prompt(builder: RequestBuilder, item: RecordsItem, max_new_tokens: int) -> RecordsPrompt:
    """The request of one item: its prompt as the user's message, the answer under ``ANSWER_SCHEMA``'s grammar."""
    if builder.template is None:
        raise RecordsError("the model ships no chat template: a records prompt is rendered with it")
    body = {
        "messages": [{"role": "user", "content": item.prompt}],
        "temperature": 0.0,
        "max_tokens": max_new_tokens,
        "response_format": {"type": "json_schema", "json_schema": {"name": "records", "schema": ANSWER_SCHEMA}},
    }
    prepared = builder.prepare(parse_request(body))  # the grammar is compiled once and cached: one schema for all
    return RecordsPrompt(item, prepared, len(builder.tokenizer.encode(gold_text(item))))


def build_prompts(builder: RequestBuilder, cfg: RecordsConfig) -> list[RecordsPrompt]:
    """Every item of a run, in index order (no model needed)."""
    return [build_prompt(builder, make_item(cfg.split, i), cfg.max_new_tokens) for i in cfg.indices]


def same_value(answer: object, gold: object) -> bool:
    """JSON equality: numbers by value (12 == 12.0), booleans only as booleans (true is not 1), objects key by key."""
    if isinstance(answer, dict) and isinstance(gold, dict):
        return answer.keys() == gold.keys() and all(same_value(answer[k], gold[k]) for k in gold)
    numbers = (int, float)
    if isinstance(answer, numbers) and isinstance(gold, numbers) and bool not in (type(answer), type(gold)):
        return answer == gold
    return type(answer) is type(gold) and answer == gold


def matched_in_order(answer: Sequence, gold: Sequence) -> int:
    """The most answer records that equal gold records in the same order (the longest common subsequence under
    `same_value`): a skipped or extra record costs itself alone."""
    row = [0] * (len(gold) + 1)  # row[j]: the longest common subsequence of the answer so far and gold[:j]
    for record in answer:
        previous = row.copy()
        for j, expected in enumerate(gold, start=1):
            row[j] = previous[j - 1] + 1 if same_value(record, expected) else max(previous[j], row[j - 1])
    return row[-1]


def answer_records(text: str) -> tuple[bool, object, list]:
    """An answer's text -> (whether it is one JSON value, that value, its "records"). An answer the token limit cut
    keeps the records it wrote whole: the grammar makes every prefix valid JSON up to the cut."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return False, None, _whole_records(text)
    records = value.get("records") if isinstance(value, dict) else None
    return True, value, records if isinstance(records, list) else []


def _whole_records(text: str) -> list:
    """The complete values of a cut answer's "records" array, in order."""
    decoder, records = json.JSONDecoder(), []
    start = text.find("[", text.find('"records"'))
    at = start + 1 if start >= 0 else len(text)
    while at < len(text):
        at += len(text[at:]) - len(text[at:].lstrip(" ,\n"))
        try:
            record, at = decoder.raw_decode(text, at)
        except json.JSONDecodeError:
            break
        records.append(record)
    return records


def leaf_fields(record: object, prefix: str = "") -> dict[str, object]:
    """A record's scalar fields by dotted path (the destination's city and country are two fields)."""
    if not isinstance(record, dict):
        return {prefix: record} if prefix else {}
    fields: dict[str, object] = {}
    for key, value in record.items():
        fields |= leaf_fields(value, f"{prefix}{key}.") if isinstance(value, dict) else {f"{prefix}{key}": value}
    return fields


def matched_fields(answer: Sequence, gold: Sequence[Mapping]) -> int:
    """Fields of gold records the answer reproduces: each gold record against the first answer record with its id,
    field by field (`same_value`). A record with one wrong field still counts its other fields."""
    by_id: dict[object, Mapping] = {}
    for record in answer:
        if isinstance(record, dict) and isinstance(record.get("id"), str):
            by_id.setdefault(record["id"], record)
    correct = 0
    for expected in gold:
        written = leaf_fields(by_id.get(expected["id"], {}))
        correct += sum(k in written and same_value(written[k], v) for k, v in leaf_fields(expected).items())
    return correct


@dataclasses.dataclass(frozen=True)
class Score:
    """One answer against its item's gold records."""

    valid_json: bool
    schema_valid: bool  # under ANSWER_SCHEMA, formats checked
    answer_records: int  # records the answer gives (its "records" array, schema-valid or not; a cut one's whole ones)
    correct_records: int  # matched in order (`matched_in_order`)
    gold_records: int
    answer_fields: int  # scalar fields of the answer's records (`leaf_fields`)
    correct_fields: int  # gold fields the answer reproduces (`matched_fields`)
    gold_fields: int

    @property
    def precision(self) -> float:
        return self.correct_records / self.answer_records if self.answer_records else 0.0

    @property
    def recall(self) -> float:
        return self.correct_records / self.gold_records

    @property
    def f1(self) -> float:
        return 2 * self.correct_records / (self.answer_records + self.gold_records)

    @property
    def field_f1(self) -> float:
        return 2 * self.correct_fields / (self.answer_fields + self.gold_fields)

    @property
    def exact(self) -> bool:
        return self.schema_valid and self.correct_records == self.answer_records == self.gold_records


def score_answer(text: str, gold: Sequence[Mapping]) -> Score:
    """Score an answer's text against the gold records."""
    valid, value, answer = answer_records(text)
    return Score(
        valid_json=valid,
        schema_valid=valid and _VALIDATOR.is_valid(value),
        answer_records=len(answer),
        correct_records=matched_in_order(answer, gold),
        gold_records=len(gold),
        answer_fields=sum(len(leaf_fields(r)) for r in answer),
        correct_fields=matched_fields(answer, gold),
        gold_fields=sum(len(leaf_fields(r)) for r in gold),
    )


def score_fields(text: str, gold: Sequence[Mapping]) -> dict:
    """A cell's score fields (what `score_answer` gives, as the results file records it)."""
    score = score_answer(text, gold)
    return {
        "valid_json": score.valid_json,
        "schema_valid": score.schema_valid,
        "gold_records": score.gold_records,
        "answer_records": score.answer_records,
        "correct_records": score.correct_records,
        "precision": round(score.precision, 5),
        "recall": round(score.recall, 5),
        "f1": round(score.f1, 5),
        "exact": score.exact,
        "gold_fields": score.gold_fields,
        "correct_fields": score.correct_fields,
        "field_f1": round(score.field_f1, 5),
    }


def run_config(
    cfg: RecordsConfig,
    model_name: str,
    template_name: str,
    method_config: Mapping[str, dict],
    policies: Mapping[str, PersistencePolicy],
) -> dict:
    """The `config` a results file records: `shared` (what every cell depends on) and `settings` per method spec."""
    shared = {
        "format": FORMAT,
        "model": model_name,
        "template": template_name,
        "split": cfg.split,
        "max_new_tokens": cfg.max_new_tokens,
        "num_groups": cfg.num_groups,
        "instruction": INSTRUCTION,
        "answer_schema": ANSWER_SCHEMA,
        "generator": generator_hash(),
    }
    return workload_config(shared, cfg, method_config, policies)


CellKey = tuple[str, float, int]  # method, budget, item index


def cell_key(cell: Mapping) -> CellKey:
    return (cell["method"], cell["budget"], cell["index"])


def _cell(prompt: RecordsPrompt, method: str, budget: float, gen: Generation, tokenizer: Tokenizer) -> dict:
    stop = set(tokenizer.eos_token_ids)
    text = tokenizer.decode([t for t in gen.tokens if t not in stop])
    return (
        {"method": method, "budget": budget, "index": prompt.item.index, "seed": prompt.item.seed, "answer": text}
        | score_fields(text, prompt.item.records)
        | {"gold_tokens": prompt.gold_tokens}
        | generation_fields(gen)
    )


def run_records(
    model: Decoder,
    tokenizer: Tokenizer,
    prompts: Sequence[RecordsPrompt],
    cfg: RecordsConfig,
    *,
    model_name: str,
    template_name: str,
    method_config: Mapping[str, dict] | None = None,
    policies: Mapping[str, PersistencePolicy] | None = None,
    out: Path | None = None,
) -> dict:
    """Every prompt through every (method spec, budget); `out` is resumed (its cells are kept, only missing ones
    run) and rewritten after every batch. Returns the whole result (old and new cells)."""
    method_config, policies = dict(method_config or {}), dict(policies or {})
    check_methods(cfg, method_config, policies, ModelFingerprint.of(model.config, tokenizer))
    config = run_config(cfg, model_name, template_name, method_config, policies)
    cells, config["settings"] = read_results(out, config, kind="records")  # the file's other specs stay recorded
    # scored again from their answers: a scoring rule added later applies to every cell without a rerun
    cells = [c | score_fields(c["answer"], make_item(cfg.split, c["index"]).records) for c in cells]
    done = {cell_key(c) for c in cells}
    engines = build_engines(
        model, tokenizer, EvalConfig(methods=cfg.methods, budgets=cfg.budgets, num_groups=cfg.num_groups),
        method_config, policies,
    )  # fmt: skip

    def missing(prompt: RecordsPrompt) -> list[tuple[str, float]]:
        return [key for key in engines if (*key, prompt.item.index) not in done]

    def result() -> dict:
        return {"model": model_name, "config": config, "cells": cells, "summary": summarize(cells)}

    # similar prompt lengths share a batch (less padding), and the batches of one length bucket run together
    pending = sorted((p for p in prompts if missing(p)), key=lambda p: len(p.prepared.ids))
    todo = sum(len(missing(p)) for p in pending)
    bucket = None
    with tqdm(total=todo, desc="records", unit="cell", disable=todo == 0) as progress:
        for start in range(0, len(pending), cfg.batch_size):
            batch = pending[start : start + cfg.batch_size]
            if bucket is not None and length_bucket(len(batch[-1].prepared.ids)) != bucket:
                jax.clear_caches()  # a new bucket brings new executables; repeated shapes: the compile cache
            bucket = length_bucket(len(batch[-1].prepared.ids))
            wanted = [key for key in engines if any(key in missing(p) for p in batch)]
            grammars = [p.prepared.grammar for p in batch]
            outputs = generate_shared(
                [engines[key] for key in wanted],
                [p.prepared.ids for p in batch],
                SamplingConfig(max_new_tokens=cfg.max_new_tokens),
                prompt_roles=[p.prepared.roles for p in batch],
                constraints=[grammar_constraint(grammars, model.config.vocab_size) for _ in wanted],
            )
            for (method, budget), gens in zip(wanted, outputs, strict=True):
                for prompt, gen in zip(batch, gens, strict=True):
                    if (method, budget) in missing(prompt):
                        cells.append(_cell(prompt, method, budget, gen, tokenizer))
                        done.add(cell_key(cells[-1]))
                        progress.update()
            if out is not None:
                write_json(out, result())
    if out is not None and not todo:  # nothing left to run: the file's cells as scored now
        write_json(out, result())
    return result()


def summarize(cells: Sequence[Mapping]) -> list[dict]:
    """Per (method, budget), over its items: mean record precision / recall / F1, the exact-item rate, the valid and
    schema-valid rates, TPOT (decode seconds over generated tokens, all items together) and the KV ratios as the BFCL
    harness reports them (bytes and entries: the mean of the items' means, the max of their maxima)."""
    groups: dict[tuple[str, float], list[Mapping]] = {}
    for c in cells:
        groups.setdefault((c["method"], c["budget"]), []).append(c)

    def order(key: tuple[str, float]) -> tuple:
        name = key[0].partition(":")[0].partition("@")[0]
        return (DEFAULT_METHODS.index(name) if name in DEFAULT_METHODS else len(DEFAULT_METHODS), *key)

    summary = []
    for method, budget in sorted(groups, key=order):
        group = groups[(method, budget)]
        tokens = sum(c["generated_tokens"] for c in group)
        summary.append(
            {
                "method": method,
                "budget": budget,
                "n": len(group),
                "record_f1": float(np.mean([c["f1"] for c in group])),
                "field_f1": float(np.mean([c["field_f1"] for c in group])),
                "record_precision": float(np.mean([c["precision"] for c in group])),
                "record_recall": float(np.mean([c["recall"] for c in group])),
                "exact_rate": float(np.mean([c["exact"] for c in group])),
                "valid_json_rate": float(np.mean([c["valid_json"] for c in group])),
                "schema_valid_rate": float(np.mean([c["schema_valid"] for c in group])),
                "correct_records": sum(c["correct_records"] for c in group),
                "gold_records": sum(c["gold_records"] for c in group),
                "correct_fields": sum(c["correct_fields"] for c in group),
                "gold_fields": sum(c["gold_fields"] for c in group),
                "generated_tokens": tokens,
                "tpot_ms": 1e3 * sum(c["decode_s"] for c in group) / max(tokens, 1),
                "kv_bytes_ratio_mean": float(np.mean([c["kv_bytes_ratio_mean"] for c in group])),
                "kv_bytes_ratio_max": float(np.max([c["kv_bytes_ratio_max"] for c in group])),
                "kept_ratio_mean": float(np.mean([c["kept_ratio_mean"] for c in group])),
                "kept_ratio_max": float(np.max([c["kept_ratio_max"] for c in group])),
            }
        )
    return summary


def format_table(result: Mapping) -> str:
    """One Markdown row per (method, budget): records right, record F1, fields right, field F1 and exact items (%),
    valid / schema-valid answers (%), TPOT and the KV bytes ratio."""
    head = ["method", "budget", "items", "records right", "record F1", "fields right", "field F1", "exact"]
    head += ["valid JSON", "schema-valid"]
    head += ["TPOT ms", "KV bytes mean / max"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for s in result["summary"]:
        row = [s["method"], f"{s['budget']:g}", str(s["n"]), f"{s['correct_records']} / {s['gold_records']}"]
        row += [f"{100 * s['record_f1']:.1f}", f"{s['correct_fields']} / {s['gold_fields']}"]
        row += [f"{100 * s[k]:.1f}" for k in ("field_f1", "exact_rate", "valid_json_rate", "schema_valid_rate")]
        row += [f"{s['tpot_ms']:.1f}", f"{s['kv_bytes_ratio_mean']:.3f} / {s['kv_bytes_ratio_max']:.3f}"]
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)
