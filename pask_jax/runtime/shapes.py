"""The static shapes of a generate call: prompt length buckets, padded batches, new-token buckets, prefill chunks.

Shapes never depend on data: prompts are right-padded to a length bucket, the batch to a power of two (and a multiple
of the mesh's `data` size), the decode capacity to a new-token bucket, so prefill and decode compile once per
(batch, bucket). `BatchShape` is one call's shapes; equal shapes mean the same compiled steps and cache bytes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from pask_jax.structure.roles import NO_TOOL

# A layer group's pool sizes: slots per (layer, sequence, KV head), or (slots, blocks of each block pool) with block
# pools: (slots, blocks) with one, (slots, blocks, second pool's blocks) with two.
Capacity = int | tuple[int, ...]


def pool_sizes(capacity: Capacity) -> tuple[int, tuple[int, ...]]:
    """(slots, the blocks of each block pool) of a layer group's `Capacity`."""
    return (capacity, ()) if isinstance(capacity, int) else (capacity[0], tuple(capacity[1:]))


# Prompt length buckets: steps of 1.5x keep padding under a third while bounding the number of compiles.
DEFAULT_LENGTH_BUCKETS = (
    64,
    128,
    192,
    256,
    384,
    512,
    768,
    1024,
    1536,
    2048,
    3072,
    4096,
    6144,
    8192,
    12288,
    16384,
    24576,
    32768,
)
# Prompt positions per prefill chunk: longer prompts run in chunks, so prefill holds one chunk's activations at a time.
PREFILL_CHUNK = 2048
NEW_TOKEN_BUCKET = 64  # decode capacity grows in steps of this, so nearby max_new_tokens share a compile


def length_bucket(n: int, buckets: Sequence[int] = DEFAULT_LENGTH_BUCKETS) -> int:
    """The smallest of the sorted `buckets` that holds a prompt of `n` tokens (what prefill pads to)."""
    for b in buckets:
        if n <= b:
            return b
    raise ValueError(f"a prompt of {n} tokens exceeds the largest length bucket {buckets[-1]}")


def padded_batch(rows: int, multiple: int = 1) -> int:
    """The batch the arrays of `rows` sequences have: padded to a power of two, so few batch sizes compile, and then
    to a multiple of `multiple` (a mesh's `data` size, so that every device holds whole rows)."""
    return -(-(1 << (rows - 1).bit_length()) // multiple) * multiple


def new_token_bucket(max_new_tokens: int) -> int:
    """Decode capacity sized for `max_new_tokens`: rounded up to NEW_TOKEN_BUCKET, so nearby values share a compile."""
    return -(-max_new_tokens // NEW_TOKEN_BUCKET) * NEW_TOKEN_BUCKET


@dataclasses.dataclass(frozen=True)
class BatchShape:
    """The static shapes of one generate call: what its prefill and decode steps are compiled for.

    From `Engine.batch_shape`; equal shapes mean the same compiled steps (and the same cache bytes).
    """

    rows: int  # real sequences
    padded_rows: int  # rows of every array: `padded_batch(rows, data size)`
    prompt_bucket: int  # prompt positions: the longest prompt's `length_bucket`
    new_token_bucket: int  # new tokens the caches are sized for: `new_token_bucket(max_new_tokens)`
    capacities: tuple[Capacity, ...]  # per layer group: slots per (layer, sequence, KV head), or (slots, blocks...)

    def pad(
        self, prompts: Sequence[Sequence[int]], prompt_roles: Sequence[Sequence[int]] | None = None
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Right-pad prompts (and their roles) to this shape -> tokens i32[B, T], lengths i32[B], roles i32[B, T].

        Padding rows get length 1 (a valid position, so their attention is defined); their output is dropped.
        """
        if len(prompts) != self.rows or (prompt_roles is not None and len(prompt_roles) != self.rows):
            raise ValueError(f"this shape holds {self.rows} prompts (and as many role lists), not {len(prompts)}")
        tokens = np.zeros((self.padded_rows, self.prompt_bucket), np.int32)
        roles = np.zeros((self.padded_rows, self.prompt_bucket), np.int32)
        lengths = np.ones(self.padded_rows, np.int32)
        for i, p in enumerate(prompts):
            if not 0 < len(p) <= self.prompt_bucket:
                raise ValueError(f"prompt {i} has {len(p)} tokens; this shape holds 1..{self.prompt_bucket}")
            tokens[i, : len(p)] = p
            lengths[i] = len(p)
            if prompt_roles is not None:
                roles[i, : len(p)] = prompt_roles[i]
        return tokens, lengths, roles

    def pad_tools(self, prompt_tools: Sequence[Sequence[int] | None] | None) -> np.ndarray:
        """The tool each prompt token describes, right-padded with NO_TOOL to this shape -> i32[B, T] (a None row:
        describes no tool)."""
        tools = np.full((self.padded_rows, self.prompt_bucket), NO_TOOL, np.int32)
        if prompt_tools is None:
            return tools
        if len(prompt_tools) != self.rows:
            raise ValueError(f"this shape holds {self.rows} prompts and as many tool lists, not {len(prompt_tools)}")
        for i, row in enumerate(prompt_tools):
            if row is not None:
                tools[i, : len(row)] = row
        return tools


def prefill_chunks(positions: int, chunk: int) -> int:
    """How many equal chunks a prefill over `positions` runs in: the fewest of at most `chunk` positions each that
    split it evenly (every default length bucket above 2048 splits into chunks of 1536 or 2048)."""
    n = -(-positions // chunk)
    while positions % n:
        n += 1
    return n
