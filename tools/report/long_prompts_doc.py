"""The tables of docs/results/long_prompts.md (named ``long_prompts_doc``: ``tools.report.long_prompts`` is the table
function of ``frozen``, which the package exports): one question among distractor tools under section 1's frozen
methods and under methods tuned on long dev prompts, PASK v2 on long prompts (both models), the dev grids of its
policies and orders, and held-out dev prompts."""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from pathlib import Path

from pask_jax.experiments import bfcl
from pask_jax.experiments.bfcl.long_context import LAYOUTS
from tools.report.common import ReportError, _block, _table, load_json, outcomes
from tools.report.frozen import LONG_V2, TUNING_BUDGET, V2_TUNING, Tuning, dev_tuning, long_prompts
from tools.report.stats import PAIRED_HEAD, _paired_row

LONG_TUNING = Tuning(  # long prompts: every method's variant chosen on long dev prompts, both layouts
    ("results/dev_long/bfcl_dev_long2k_question_last.json", "results/dev_long/bfcl_dev_long2k_question_first.json"),
    0.2,
)
REGIMES_LONG = Tuning(  # the policies calibrated in several regimes (21 and 45 prompts) against the shipped one
    tuple(
        f"results/dev_v3/bfcl_dev_long2k_{policies}_{layout}.json"
        for policies in ("regimes", "regimes48")
        for layout in LAYOUTS
    ),
    0.2,
)
REGIMES_SHORT = tuple(  # the same policies on BFCL's own dev prompts
    f"results/dev_v3/bfcl_dev_short_{policies}.json" for policies in ("regimes", "regimes48")
)
QUERIES_LONG = Tuning(  # PASK's query-aware order reading the pseudo queries, the observation window or both
    tuple(f"results/dev_v4/bfcl_dev_long2k_queries_{layout}.json" for layout in LAYOUTS),
    0.2,
)
WINDOW_TUNING = Tuning(V2_TUNING.files, 0.2, pask_from=QUERIES_LONG)  # the baselines of PASK v2's long sample
LONG_V3 = {  # the fresh sample of pask:window (items 110-119): layout -> results file
    layout: f"results/long_v3/bfcl_long2k_v3_{layout}.json" for layout in LAYOUTS
}
QUERIES_SHORT = ("results/dev_v4/bfcl_dev_short_queries.json",)  # the same variants on BFCL's own dev prompts
WHOLE_TOOLS_LONG = Tuning(  # PASK's default against its whole-tool order on the long dev prompts
    tuple(f"results/dev_v5/bfcl_dev_long2k_whole_tools_{layout}.json" for layout in LAYOUTS),
    0.2,
)
WHOLE_TOOLS_SHORT = ("results/dev_v5/bfcl_dev_short_whole_tools.json",)  # and on BFCL's own dev prompts
HELD_OUT_DEV = {  # dev items 8-19 of each category, read by no choice: layout -> results file (b = 0.2)
    layout: f"results/dev_v6/bfcl_dev2_long2k_{layout}.json" for layout in LAYOUTS
}
FIRST_DEV = {  # where the same methods ran on dev items 0-7 (the items the long-prompt choices read)
    "full": V2_TUNING,
    "snapkv": V2_TUNING,
    "dapq": V2_TUNING,
    "pask": WHOLE_TOOLS_LONG,  # the default order, beside the whole-tool order, from main's code
    "pask:window": QUERIES_LONG,
}


