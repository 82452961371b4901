"""Needle in a haystack: RULER-style single-needle retrieval through every KV-compression method at the same budgets.

    pask-jax niah --model qwen2.5-coder-0.5b --budgets 0.03,0.1,0.2 --lengths 2k,4k,8k --out results/niah.json

It tests DapQ's claim (near-lossless retrieval at a 3% KV budget, because pseudo queries at the positions the answer
will occupy find the needle) against the other methods. One prompt per (length, depth, haystack):

- The needle ``NEEDLE`` ("The special magic number for <key> is <7 digits>.", RULER's niah_single; the key an
  adjective-noun pair, both drawn from ``seed``, the length, the depth and the haystack) goes into a haystack of
  sentences at the sentence boundary nearest ``depth`` percent of the haystack's tokens (0: before its first sentence,
  100: after its last). Depth counts tokens of the haystack without the needle.
- One user message: RULER's ``INSTRUCTION``, the haystack, the ``QUESTION``; rendered with the checkpoint's chat
  template. The whole prompt has at most ``length`` tokens, and fewer by less than one haystack sentence (plus a
  token where the needle's boundary tokenizes differently).
- Haystacks: "noise", passkey retrieval's repeated ``NOISE_SENTENCES`` ("The grass is green. The sky is blue. ...",
  Mohtashami & Jaggi 2023); "prose", sentences of the Python Language Reference topics that CPython ships as
  ``pydoc_data/topics.py`` (the text ``help()`` shows; PSF License Version 2), read from the running interpreter's
  standard library, never downloaded: the sentences of its plain paragraphs, in order (code, lists, headings, and
  sentences with digits or over ``PROSE_MAX_CHARS`` characters left out), cycled when a haystack needs more.

Answer modes, both from the same prompt (one prefill serves both): "free", plain text, read as its first 7-digit
number; "json", decoded under the grammar of ``ANSWER_SCHEMA`` (``{"number": "<7 digits>"}``), whose parser states
also give PASK the roles of the generated tokens. Correct means the number read equals the needle's. The prompt's
tokens carry their prompt roles in both modes, so PASK runs in both.

Methods are specs as in the BFCL sweep (``evaluate.build_engines``): a method name, or ``pask:LABEL`` for PASK under
the policy labelled LABEL (plain ``pask`` without a policy labelled "pask" runs uncalibrated: recency with sinks).
Each runs at every budget (full KV once, at 1). Prompts of one length and haystack are batched; one shared prefill
per batch serves every (method, budget, mode) (``generate_shared``).

Results: one JSON document, rewritten after every batch: ``config``; ``cells``, one per (method, budget, length,
depth, haystack, mode) with the answer, the number read, correct, the kept/full KV ratios and the needle's actual
depth; ``summary``, accuracy per (method, budget, haystack, mode, length). A run given an existing file computes only
the cells it lacks, and refuses a file made under other shared settings (model, seed, prompt texts, template, ...) or
other settings of one of its method specs (hyper-parameters, policy).
"""

from __future__ import annotations

import bisect
import dataclasses
import functools
import hashlib
import json
import re
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Protocol

import jax
import numpy as np
from tqdm.auto import tqdm

from pask_jax.experiments.bench.machine import write_json
from pask_jax.experiments.bfcl.evaluate import EvalConfig, build_engines
from pask_jax.experiments.sweep import generate_shared
from pask_jax.factory import resolve_spec
from pask_jax.methods import METHODS
from pask_jax.models.decoder import Decoder
from pask_jax.models.tokenizer import Tokenizer
from pask_jax.policy import ModelFingerprint, PersistencePolicy
from pask_jax.requests import PreparedRequest, RequestBuilder, parse_request
from pask_jax.runtime.sampling import SamplingConfig
from pask_jax.runtime.shapes import DEFAULT_LENGTH_BUCKETS
from pask_jax.structure import FreeTextConstraint
from pask_jax.structure.backend import grammar_constraint

