"""The compiled persistence policy: a small table over (role, layer group) buckets, one per target budget.

Online, PASK only looks entries up in this table (no attention statistics on the decode hot path):
- `floor[r, g]`: minimum fraction of bucket (r, g)'s entries kept (from task-error sensitivity);
- `priority[r, g]` in [0, 1): order in which the remaining capacity is shared (from attention-output distortion);
  the lowest-priority entries leave first;
- `retain[r, g]`: RETAIN keeps a generated entry at its priority; RELEASE drops its priority once it is older than
  `release_window` tokens, so it leaves first;
- `group_fractions[g]`: the share of the full length layer group g keeps (layer-weighted mean == budget);
- `action[r, g]` (precision tables only): RELEASE (evicted first), RETAIN_LOW (kept at LOW precision) or RETAIN_HIGH
  (kept at HIGH precision), compiled against a byte budget (`CompileOptions.entry_bytes`); `retain` is then
  "not RELEASE" and `group_fractions` the bytes a group holds over its bytes at full bf16 KV.

Saved as an orbax checkpoint (the arrays) plus `policy.json` (a readable summary carrying the model fingerprint,
layer count, group count, role taxonomy version, compile options, the calibration item ids and each bucket's action),
plus `stats.json`, the calibration statistics the tables came from (`CalibrationStats`; older policies carry none). A
policy with statistics answers any budget in (0, 1]: `table(b)` for a budget it was not compiled for compiles that
table from them with the policy's compile options (`pask_jax.policy_compiler`, milliseconds). On load, the statistics
must reproduce the stored tables, so they cannot drift from what the policy does; `content_hash` covers the stored
tables. Format "pask-policy-v2" holds precision tables (their `action` arrays); a policy without them is written in
format "pask-policy-v1" (what presence-only policies always were), and both are read.

A policy is known by what it fits, not by a name or path: `ModelFingerprint` (architecture, layers, heads, head size,
hidden size, a hash of the tokenizer's token table, role taxonomy). Using a policy for a model with another
fingerprint is an error naming both sides. Policies shipped with the package (`SHIPPED_POLICIES`) are found by
fingerprint (`find_shipped_policy`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.resources
import json
from pathlib import Path

import numpy as np

from pask_jax.policy_compiler import (
    ACTION_NAMES,
    CalibrationStats,
    CompileOptions,
    PolicyError,
    PolicyTable,
    compile_tables,
)
from pask_jax.structure.roles import ROLE_UPGRADES, TAXONOMY_VERSION, role_names, taxonomy_roles, upgrade_rows

POLICY_FORMAT = "pask-policy-v2"  # written when a table has precision actions
POLICY_FORMAT_V1 = "pask-policy-v1"  # presence-only tables (no actions): written by policies without them
SHIPPED_POLICIES = Path(str(importlib.resources.files("pask_jax") / "policies"))
STATS_FILE = "stats.json"  # the calibration statistics, beside policy.json


@dataclasses.dataclass(frozen=True)
class ModelFingerprint:
    """What a persistence policy fits: the shapes its tables index and the token ids its roles were measured on."""

    architecture: str
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    vocab_hash: str  # sha256 (first 16 hex digits) of the tokenizer's id -> bytes table
    taxonomy: str = TAXONOMY_VERSION

    @classmethod
    def of(cls, config, tokenizer) -> ModelFingerprint:
        """The fingerprint of a loaded model (its `ModelConfig`) with its tokenizer."""
        return cls(
            architecture=config.architecture,
            num_layers=config.num_layers,
            num_heads=config.num_heads,
            num_kv_heads=config.num_kv_heads,
            head_dim=config.head_dim,
            hidden_size=config.hidden_size,
            vocab_hash=vocabulary_hash(tokenizer),
        )

    def accepts(self, model: ModelFingerprint) -> bool:
        """Whether a policy fitting this fingerprint runs on `model`: the same model and tokenizer, and a role
        taxonomy this version reads (the current one, or an older one whose added roles have stand-ins)."""
        upgradable = model.taxonomy == TAXONOMY_VERSION and self.taxonomy in ROLE_UPGRADES
        readable = self.taxonomy == model.taxonomy or upgradable
        return readable and dataclasses.replace(self, taxonomy=model.taxonomy) == model

    def describe(self) -> str:
        return (
            f"{self.architecture}, {self.num_layers} layers, {self.num_heads}/{self.num_kv_heads} heads of "
            f"{self.head_dim}, hidden {self.hidden_size}, vocabulary {self.vocab_hash}, roles {self.taxonomy}"
        )


def vocabulary_hash(tokenizer) -> str:
    """sha256 over every id's bytes (special tokens by their text): equal for the same token table wherever it is."""
    digest = hashlib.sha256()
    for i, raw in enumerate(tokenizer.all_token_bytes()):
        digest.update(b"%d:%d:" % (i, len(raw)) + raw)
    return digest.hexdigest()[:16]