def dev_held_out(
    root: Path, held_out_files: Sequence[str] = tuple(HELD_OUT_DEV.values()), first_dev: dict[str, Tuning] = FIRST_DEV
) -> str:
    """The long-prompt methods on held-out dev items (8-19 of each category, read by no choice) beside dev items 0-7
    (what the choices read, `first_dev`: method -> its dev files), per layout; then PASK paired against each other
    row on the held-out items and on all."""
    budget = 0.2
    held_out = [load_json(root, file) for file in held_out_files]
    first = {tuning: tuning.dev_parts(root) for tuning in dict.fromkeys(first_dev.values())}  # a file per layout

    def scored(results: list[dict], spec: str) -> dict[tuple[str, str], bool]:  # (item id, layout) -> correct
        b = 1.0 if spec == "full" else budget
        return {(i, r["config"]["layout"]): ok for r in results for i, ok in outcomes(r, spec, b).items()}

    by_spec = {spec: (scored(first[tuning], spec), scored(held_out, spec)) for spec, tuning in first_dev.items()}
    for spec, (seen, new) in by_spec.items():
        if any(bfcl.part_of(item) != "dev" for item, _ in new) or set(seen) & set(new):
            raise ReportError(f"{spec}: the held-out items must be dev items the first dev files did not score")
    rows = []
    for spec, (seen, new) in by_spec.items():
        cells = [
            f"{sum(ok for (_, of), ok in part.items() if of == layout)}/{sum(of == layout for _, of in part)}"
            for layout in LAYOUTS
            for part in (seen, new)
        ]
        every = sum(seen.values()) + sum(new.values())
        rows.append([spec, *cells, f"{sum(new.values())}/{len(new)}", f"{every}/{len(seen) + len(new)}"])
    pask_seen, pask_new = by_spec["pask"]
    comparisons = []
    for other, (seen, new) in by_spec.items():
        if other != "pask":
            comparisons.append(_paired_row(f"PASK vs {other}, items 8-19", pask_new, new))
            comparisons.append(_paired_row(f"PASK vs {other}, items 0-19", pask_seen | pask_new, seen | new))
    claim = (
        f"On {len(pask_new)} held-out long dev prompts (dev items 8-19 of each category, both layouts, b = {budget:g}, "
        "full KV unbudgeted): " + ", ".join(f"{spec} {sum(new.values())}" for spec, (_, new) in by_spec.items()) + "."
    )
    columns = [f"{layout.replace('_', ' ')}, items {items}" for layout in LAYOUTS for items in ("0-7", "8-19")]
    head = ["method", *columns, "items 8-19", "items 0-19"]
    return _block(claim, _table(head, rows), _table(["A vs B", *PAIRED_HEAD], comparisons))


def short_dev_tables(name: str, files: tuple[str, ...]) -> dict[str, Callable[[Path], str]]:
    """`NAME_short_b02` and `NAME_short_b033`: the dev variants of `files` (BFCL's own dev prompts) at each budget."""
    return {
        f"{name}_short_b{b:g}".replace(".", ""): functools.partial(dev_tuning, tuning=Tuning(files, b))
        for b in (0.2, 0.33)
    }


TABLES: dict[str, Callable[[Path], str]] = {
    "dev_tuning_long2k": functools.partial(dev_tuning, tuning=LONG_TUNING),
    "dev_b033_long_variant": functools.partial(
        dev_tuning, tuning=Tuning(("results/dev_tuning/dev_b033_long_variant.json",), TUNING_BUDGET)
    ),
    "long_prompts_2k_question_last": functools.partial(long_prompts, file="results/bfcl_long2k_question_last.json"),
    "long_prompts_2k_question_first": functools.partial(long_prompts, file="results/bfcl_long2k_question_first.json"),
    **{
        f"long_prompts_2k_fresh_{layout}": functools.partial(
            long_prompts, file=f"results/bfcl_long2k_fresh_{layout}.json", tuning=LONG_TUNING
        )
        for layout in LAYOUTS
    },
    "dev_tuning_v2_long2k": functools.partial(dev_tuning, tuning=V2_TUNING),
    "dev_policy_regimes_long2k": functools.partial(dev_tuning, tuning=REGIMES_LONG),
    **short_dev_tables("dev_policy_regimes", REGIMES_SHORT),
    "dev_pask_queries_long2k": functools.partial(dev_tuning, tuning=QUERIES_LONG),
    **{
        f"long_prompts_2k_window_{layout}": functools.partial(long_prompts, file=file, tuning=WINDOW_TUNING)
        for layout, file in LONG_V3.items()
    },
    **short_dev_tables("dev_pask_queries", QUERIES_SHORT),
    "dev_pask_whole_tools_long2k": functools.partial(dev_tuning, tuning=WHOLE_TOOLS_LONG),
    **short_dev_tables("dev_pask_whole_tools", WHOLE_TOOLS_SHORT),
    "dev_held_out_long2k": dev_held_out,
    **{
        f"long_prompts_{name}": functools.partial(long_prompts, file=file, tuning=V2_TUNING)
        for name, file in LONG_V2.items()
    },
}
