"""KV-compression methods: each decides which prompt entries a cache keeps and what leaves during decode."""

from pask_jax.methods.base import KVMethod
from pask_jax.methods.full import FullKV
from pask_jax.methods.random_kv import RandomKV
from pask_jax.methods.streamingllm import StreamingLLM

METHODS: dict[str, type[KVMethod]] = {m.name: m for m in (FullKV, RandomKV, StreamingLLM)}

__all__ = ["METHODS", "FullKV", "KVMethod", "RandomKV", "StreamingLLM"]
