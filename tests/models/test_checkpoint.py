"""The one loader every command goes through: a name or path -> config, tokenizer, template, fingerprint, weights."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from tiny_checkpoint import write_model_dir

from pask_jax.checkpoint import Checkpoint
from pask_jax.llm import LLM
from pask_jax.models.fetch import FetchError
from pask_jax.policy import ModelFingerprint


def test_a_checkpoint_directory_gives_everything_without_the_weights_until_asked(tmp_path: Path):
    directory = write_model_dir(tmp_path / "tiny")
    checkpoint = Checkpoint.open(directory)
    assert checkpoint.path == directory and checkpoint.name == str(directory)
    assert (checkpoint.config.num_layers, checkpoint.config.hidden_size) == (4, 32)
    assert checkpoint.config is checkpoint.config  # read once
    assert checkpoint.chat_template is not None and "<|im_start|>" in checkpoint.chat_template.render(
        [{"role": "user", "content": "hi"}]
    )
    assert checkpoint.fingerprint == ModelFingerprint.of(checkpoint.config, checkpoint.tokenizer)
    model = checkpoint.weights("float32")
    assert model.config == checkpoint.config and model.embed.embedding.dtype == np.float32
    llm = LLM(directory, method="full")  # the user's path loads through the same checkpoint
    assert llm.checkpoint.path == directory and llm.fingerprint == checkpoint.fingerprint


def test_a_missing_checkpoint_is_named(tmp_path: Path):
    with pytest.raises(FetchError, match="nowhere' is not an existing path, a registered model"):
        Checkpoint.open(tmp_path / "nowhere")
