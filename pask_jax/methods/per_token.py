"""int8 and fp8 KV caches, per token and KV head, as serving stacks ship them (vLLM `--kv-cache-dtype int8 / fp8`,
MaxText `quantize_kvcache`, jax-llm-examples' int8 cache): every entry stored as 8-bit codes with one f16 scale.

An 8-bit entry costs about half a bf16 one, so at budgets from about 0.55 up nothing leaves; below that the cap
lets the oldest entries go, the first `sinks` positions last -- StreamingLLM on an 8-bit cache.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

from pask_jax.kernels.quantize import FP8, INT8
from pask_jax.methods.streamingllm import StreamingLLM
from pask_jax.storage import Storage


@dataclasses.dataclass(frozen=True)
class Int8KV(StreamingLLM):
    name: ClassVar[str] = "int8"

    def storage(self, budget: float, head_dim: int) -> Storage:
        return Storage(slots=INT8)


@dataclasses.dataclass(frozen=True)
class FP8KV(StreamingLLM):
    name: ClassVar[str] = "fp8"

    def storage(self, budget: float, head_dim: int) -> Storage:
        return Storage(slots=FP8)