@dataclasses.dataclass(frozen=True, eq=False)
class PersistencePolicy:
    model: str
    num_layers: int
    groups: int
    tables: tuple[PolicyTable, ...]  # one per budget
    release_window: int = 8
    taxonomy: str = TAXONOMY_VERSION
    calibration_items: tuple[str, ...] = ()
    notes: str = ""
    fits: ModelFingerprint | None = None
    stats: CalibrationStats | None = None  # what the tables were compiled from (None: only `tables` are answered)
    compile_options: CompileOptions | None = None  # how (None: not recorded; defaults when statistics are present)
    # tables compiled from the statistics (by budget) and, for an older taxonomy, the tables answered (by key)
    _compiled_on_load: dict = dataclasses.field(default_factory=dict, init=False, repr=False)

    def table(self, budget: float) -> PolicyTable:
        """The table for `budget` over the current role ids (a policy of an older taxonomy answers the roles added
        since with their stand-ins' rows, `ROLE_UPGRADES`): a stored one, else one compiled from the statistics
        (PolicyError without them)."""
        t = self._table(budget)
        if self.taxonomy == TAXONOMY_VERSION:
            return t
        key = ("upgraded", round(float(budget), 9))
        if key not in self._compiled_on_load:
            names = ("floor", "priority", "retain") + (() if t.action is None else ("action",))
            rows = {name: upgrade_rows(getattr(t, name), self.taxonomy) for name in names}
            self._compiled_on_load[key] = dataclasses.replace(t, **rows)
        return self._compiled_on_load[key]

    def _table(self, budget: float) -> PolicyTable:
        """The table for `budget` in the policy's own taxonomy."""
        for t in self.tables:
            if abs(t.budget - budget) < 1e-9:
                return t
        if not 0.0 < budget <= 1.0:
            raise PolicyError(f"budget={budget} must be in (0, 1]")
        if self.stats is None:
            raise PolicyError(
                f"no policy table for budget {budget}; compiled budgets: {[t.budget for t in self.tables]}, and the "
                f"policy carries no calibration statistics ({STATS_FILE}) to compile another: recompile it with "
                f"`pask-jax calibrate --stats STATS --budgets {budget} --out DIR` (STATS: the calibration's statistics "
                "file, or a policy directory holding one), or calibrate anew with `pask-jax calibrate`, whose "
                "policies carry their statistics and answer any budget"
            )
        key = round(float(budget), 9)
        if key not in self._compiled_on_load:
            (table,) = compile_tables(self.stats, [budget], self.compile_options or CompileOptions())
            table.validate(taxonomy_roles(self.taxonomy), self.groups)
            self._compiled_on_load[key] = table
        return self._compiled_on_load[key]

    def check_fits(self, fingerprint: ModelFingerprint) -> None:
        """Refuse a model this policy was not calibrated for, naming both fingerprints."""
        if self.fits is None:
            raise PolicyError(f"policy for {self.model!r} carries no model fingerprint: recompile it with this version")
        if not self.fits.accepts(fingerprint):
            raise PolicyError(
                f"policy for {self.model!r} fits [{self.fits.describe()}], not this model [{fingerprint.describe()}]: "
                "calibrate one for this model with `pask-jax calibrate`"
            )

    def content_hash(self) -> str:
        """sha256 (first 16 hex digits) of what decides behaviour: the tables, groups, window and fingerprint.

        Notes and calibration item ids do not count: a recompiled identical policy keeps its hash."""
        digest = hashlib.sha256()
        head = {"fits": dataclasses.asdict(self.fits) if self.fits else None, "groups": self.groups}
        head |= {"release_window": self.release_window, "taxonomy": self.taxonomy, "num_layers": self.num_layers}
        digest.update(json.dumps(head, sort_keys=True).encode())
        for t in self.tables:
            digest.update(np.float64(t.budget).tobytes())
            for array in (t.floor, t.priority, t.retain, t.group_fractions):
                digest.update(np.ascontiguousarray(array, np.float32).tobytes())
            if t.action is not None:  # presence-only tables keep the hash they always had
                digest.update(b"action" + np.ascontiguousarray(t.action, np.int8).tobytes())
        return digest.hexdigest()[:16]

    def summary(self) -> dict:
        names = role_names()[: taxonomy_roles(self.taxonomy)]
        options = dataclasses.asdict(self.compile_options) if self.compile_options else None
        if options is not None and options["entry_bytes"] is None:  # presence-only options as they were written
            del options["entry_bytes"], options["value"]
        if options is not None and not options.get("window_bytes"):  # nothing set aside: as written before
            options.pop("window_bytes", None)

        def actions(t: PolicyTable, r: int) -> list[str]:
            if t.action is None:
                return ["RETAIN" if x else "RELEASE" for x in t.retain[r]]
            return [ACTION_NAMES[a] for a in t.action[r]]

        return {
            "format": POLICY_FORMAT if any(t.action is not None for t in self.tables) else POLICY_FORMAT_V1,
            "model": self.model,
            "fits": dataclasses.asdict(self.fits) if self.fits is not None else None,
            "num_layers": self.num_layers,
            "groups": self.groups,
            "taxonomy": self.taxonomy,
            "release_window": self.release_window,
            "calibration_items": list(self.calibration_items),
            "notes": self.notes,
            "compile_options": options,
            "tables": [
                {
                    "budget": t.budget,
                    "group_fractions": [round(float(f), 4) for f in t.group_fractions],
                    "buckets": {
                        names[r]: {
                            "floor": [round(float(x), 3) for x in t.floor[r]],
                            "priority": [round(float(x), 3) for x in t.priority[r]],
                            "action": actions(t, r),
                        }
                        for r in range(len(names))
                    },
                }
                for t in self.tables
            ],
        }

    def save(self, directory: str | Path) -> Path:
        """Write the policy to `directory`. In a multi-process run every process calls it (orbax saves the arrays
        collectively) and the first one writes the JSON files."""
        import jax
        import orbax.checkpoint as ocp

        directory = Path(directory).absolute()
        directory.mkdir(parents=True, exist_ok=True)
        arrays = {
            f"b{i}": {
                f.name: np.asarray(getattr(t, f.name))
                for f in dataclasses.fields(PolicyTable)
                if getattr(t, f.name) is not None  # presence-only tables have no action array
            }
            for i, t in enumerate(self.tables)
        }
        with ocp.StandardCheckpointer() as ckpt:
            ckpt.save(directory / "tables", arrays, force=True)
        if jax.process_index() == 0:
            (directory / "policy.json").write_text(json.dumps(self.summary(), indent=1) + "\n")
            if self.stats is not None:
                self.stats.save(directory / STATS_FILE)
            else:  # a stale file would make this policy answer budgets from another calibration
                (directory / STATS_FILE).unlink(missing_ok=True)
        return directory

    @classmethod
    def load(cls, directory: str | Path) -> PersistencePolicy:
        import orbax.checkpoint as ocp

        directory = Path(directory).absolute()
        meta_path = directory / "policy.json"
        if not meta_path.exists():
            raise PolicyError(f"{directory} holds no policy (no policy.json); create one with `pask-jax calibrate`")
        meta = json.loads(meta_path.read_text())
        if meta.get("format") not in (POLICY_FORMAT_V1, POLICY_FORMAT):
            raise PolicyError(
                f"{meta_path}: format {meta.get('format')!r}, expected {POLICY_FORMAT_V1!r} or {POLICY_FORMAT!r}"
            )
        with ocp.StandardCheckpointer() as ckpt:
            arrays = ckpt.restore(directory / "tables")
        stats = CalibrationStats.load(directory / STATS_FILE) if (directory / STATS_FILE).is_file() else None
        options = meta.get("compile_options")
        tables = tuple(
            PolicyTable(
                budget=float(arrays[f"b{i}"]["budget"]),
                floor=np.asarray(arrays[f"b{i}"]["floor"], np.float32),
                priority=np.asarray(arrays[f"b{i}"]["priority"], np.float32),
                retain=np.asarray(arrays[f"b{i}"]["retain"], bool),
                group_fractions=np.asarray(arrays[f"b{i}"]["group_fractions"], np.float32),
                action=np.asarray(arrays[f"b{i}"]["action"], np.int8) if "action" in arrays[f"b{i}"] else None,
            )
            for i in range(len(meta["tables"]))
        )
        policy = cls(
            model=meta["model"],
            num_layers=meta["num_layers"],
            groups=meta["groups"],
            tables=tables,
            release_window=meta["release_window"],
            taxonomy=meta["taxonomy"],
            calibration_items=tuple(meta["calibration_items"]),
            notes=meta.get("notes", ""),
            fits=ModelFingerprint(**meta["fits"]) if meta.get("fits") else None,
            stats=stats,
            compile_options=CompileOptions(**options) if options else (CompileOptions() if stats else None),
        )
        try:
            roles = taxonomy_roles(policy.taxonomy)
        except ValueError as error:
            raise PolicyError(f"{meta_path}: {error}") from None
        for t in tables:
            t.validate(roles, policy.groups)
        if stats is not None:
            policy._check_statistics(directory)
        return policy

    def _check_statistics(self, source: Path) -> None:
        """Refuse statistics that do not belong to the stored tables (another model, groups or compile options)."""
        hint = (
            f"{source / STATS_FILE} belongs to another calibration or compile options: remove it (the policy then "
            f"answers only its compiled budgets) or recompile the policy from it with `pask-jax calibrate --stats "
            f"{source / STATS_FILE} --out DIR`"
        )
        s = self.stats
        if (s.num_layers, s.groups, s.taxonomy) != (self.num_layers, self.groups, self.taxonomy):
            raise PolicyError(
                f"statistics for {s.num_layers} layers in {s.groups} groups, roles {s.taxonomy}; the policy has "
                f"{self.num_layers} layers in {self.groups} groups, roles {self.taxonomy}: {hint}"
            )
        try:
            again = compile_tables(s, [t.budget for t in self.tables], self.compile_options)
        except PolicyError as error:  # e.g. precision options with statistics that have no LOW measurements
            raise PolicyError(f"{error}: {hint}") from None
        for stored, recompiled in zip(self.tables, again, strict=True):
            for field in ("floor", "priority", "group_fractions", "retain", "action"):
                a, b = (getattr(t, field) for t in (stored, recompiled))
                if a is None and b is None:  # presence-only tables: no actions on either side
                    continue
                a, b = (None if x is None else np.asarray(x, np.float64) for x in (a, b))
                if a is None or b is None or a.shape != b.shape or not np.allclose(a, b, rtol=0.0, atol=1e-6):
                    raise PolicyError(f"the statistics do not reproduce the {field} of budget {stored.budget}: {hint}")


