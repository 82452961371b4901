"""KV-compression methods: each decides which prompt entries a cache keeps and what leaves during decode."""

from pask_jax.methods.base import KVMethod
from pask_jax.methods.full import FullKV

METHODS: dict[str, type[KVMethod]] = {"full": FullKV}

__all__ = ["METHODS", "FullKV", "KVMethod"]
