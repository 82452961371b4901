"""Offline calibration of PASK persistence policies (task-error sensitivity, attention-output distortion per bucket).

Sits above `pask_jax.bfcl` in the dependency order (DESIGN.md section 2):

- `calibration.passes`: the jitted passes for one item: prefill the prompt once, then teacher-force its gold call
  with a (role, layer group) bucket's entries removed, or only a recent fraction kept, many variants per batch.
- `calibration.run`: BFCL calibration items -> gold calls with roles -> passes (sharded over a device mesh, orbax
  checkpoints to resume) -> `CalibrationStats`; `python -m calibration.run --out stats.json`.
- `calibration.policy`: `CalibrationStats` -> persistence policy tables per budget.
"""