def find_shipped_policy(fingerprint: ModelFingerprint, root: Path = SHIPPED_POLICIES) -> PersistencePolicy:
    """The shipped policy calibrated for this model, found by fingerprint; PolicyError saying how to make one."""
    for meta_path in sorted(root.glob("*/policy.json")):
        fits = json.loads(meta_path.read_text()).get("fits")
        if fits and ModelFingerprint(**fits).accepts(fingerprint):
            return PersistencePolicy.load(meta_path.parent)
    raise PolicyError(
        f"no shipped PASK policy fits this model [{fingerprint.describe()}]: calibrate one with `pask-jax calibrate "
        "--model M --data requests.jsonl --out DIR` and pass policy=DIR (or run PASK uncalibrated with policy=None)"
    )


def resolve_policy(spec: str | Path | PersistencePolicy | None, fingerprint: ModelFingerprint):
    """A policy as users name one: "auto" (the shipped policy that fits), a directory or a loaded policy (refused if
    it fits another model), or None (no policy)."""
    if spec is None:
        return None
    if isinstance(spec, str) and spec == "auto":
        return find_shipped_policy(fingerprint)
    policy = spec if isinstance(spec, PersistencePolicy) else PersistencePolicy.load(spec)
    policy.check_fits(fingerprint)
    return policy