FORMAT = "pask-niah-v1"
NEEDLE = "The special magic number for {key} is {number}."
INSTRUCTION = (
    "Some special magic numbers are hidden within the following text. Make sure to memorize it. "
    "I will quiz you about the numbers afterwards."
)
QUESTION = "What is the special magic number for {key} mentioned in the provided text?"
NOISE_SENTENCES = (
    "The grass is green.",
    "The sky is blue.",
    "The sun is yellow.",
    "Here we go.",
    "There and back again.",
)
HAYSTACKS = ("noise", "prose")
MODES = ("free", "json")
ANSWER_SCHEMA = {
    "type": "object",
    "properties": {"number": {"type": "string", "pattern": "[0-9]{7}"}},
    "required": ["number"],
}
# The longest answer the JSON grammar allows (one space wherever JSON allows whitespace), one byte per token, plus
# the end of turn: a json-mode row always finishes within this many new tokens.
JSON_ANSWER_TOKENS = len('{ "number" : "0000000" }') + 1
DEFAULT_METHODS = ("full", "dapq", "snapkv", "pyramidkv", "h2o", "streamingllm", "pask")
DEFAULT_BUDGETS = (0.03, 0.1, 0.2)
DEFAULT_LENGTHS = (2048, 4096, 8192)
DEFAULT_DEPTHS = tuple(float(d) for d in range(0, 101, 10))  # percent of the haystack's tokens
# Qwen's tokenizer writes one token per digit: a sentence-form free answer ("The special magic number for ... is
# 1234567.") takes ~20 tokens; rows stop at their end of turn, so the cap costs nothing when it is not reached.
DEFAULT_MAX_NEW_TOKENS = 32
MAX_LENGTH = DEFAULT_LENGTH_BUCKETS[-1]
PROSE_MAX_CHARS = 300  # longer sentences would make depth steps coarse
ADJECTIVES = (
    "amber", "brave", "calm", "dusty", "eager", "faint", "gentle", "hollow", "icy", "jolly", "keen", "lively",
    "mellow", "noble", "olive", "proud", "quiet", "rapid", "silent", "tidy", "upper", "vivid", "wary", "young",
    "zesty", "bright", "crisp", "distant", "early", "frosty", "golden", "hidden",
)  # fmt: skip
NOUNS = (
    "anchor", "badger", "canyon", "dolphin", "ember", "falcon", "glacier", "harbor", "island", "jungle", "kettle",
    "lantern", "meadow", "nebula", "orchard", "pebble", "quartz", "river", "saddle", "tunnel", "umbrella", "valley",
    "walnut", "yacht", "zephyr", "beacon", "compass", "desert", "forest", "garden", "horizon", "lagoon",
)  # fmt: skip
_SEVEN_DIGITS = re.compile(r"(?<!\d)\d{7}(?!\d)")
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+(?=[A-Z\"])")
_HEADING_RULE = frozenset("=*-^~")


class MethodGrid(Protocol):
    """What `check_methods` reads of a run's config (a `NiahConfig`, or another workload's)."""

    methods: tuple[str, ...]
    budgets: tuple[float, ...]


class NiahError(ValueError):
    """A needle-in-a-haystack run that cannot be set up: the message names the setting and what to do."""


@dataclasses.dataclass(frozen=True)
class NiahConfig:
    """What a run covers. Depths are percent of the haystack's tokens; lengths are prompt tokens."""

    methods: tuple[str, ...] = DEFAULT_METHODS
    budgets: tuple[float, ...] = DEFAULT_BUDGETS
    lengths: tuple[int, ...] = DEFAULT_LENGTHS
    depths: tuple[float, ...] = DEFAULT_DEPTHS
    haystacks: tuple[str, ...] = HAYSTACKS
    modes: tuple[str, ...] = MODES
    seed: int = 0
    batch_size: int = 4
    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS
    num_groups: int = 4

    def __post_init__(self) -> None:
        for name in ("methods", "budgets", "lengths", "depths", "haystacks", "modes"):
            values = getattr(self, name)
            if not values:
                raise NiahError(f"{name}: give at least one")
            if len(set(values)) != len(values):
                raise NiahError(f"{name}: {list(values)} lists a value twice")
        for spec in self.methods:
            if spec.partition("@")[0].partition(":")[0] not in METHODS:
                raise NiahError(f"unknown method {spec!r}; known: {', '.join(METHODS)} (or pask:LABEL)")
        for budget in self.budgets:
            if not 0.0 < budget <= 1.0:
                raise NiahError(f"budget {budget} must be in (0, 1]")
        for length in self.lengths:
            if not 0 < length <= MAX_LENGTH:
                raise NiahError(f"length {length} must be in 1..{MAX_LENGTH} tokens (the largest prompt bucket)")
        for depth in self.depths:
            if not 0.0 <= depth <= 100.0:
                raise NiahError(f"depth {depth} must be a percent of the haystack, in [0, 100]")
        for haystack in self.haystacks:
            if haystack not in HAYSTACKS:
                raise NiahError(f"unknown haystack {haystack!r}; choose from {', '.join(HAYSTACKS)}")
        for mode in self.modes:
            if mode not in MODES:
                raise NiahError(f"unknown answer mode {mode!r}; choose from {', '.join(MODES)}")
        if self.seed < 0 or self.batch_size < 1 or self.num_groups < 1:
            raise NiahError(f"seed={self.seed} must be >= 0, batch_size={self.batch_size} and groups >= 1")
        if self.max_new_tokens < 1 or ("json" in self.modes and self.max_new_tokens < JSON_ANSWER_TOKENS):
            raise NiahError(
                f"max_new_tokens={self.max_new_tokens} is too few: a json answer may need {JSON_ANSWER_TOKENS} tokens"
            )


def _split(text: str, what: str) -> list[str]:
    items = [item.strip() for item in text.split(",")]
    if not all(items):
        raise NiahError(f"{what} {text!r}: an empty entry in the comma-separated list")
    return items


def _number(item: str, what: str, kind: Callable[[str], float]) -> float:
    try:
        return kind(item)
    except ValueError:
        raise NiahError(f"{what} {item!r} is not a number") from None


def parse_lengths(text: str) -> tuple[int, ...]:
    """ "2k,4k,8k" or "2048,3000" -> prompt lengths in tokens (k = 1024)."""
    out = []
    for item in _split(text, "lengths"):
        scale = 1024 if item.lower().endswith("k") else 1
        out.append(int(_number(item[:-1] if scale > 1 else item, "length", int)) * scale)
    return tuple(out)


def parse_floats(text: str, what: str) -> tuple[float, ...]:
    """ "0,10,50" -> floats (depths in percent, budgets), naming `what` in the error."""
    return tuple(float(_number(item, what, float)) for item in _split(text, what))


def parse_names(text: str, what: str) -> tuple[str, ...]:
    return tuple(_split(text, what))


@dataclasses.dataclass(frozen=True)
class Needle:
    key: str
    number: str  # 7 digits, no leading zero

    @property
    def sentence(self) -> str:
        return NEEDLE.format(key=self.key, number=self.number)

    @property
    def question(self) -> str:
        return QUESTION.format(key=self.key)


def make_needle(seed: int, length: int, depth: float, haystack: str) -> Needle:
    """The needle of one prompt: a function of the seed and the prompt's length, depth and haystack alone."""
    rng = np.random.default_rng([seed, length, round(depth * 1000), HAYSTACKS.index(haystack)])
    key = f"{ADJECTIVES[rng.integers(len(ADJECTIVES))]}-{NOUNS[rng.integers(len(NOUNS))]}"
    return Needle(key, str(rng.integers(1_000_000, 10_000_000)))


def _prose_paragraphs(text: str) -> list[str]:
    """The plain paragraphs of one pydoc topic text: no code (indented), headings, list items or lead-ins."""
    paragraphs = []
    for block in re.split(r"\n\s*\n", text):
        lines = [line for line in block.split("\n") if line.strip()]
        if not lines or any(line[0] in " \t" for line in lines) or lines[0].startswith(("* ", "- ", ">>>")):
            continue
        if any(set(line.strip()) <= _HEADING_RULE for line in lines):
            continue
        paragraph = " ".join(line.strip() for line in lines)
        if paragraph.endswith("."):
            paragraphs.append(paragraph)
    return paragraphs


@functools.cache
def prose_sentences() -> tuple[str, ...]:
    """The "prose" haystack's sentences, in order (see the module docstring)."""
    from pydoc_data.topics import topics

    sentences = []
    for topic in sorted(topics):
        for paragraph in _prose_paragraphs(topics[topic]):
            for sentence in _SENTENCE_END.split(paragraph):
                sentence = " ".join(sentence.split())
                if (
                    20 <= len(sentence) <= PROSE_MAX_CHARS
                    and sentence.endswith((".", "!", "?"))
                    and (sentence[0].isupper() or sentence[0] == '"')
                    and not re.search(r"\d", sentence)  # the needle's number stays the only number in the text
                ):
                    sentences.append(sentence)
    return tuple(sentences)


def haystack_sentence(haystack: str, index: int) -> str:
    """Sentence `index` of a haystack (its pool cycled)."""
    pool = NOISE_SENTENCES if haystack == "noise" else prose_sentences()
    return pool[index % len(pool)]


def haystack_hash() -> str:
    """sha256 (16 hex digits) of both haystacks' sentence pools: prose comes from the local CPython, and may differ."""
    return hashlib.sha256("\n".join((*NOISE_SENTENCES, *prose_sentences())).encode()).hexdigest()[:16]


@dataclasses.dataclass(frozen=True, eq=False)
class NiahPrompt:
    """One rendered, tokenized prompt with where its needle went."""

    length: int  # the target: prompt tokens <= length
    depth: float  # the target, percent of the haystack's tokens
    haystack: str
    needle: Needle
    prepared: PreparedRequest  # ids, prompt roles, the json answer's grammar (None without json mode)
    haystack_tokens: int  # tokens of the haystack, without the needle
    needle_token: int  # haystack tokens before the needle
    # tokens of the longest sentence among the haystack's and the next one of its pool (which did not fit): the
    # needle is this close to its depth, and the prompt this close to its length (plus a token)
    sentence_tokens: int

    @property
    def depth_actual(self) -> float:
        return 100.0 * self.needle_token / self.haystack_tokens

    @property
    def messages(self) -> list[dict]:
        return list(self.prepared.request.messages)


def _content(sentences: Sequence[str], needle: Needle, at: int | None) -> str:
    """The user message: instruction, haystack (the needle before sentence `at`; None: no needle), question."""
    parts = list(sentences) if at is None else [*sentences[:at], needle.sentence, *sentences[at:]]
    return f"{INSTRUCTION}\n{' '.join(parts)}\n{needle.question}"


def build_prompt(
    builder: RequestBuilder,
    length: int,
    depth: float,
    haystack: str,
    *,
    seed: int = 0,
    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS,
    json_answer: bool = True,
) -> NiahPrompt:
    """The prompt of one (length, depth, haystack): haystack sentences while the prompt fits `length` tokens, the
    needle at the sentence boundary nearest `depth` percent of the haystack's tokens. `json_answer`: compile the
    json mode's grammar into `prepared`."""
    if builder.template is None:
        raise NiahError("the model ships no chat template: a needle-in-a-haystack prompt is rendered with it")
    tokenizer = builder.tokenizer
    needle = make_needle(seed, length, depth, haystack)

    def render(sentences: Sequence[str], at: int | None) -> tuple[list[int], int]:
        """-> start offsets (characters) of the prompt's tokens, where the haystack starts in the text."""
        content = _content(sentences, needle, at)
        text = builder.template.render([{"role": "user", "content": content}])
        if (where := text.find(content)) < 0:
            raise NiahError(f"chat template {builder.template.name} rewrites the user message; cannot place a needle")
        offsets = tokenizer.backend.encode(text, add_special_tokens=False).offsets
        return [start for start, _ in offsets], where + len(INSTRUCTION) + 1

    around = len(render([], 0)[0])  # the prompt with the needle alone as its haystack
    sentences, counts = [], []
    while True:  # sentences while their tokens (each after a space, as joined) fit
        sentence = haystack_sentence(haystack, len(sentences))
        n = len(tokenizer.encode(" " + sentence))
        if around + sum(counts) + n > length:
            break
        sentences.append(sentence)
        counts.append(n)
    while sentences:
        starts, begin = render(sentences, None)
        first = bisect.bisect_left(starts, begin)
        # sentence k begins at the space before it (Qwen-style pre-tokenizers keep the space with the word)
        chars = np.cumsum([0, *(len(s) + 1 for s in sentences)])
        boundaries = [bisect.bisect_left(starts, begin + c - (k > 0)) - first for k, c in enumerate(chars[:-1])]
        total = bisect.bisect_left(starts, begin + int(chars[-1]) - 1) - first  # haystack tokens
        boundaries.append(total)
        at = int(np.argmin([abs(b - depth / 100 * total) for b in boundaries]))
        starts, begin = render(sentences, at)
        if len(starts) <= length:
            break
        sentences.pop()  # a boundary tokenized differently with the needle beside it: one sentence fewer
    if not sentences:
        raise NiahError(
            f"length {length} leaves no room for a haystack: the prompt around it already takes {around} tokens"
        )
    needle_char = begin + int(chars[at]) - (at > 0)
    content = _content(sentences, needle, at)
    body = {"messages": [{"role": "user", "content": content}], "temperature": 0.0, "max_tokens": max_new_tokens}
    if json_answer:
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": "niah", "schema": ANSWER_SCHEMA}}
    prepared = builder.prepare(parse_request(body))
    return NiahPrompt(
        length=length,
        depth=depth,
        haystack=haystack,
        needle=needle,
        prepared=prepared,
        haystack_tokens=total,
        needle_token=bisect.bisect_left(starts, needle_char) - bisect.bisect_left(starts, begin),
        sentence_tokens=int(max(*np.diff(boundaries), *counts, n)),
    )


def build_prompts(builder: RequestBuilder, cfg: NiahConfig) -> list[NiahPrompt]:
    """Every (length, haystack, depth) prompt of a run, in that order (no model needed)."""
    return [
        build_prompt(
            builder,
            length,
            depth,
            haystack,
            seed=cfg.seed,
            max_new_tokens=cfg.max_new_tokens,
            json_answer="json" in cfg.modes,
        )
        for length in cfg.lengths
        for haystack in cfg.haystacks
        for depth in cfg.depths
    ]


def read_number(text: str, mode: str) -> str | None:
    """The 7-digit number an answer gives: free text's first one; json's "number" if the text is a schema-valid answer.
    None when there is none."""
    if mode == "free":
        found = _SEVEN_DIGITS.search(text)
        return found.group() if found else None
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return None
    if not isinstance(value, dict) or set(value) != {"number"}:
        return None
    number = value["number"]
    return number if isinstance(number, str) and re.fullmatch(r"[0-9]{7}", number) else None


def score_answer(text: str, number: str, mode: str) -> tuple[str | None, bool]:
    """-> (the number read from `text`, whether it is exactly `number`)."""
    read = read_number(text, mode)
    return read, read == number


def spec_settings(spec: str, method_config: Mapping[str, dict], policies: Mapping[str, PersistencePolicy]) -> dict:
    """What a method spec runs with, as `evaluate.build_engines` resolves it: its hyper-parameter overrides and its
    policy's content hash (recorded, and compared when a run resumes a results file)."""
    method = resolve_spec(spec, method_config, policies)
    return {
        "overrides": method.overrides,
        "policy": method.policy.content_hash() if method.policy is not None else None,
    }


def check_methods(
    cfg: MethodGrid,
    method_config: Mapping[str, dict],
    policies: Mapping[str, PersistencePolicy],
    fingerprint: ModelFingerprint | None = None,
) -> None:
    """Refuse, before any model work, a spec label with neither a policy nor a config section, a policy that does not
    answer one of the budgets, and (given the model's `fingerprint`) a policy calibrated for another model."""
    for spec in cfg.methods:
        try:
            policy = resolve_spec(spec, method_config, policies).policy
        except ValueError as exc:
            raise NiahError(str(exc)) from None
        if policy is None:
            continue
        if fingerprint is not None:
            policy.check_fits(fingerprint)
        for budget in cfg.budgets:
            try:
                policy.table(budget)  # PolicyError naming the budgets it answers and how to compile more
            except ValueError as exc:
                raise NiahError(f"{spec!r}: {exc}") from None


def run_config(
    cfg: NiahConfig,
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
        "seed": cfg.seed,
        "max_new_tokens": cfg.max_new_tokens,
        "num_groups": cfg.num_groups,
        "texts": {"needle": NEEDLE, "instruction": INSTRUCTION, "question": QUESTION},
        "answer_schema": ANSWER_SCHEMA,
        "haystacks": haystack_hash(),
    }
    prose = f"pydoc_data/topics.py of CPython {sys.version.split()[0]} (PSF License Version 2)"
    return workload_config(shared, cfg, method_config, policies) | {"prose_source": prose}


def workload_config(
    shared: dict, cfg, method_config: Mapping[str, dict], policies: Mapping[str, PersistencePolicy]
) -> dict:
    """A synthetic workload's results-file `config`: its `shared` settings, the `settings` of each method spec of
    `cfg` (a dataclass with `methods`), the run's own settings and the labelled policies."""
    return {
        "shared": shared,
        "settings": {spec: spec_settings(spec, method_config, policies) for spec in cfg.methods},
        "run": {k: list(v) if isinstance(v, tuple) else v for k, v in dataclasses.asdict(cfg).items()},
        "policies": {
            label: {"model": p.model, "hash": p.content_hash(), "notes": p.notes} for label, p in policies.items()
        },
    }


CellKey = tuple[str, float, int, float, str, str]  # method, budget, length, depth, haystack, mode


def cell_key(cell: Mapping) -> CellKey:
    return (cell["method"], cell["budget"], cell["length"], cell["depth"], cell["haystack"], cell["mode"])


def read_results(
    path: Path | None, config: dict, kind: str = "needle-in-a-haystack"
) -> tuple[list[dict], dict[str, dict]]:
    """The cells already in `path` (none if it does not exist) and the settings of every method spec there or in
    `config` (a run's `run_config`: ``shared`` and ``settings``, as the records workload writes them too). NiahError
    if `path` is not a `kind` results file, its cells were made under other shared settings, or a method spec of this
    run ran with other settings there."""
    if path is None or not path.exists():
        return [], dict(config["settings"])
    try:
        previous = json.loads(path.read_text())
        old_shared, old_settings, cells = (
            previous["config"]["shared"],
            previous["config"]["settings"],
            previous["cells"],
        )
    except (json.JSONDecodeError, KeyError, TypeError) as exc:
        raise NiahError(f"{path} is not a {kind} results file ({exc}); choose another --out") from None
    differ = sorted(k for k in set(old_shared) | set(config["shared"]) if old_shared.get(k) != config["shared"].get(k))
    if differ:
        raise NiahError(f"{path} was made with other settings ({', '.join(differ)} differ): choose another --out")
    for spec, settings in config["settings"].items():
        if spec in old_settings and old_settings[spec] != settings:
            raise NiahError(
                f"{path}: method {spec!r} ran there with {old_settings[spec]}, here with {settings}: choose another "
                '--out, or label this variant (a method-config section ["NAME:LABEL"])'
            )
    return cells, old_settings | config["settings"]


def _cell(prompt: NiahPrompt, method: str, budget: float, mode: str, gen, tokenizer: Tokenizer) -> dict:
    stop = set(tokenizer.eos_token_ids)
    text = tokenizer.decode([t for t in gen.tokens if t not in stop])
    read, correct = score_answer(text, prompt.needle.number, mode)
    return {
        "method": method,
        "budget": budget,
        "length": prompt.length,
        "depth": prompt.depth,
        "haystack": prompt.haystack,
        "mode": mode,
        "key": prompt.needle.key,
        "number": prompt.needle.number,
        "answer": text,
        "read": read,
        "correct": correct,
        "haystack_tokens": prompt.haystack_tokens,
        "depth_actual": round(prompt.depth_actual, 2),
    } | generation_fields(gen)


def generation_fields(gen) -> dict:
    """What a synthetic workload's cell records of a generation: kept entries and bytes, lengths, timings."""
    return {
        "kept_ratio_mean": round(gen.stats.kept_ratio_mean, 5),
        "kept_ratio_max": round(gen.stats.kept_ratio_max, 5),
        "kv_bytes_ratio_mean": round(gen.stats.kv_bytes_ratio_mean, 5),
        "kv_bytes_ratio_max": round(gen.stats.kv_bytes_ratio_max, 5),
        "prompt_tokens": gen.stats.prompt_tokens,
        "generated_tokens": gen.stats.generated_tokens,
        "finish_reason": gen.finish_reason,  # "length": cut off at max_new_tokens
        "ttft_s": round(gen.stats.ttft_s, 3),  # the batch's shared prefill (with its compile on a new shape)
        "decode_s": round(sum(gen.stats.token_times_s), 3),
    }


def run_niah(
    model: Decoder,
    tokenizer: Tokenizer,
    prompts: Sequence[NiahPrompt],
    cfg: NiahConfig,
    *,
    model_name: str,
    template_name: str,
    method_config: Mapping[str, dict] | None = None,
    policies: Mapping[str, PersistencePolicy] | None = None,
    out: Path | None = None,
) -> dict:
    """Every prompt through every (method spec, budget, mode); `out` is resumed (its cells are kept, only missing
    ones run) and rewritten after every batch. Returns the whole result (old and new cells)."""
    method_config, policies = dict(method_config or {}), dict(policies or {})
    check_methods(cfg, method_config, policies, ModelFingerprint.of(model.config, tokenizer))
    config = run_config(cfg, model_name, template_name, method_config, policies)
    cells, config["settings"] = read_results(out, config)  # the file's other specs stay recorded
    done = {cell_key(c) for c in cells}
    engines = build_engines(
        model, tokenizer, EvalConfig(methods=cfg.methods, budgets=cfg.budgets, num_groups=cfg.num_groups),
        method_config, policies,
    )  # fmt: skip
    runs = [(key, mode) for key in engines for mode in cfg.modes]

    def missing(prompt: NiahPrompt) -> list[tuple[tuple[str, float], str]]:
        place = (prompt.length, prompt.depth, prompt.haystack)
        return [(key, mode) for key, mode in runs if (*key, place[0], place[1], place[2], mode) not in done]

    def result() -> dict:
        return {"model": model_name, "config": config, "cells": cells, "summary": summarize(cells)}

    todo = sum(len(missing(p)) for p in prompts)
    vocab = model.config.vocab_size
    with tqdm(total=todo, desc="niah", unit="cell", disable=todo == 0) as progress:
        lengths = list(dict.fromkeys(p.length for p in prompts))
        for length in lengths:
            for haystack in dict.fromkeys(p.haystack for p in prompts):
                pending = [p for p in prompts if (p.length, p.haystack) == (length, haystack) and missing(p)]
                for start in range(0, len(pending), cfg.batch_size):
                    batch = pending[start : start + cfg.batch_size]
                    wanted = [r for r in runs if any(r in missing(p) for p in batch)]
                    constraints = [
                        grammar_constraint([p.prepared.grammar for p in batch], vocab)
                        if mode == "json"
                        else FreeTextConstraint(len(batch), vocab, tokenizer.vocab_size, tokenizer.eos_token_ids)
                        for _, mode in wanted
                    ]
                    outputs = generate_shared(
                        [engines[key] for key, _ in wanted],
                        [p.prepared.ids for p in batch],
                        SamplingConfig(max_new_tokens=cfg.max_new_tokens),
                        prompt_roles=[p.prepared.roles for p in batch],
                        constraints=constraints,
                    )
                    for ((method, budget), mode), gens in zip(wanted, outputs, strict=True):
                        for prompt, gen in zip(batch, gens, strict=True):
                            if ((method, budget), mode) in missing(prompt):
                                cells.append(_cell(prompt, method, budget, mode, gen, tokenizer))
                                done.add(cell_key(cells[-1]))
                                progress.update()
                    if out is not None:
                        write_json(out, result())
            if length != lengths[-1]:  # the next length brings new executables (repeated shapes: the compile cache)
                jax.clear_caches()
    return result()


def summarize(cells: Sequence[Mapping]) -> list[dict]:
    """Accuracy and mean kept/full KV per (method, budget, haystack, mode, length), over the depths."""
    groups: dict[tuple, list[Mapping]] = {}
    for c in cells:
        groups.setdefault((c["method"], c["budget"], c["haystack"], c["mode"], c["length"]), []).append(c)
    return [
        {
            "method": method,
            "budget": budget,
            "haystack": haystack,
            "mode": mode,
            "length": length,
            "n": len(group),
            "correct": sum(c["correct"] for c in group),
            "accuracy": sum(c["correct"] for c in group) / len(group),
            "kept_ratio_mean": float(np.mean([c["kept_ratio_mean"] for c in group])),
        }
        for (method, budget, haystack, mode, length), group in sorted(groups.items(), key=_summary_order)
    ]


def _summary_order(item: tuple) -> tuple:
    (method, budget, haystack, mode, length), _ = item
    name = method.partition(":")[0]
    rank = DEFAULT_METHODS.index(name) if name in DEFAULT_METHODS else len(DEFAULT_METHODS)
    return (haystack, mode, rank, method, budget, length)


def format_table(result: Mapping) -> str:
    """Accuracy (%) per (method, budget) x length, with the mean over lengths and the mean kept/full KV: one Markdown
    table per (haystack, mode)."""
    summary = result["summary"]
    blocks = []
    for haystack, mode in dict.fromkeys((s["haystack"], s["mode"]) for s in summary):
        rows = [s for s in summary if (s["haystack"], s["mode"]) == (haystack, mode)]
        lengths = sorted({s["length"] for s in rows})
        head = ["method", "budget", *(str(n) for n in lengths), "mean", "kept/full"]
        lines = [f"{haystack} haystack, {mode} answers:", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        for method, budget in dict.fromkeys((s["method"], s["budget"]) for s in rows):
            mine = {s["length"]: s for s in rows if (s["method"], s["budget"]) == (method, budget)}
            cells = [f"{100 * mine[n]['accuracy']:.0f}" if n in mine else "-" for n in lengths]
            mean = 100 * np.mean([s["accuracy"] for s in mine.values()])
            kept = np.mean([s["kept_ratio_mean"] for s in mine.values()])
            lines.append("| " + " | ".join([method, f"{budget:g}", *cells, f"{mean:.1f}", f"{kept:.3f}"]) + " |")
        blocks.append("\n".join(lines))
    return "\n\n".join(blocks)
