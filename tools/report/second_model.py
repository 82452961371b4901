"""The tables of docs/results/second_model.md: Qwen2.5-Coder-1.5B under section 1's frozen methods, its own dev grid,
and its frozen sample with every baseline at its dev choice."""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path

from tools.report.frozen import (
    DEV_1_5B,
    SCHEMA_EVAL_1_5B,
    SHORT_1_5B,
    dev_tuning,
    long_prompts,
    schema_eval,
    schema_paired,
)

TABLES: dict[str, Callable[[Path], str]] = {
    "schema_eval_1_5b": functools.partial(schema_eval, file=SCHEMA_EVAL_1_5B),
    "schema_paired_1_5b": functools.partial(schema_paired, file=SCHEMA_EVAL_1_5B),
    "dev_tuning_1_5b": functools.partial(dev_tuning, tuning=DEV_1_5B),
    "short_prompts_1_5b_every_baseline": functools.partial(long_prompts, file=SHORT_1_5B, tuning=DEV_1_5B),
}
