"""`LLM`: OpenAI chat-completions requests in, `chat.completion` objects out, through a budget-sized KV cache.

    llm = pask_jax.LLM("qwen2.5-coder-0.5b", method="pask", budget=0.33, policy="auto")
    [answer] = llm.chat({"messages": [...], "tools": [...], "temperature": 0})
    answer["choices"][0]["message"]["tool_calls"]    # OpenAI shape; answer["pask"]: kept/full KV, TTFT, ...

Requests are rendered with the checkpoint's own chat template and their tool calls (or JSON content) decoded under
the grammar; under tool_choice "auto", a call the model wrote in its text answer (a ```json fence, bare JSON) that
names a tool and validates against its schema is returned as a tool call too (`pask_jax.structure.call_parser`).
Scheduling is `pask_jax.runtime.scheduler.Scheduler`'s; `LLM` prepares requests, builds their constraints and
turns generations into completions. `scheduler="continuous"` (the default): requests that share sampling settings run
through one cache of up to `max_batch` rows, in order; a row whose answer ends takes the next request at once, and
`kv_memory_bytes` (if given) sets the row count (a method that keeps less gets more rows in the same memory).
`scheduler="static"`: requests that share sampling settings and constrained-ness are length-sorted into micro-batches
of up to `max_batch` rows whose KV cache fits `kv_memory_bytes`; a batch decodes until its longest answer ends.
The model's weights load on first use, so bad requests are refused before that.
`dtype`: the weights', activations' and cache's dtype ("float32", "bfloat16"; None: bfloat16 on TPU / GPU, float32 on
CPU; a given model instance keeps its own unless one is named). `mesh`: a (`data`, `model`) device mesh
(`pask_jax.models.sharding.make_mesh`); the weights load straight onto it.
`policy`: "auto" (PASK only) finds the shipped policy that fits the model by fingerprint; a directory loads that
policy (refused if it fits another model); None runs PASK uncalibrated (recency with sinks).
`grammar_backend`: "llguidance" (the default: `pask_jax.structure.guidance`, llguidance's JSON Schema compiler, a
new tool list in milliseconds), "outlines" (ours: the schema translation of `pask_jax.structure.schema` and
outlines-core, about a second per new tool list; a schema with a constraint it does not enforce, such as
`multipleOf`, is refused, naming the keyword), "outlines-loose" (the same, with such constraints dropped: the grammar
then allows values the schema refuses) or "auto" (outlines where it enforces every keyword of a request's schemas,
llguidance where it does not), chosen by name in `pask_jax.structure.backend.backend_for`; the outputs they allow,
PASK's roles and its release of unchosen tools are the same under each where both compile a schema.
`prep_workers`: host threads that compile request grammars (nearly all of a new tool list's preparation) while the
device runs, under continuous batching: a request is admitted to a row once its grammar is compiled, so the device
waits on the host only when no row has work (0: each request is compiled when it is prepared, before anything runs;
static batches always are).
`grammar_cache_dir`: where compiled grammars persist, so a new process (or another host) loads a tool list's grammar
instead of compiling it again (`pask_jax.structure.grammar_cache`; process-wide): "auto" (the default:
`$PASK_JAX_GRAMMAR_CACHE`, else `~/.cache/pask-jax/grammars`), a directory, or None / "none" (in memory only).
Sampling: `seed` applies per batch (requests with different seeds never share one); `stop` strings cut the
returned text (the row still decodes to its end or its token limit).
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import numpy as np
from jax.sharding import Mesh

from pask_jax.arguments import DEFAULT_GRAMMAR_BACKEND, DEFAULT_PREP_WORKERS
from pask_jax.checkpoint import Checkpoint
from pask_jax.factory import make_engine
from pask_jax.methods import METHODS
from pask_jax.models.chat_template import ChatTemplate
from pask_jax.models.decoder import Decoder
from pask_jax.models.loading import cast_model, resolve_dtype
from pask_jax.models.sharding import check_mesh
from pask_jax.models.tokenizer import Tokenizer
from pask_jax.policy import ModelFingerprint, PersistencePolicy, resolve_policy
from pask_jax.requests import PreparedRequest, RequestBuilder, RequestError, StageClock
from pask_jax.runtime.batching import Job, MemoryLimitError
from pask_jax.runtime.engine import Engine
from pask_jax.runtime.rows import Generation
from pask_jax.runtime.sampling import SamplingConfig
from pask_jax.runtime.scheduler import Scheduler
from pask_jax.runtime.shapes import PREFILL_CHUNK
from pask_jax.structure import FreeTextConstraint, TokenConstraint, grammar_cache
from pask_jax.structure.call_parser import parse_text_calls, split_grammar_calls

DEFAULT_MODEL = "qwen2.5-coder-0.5b"
DEFAULT_MAX_CONTEXT = 32768
SCHEDULERS = Scheduler.MODES


class LLM:
    """A model, its tokenizer and chat template, and one engine (method, budget, policy) behind `chat()`."""

    def __init__(
        self,
        model: str | Path | Decoder = DEFAULT_MODEL,
        *,
        method: str = "pask",
        budget: float = 0.33,
        policy: str | Path | PersistencePolicy | None = "auto",
        tokenizer: Tokenizer | None = None,
        chat_template: ChatTemplate | None = None,
        max_batch: int = 8,
        kv_memory_bytes: int | None = None,
        max_context: int = DEFAULT_MAX_CONTEXT,
        num_groups: int | None = None,
        use_kernel: bool = False,
        method_overrides: dict | None = None,
        dtype: str | None = None,
        mesh: Mesh | None = None,
        scheduler: str = "continuous",
        overlap_grammar: bool | None = None,
        max_prefill_rows: int | None = None,
        grammar_backend: str = DEFAULT_GRAMMAR_BACKEND,
        prefill_chunk: int = PREFILL_CHUNK,
        grammar_cache_dir: str | Path | None = grammar_cache.AUTO,
        prep_workers: int = DEFAULT_PREP_WORKERS,
    ):
        if max_batch < 1:
            raise ValueError(f"max_batch={max_batch} must be >= 1")
        if max_prefill_rows is not None and max_prefill_rows < 1:
            raise ValueError(f"max_prefill_rows={max_prefill_rows} must be >= 1")
        if prefill_chunk < 1:
            raise ValueError(f"prefill_chunk={prefill_chunk} must be >= 1")
        if prep_workers < 0:
            raise ValueError(f"prep_workers={prep_workers} must be >= 0")
        if scheduler not in SCHEDULERS:
            raise ValueError(f"unknown scheduler {scheduler!r}; choose from {', '.join(SCHEDULERS)}")
        if method.partition("@")[0] not in METHODS:
            raise ValueError(f"unknown method {method!r}; known: {', '.join(METHODS)} (or NAME@STORAGE)")
        if not 0.0 < budget <= 1.0:
            raise ValueError(f"budget={budget} must be in (0, 1]")
        self.mesh = None if mesh is None else check_mesh(mesh)
        if isinstance(model, Decoder):
            if tokenizer is None:
                raise ValueError("LLM(model=<a Qwen3 instance>) needs tokenizer=")
            model = model if dtype is None else cast_model(model, dtype)
            self.dtype = model.embed.embedding.dtype
            self._model, config, self.model_name = model, model.config, model.config.name
        else:
            self.dtype = resolve_dtype(dtype)
            self.checkpoint = Checkpoint.open(model)
            self._model, config, self.model_name = None, self.checkpoint.config, self.checkpoint.name
            tokenizer = tokenizer or self.checkpoint.tokenizer
            chat_template = chat_template or self.checkpoint.chat_template
        self.config, self.tokenizer = config, tokenizer
        self.method, self.budget = method, (1.0 if method == "full" else budget)
        self.fingerprint = ModelFingerprint.of(config, tokenizer)
        self.policy = resolve_policy(policy, self.fingerprint) if method == "pask" else None
        if self.policy is not None:
            self.policy.table(self.budget)  # refuse a budget the policy does not answer before loading weights
        if grammar_cache_dir != grammar_cache.AUTO:
            grammar_cache.set_grammar_cache(grammar_cache_dir)
        self.builder = RequestBuilder(
            tokenizer, chat_template, max_context=max_context, grammar_backend=grammar_backend
        )
        self.max_batch, self.kv_memory_bytes = max_batch, kv_memory_bytes
        self.scheduler, self.overlap_grammar, self.max_prefill_rows = scheduler, overlap_grammar, max_prefill_rows
        self._engine_options = dict(
            num_groups=num_groups, use_kernel=use_kernel, overrides=method_overrides, prefill_chunk=prefill_chunk
        )
        self._engine: Engine | None = None
        self.prep_workers = prep_workers
        self._workers: ThreadPoolExecutor | None = None

    @property
    def model(self) -> Decoder:
        """The model, its weights loaded on first use."""
        if self._model is None:
            self._model = self.checkpoint.weights(self.dtype, mesh=self.mesh)
        return self._model

    @property
    def engine(self) -> Engine:
        """The engine, built on first use."""
        if self._engine is None:
            self._engine = make_engine(
                self.model,
                self.method,
                self.budget,
                policy=self.policy,
                stop_token_ids=self.tokenizer.eos_token_ids,
                max_context=self.builder.max_context,
                mesh=self.mesh,
                **self._engine_options,
            )
        return self._engine

    def describe(self) -> dict:
        """The method as it runs: what a results file records to say which configuration produced it."""
        return {
            "model": self.model_name,
            "method": self.method,
            "budget": self.budget,
            "policy": self.policy.content_hash() if self.policy is not None else None,
        }

    def prepare(self, body: dict, timings: dict[str, float] | None = None, *, ahead: bool = False) -> PreparedRequest:
        """Validate, render, tokenize and compile one request body (RequestError / GrammarError if it cannot run);
        each stage's seconds into `timings` when given (parse_s, then `RequestBuilder.prepare`'s). `ahead`: under
        continuous batching with `prep_workers`, the grammar compiles on a host worker (the request returns at once;
        a compile error comes back from `generate` in place of its completion)."""
        request = StageClock(timings)("parse_s", self.builder.parse, body)
        return self.builder.prepare(request, timings, workers=self.workers if ahead else None)

    @property
    def workers(self) -> ThreadPoolExecutor | None:
        """The host threads that compile grammars ahead (None: without `prep_workers`, or under static batching)."""
        if self.prep_workers == 0 or self.scheduler != "continuous":
            return None
        if self._workers is None:
            self._workers = ThreadPoolExecutor(self.prep_workers, thread_name_prefix="pask-jax-prep")
        return self._workers

    def chat(self, requests: dict | Sequence[dict]) -> list[dict]:
        """Chat-completions bodies -> `chat.completion` objects, in order. A bad request raises, naming its index."""
        bodies = [requests] if isinstance(requests, dict) else list(requests)
        prepared = []
        for i, body in enumerate(bodies):
            try:
                prepared.append(self.prepare(body, ahead=True))
            except ValueError as e:
                raise type(e)(f"request {i}: {e}") from None
        answers: list[dict | None] = [None] * len(prepared)
        for indices, completions in self.generate(prepared):
            for i, completion in zip(indices, completions, strict=True):
                if isinstance(completion, Exception):
                    raise type(completion)(f"request {i}: {completion}")
                answers[i] = completion
        return answers

    def jobs(self, prepared: Sequence[PreparedRequest]) -> list[Job]:
        """Prepared requests as the scheduler sees them (prompt, token limit, sampling settings, constrained-ness)."""
        return [
            Job(
                p.ids,
                p.request.max_tokens,
                SamplingConfig(temperature=p.request.temperature, top_p=p.request.top_p, seed=p.request.seed),
                p.compiled is not None,
                p.roles,
                p.tools,
            )
            for p in prepared
        ]

    def make_scheduler(self) -> Scheduler:
        """The scheduler of this LLM's engine (built on first need) under its settings as they are now."""
        return Scheduler(
            lambda: self.engine,
            self.scheduler,
            max_batch=self.max_batch,
            kv_memory_bytes=self.kv_memory_bytes,
            overlap_grammar=self.overlap_grammar,
            max_prefill_rows=self.max_prefill_rows,
        )

    def micro_batches(self, prepared: Sequence[PreparedRequest]) -> list[list[int]]:
        """Static batches (indices): grouped by sampling settings and constrained-ness, length-sorted, at most
        `max_batch` each, each within `kv_memory_bytes` (`pask_jax.runtime.batching.micro_batches`)."""
        return self.make_scheduler().micro_batches(self.jobs(prepared))

    def generate(
        self, prepared: Sequence[PreparedRequest], scheduler: Scheduler | None = None
    ) -> Iterator[tuple[list[int], list[dict | Exception]]]:
        """Run prepared requests through `scheduler` (default: `make_scheduler()`): yields (indices,
        their completions) as they finish (continuous: one at a time; static: a micro-batch at a time). A request
        whose cache alone exceeds `kv_memory_bytes` gets a RequestError in place of its completion, one whose grammar
        failed to compile on a worker its GrammarError."""

        def constraint(indices: list[int]) -> TokenConstraint | Future[TokenConstraint]:
            if len(indices) == 1:  # continuous batching: admitted when its grammar is compiled
                return prepared[indices[0]].when_ready(lambda p: self.batch_constraint([p]))
            return self.batch_constraint([prepared[i] for i in indices])

        scheduler = scheduler or self.make_scheduler()
        for indices, results, created in scheduler.run(self.jobs(prepared), constraint):
            yield indices, [self._answer(prepared[i], r, created) for i, r in zip(indices, results, strict=True)]

    def _answer(self, prepared: PreparedRequest, result: Generation | Exception, created: int) -> dict | Exception:
        """A generation's completion, or the request's error (over the memory limit: a RequestError)."""
        if isinstance(result, MemoryLimitError):
            return RequestError(str(result))
        if isinstance(result, Exception):
            return result
        return self.completion(prepared, result, created)

    def batch_constraint(self, batch: Sequence[PreparedRequest]) -> TokenConstraint:
        """The constraint of requests that are all grammar-constrained (by the builder's backend) or all free."""
        vocab = self.config.vocab_size  # not the engine's: a host worker may build a constraint before it exists
        if batch[0].grammar is not None:
            return self.builder.backend.constraint([p.grammar for p in batch], vocab)
        return FreeTextConstraint(len(batch), vocab, self.tokenizer.vocab_size, self.tokenizer.eos_token_ids)

    def _answers_with_calls(self, prepared: PreparedRequest, tokens: list[int]) -> bool:
        """Whether the grammar's call branch was taken: by the first token (an "auto" text answer may spell the
        text "<tool_call>" with ordinary tokens, which the grammar's text branch allows; ``{`` or a backtick first
        opens a call there, `regex.py`)."""
        grammar = prepared.grammar
        if grammar is None or grammar.kind == "json" or not tokens:
            return False
        if grammar.kind == "tool_calls" or tokens[0] == grammar.vocab.call_open_id:
            return True
        first = grammar.vocab.token_bytes[tokens[0]] if tokens[0] < grammar.vocab.size else b""
        return first[:1] in (b"{", b"`")

    def completion(self, prepared: PreparedRequest, gen: Generation, created: int) -> dict:
        """One generation as an OpenAI `chat.completion` object, plus the `pask` field."""
        request = prepared.request
        tokens = gen.tokens[: request.max_tokens]
        finish = "length" if len(gen.tokens) > request.max_tokens else gen.finish_reason
        stop_ids = set(self.tokenizer.eos_token_ids)
        text = self.tokenizer.decode([t for t in tokens if t not in stop_ids])
        with_calls = self._answers_with_calls(prepared, tokens)
        content, tool_calls = split_grammar_calls(text) if with_calls else (text, [])
        if content is not None and request.stop and not tool_calls:
            cut = min((content.find(s) for s in request.stop if s in content), default=-1)
            if cut >= 0:
                content, finish = content[:cut], "stop"
        if not with_calls and prepared.grammar is not None and prepared.grammar.kind == "auto":
            # an "auto" text answer may still write its call (a fence, bare JSON): read it from the text as cut by
            # the stop strings, as a server that stopped there would see it
            content, tool_calls = parse_text_calls(content, request.tools, parallel=request.parallel_tool_calls)
        if tool_calls and finish == "stop":
            finish = "tool_calls"
        message = {"role": "assistant", "content": content}
        if tool_calls:
            message["tool_calls"] = tool_calls
        stats = gen.stats
        return {
            "id": f"chatcmpl-{uuid.uuid4().hex[:24]}",
            "object": "chat.completion",
            "created": created,
            "model": self.model_name,
            "choices": [{"index": 0, "message": message, "finish_reason": finish, "logprobs": None}],
            "usage": {
                "prompt_tokens": stats.prompt_tokens,
                "completion_tokens": len(tokens),
                "total_tokens": stats.prompt_tokens + len(tokens),
            },
            "pask": self.describe()
            | {
                "kept_ratio_mean": round(stats.kept_ratio_mean, 4),
                "kept_ratio_max": round(stats.kept_ratio_max, 4),
                "kv_bytes_ratio_mean": round(stats.kv_bytes_ratio_mean, 4),
                "kv_bytes_ratio_max": round(stats.kv_bytes_ratio_max, 4),
                "ttft_s": round(stats.ttft_s, 3),
                "decode_s": round(float(np.sum(stats.token_times_s)), 3),
            },
        }
