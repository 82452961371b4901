"""Offline calibration of PASK persistence policies (task-error sensitivity, attention-output distortion per bucket).

Sits above the engine and the request builder in the dependency order (docs/ARCHITECTURE.md), below the experiments,
inside the package so that an installed wheel has it; the CLI imports it only for `pask-jax calibrate`.

- `pask_jax.calibration.data`: a user's OpenAI Batch lines, checked and split by tool set into calibration and dev
  parts.
- `pask_jax.calibration.passes`: the jitted passes for one item: prefill the prompt once, then teacher-force its gold
  call with a (role, layer group) bucket's entries removed, or only a recent fraction kept, many variants per batch.
- `pask_jax.calibration.run`: prepared requests -> gold calls with roles -> passes (sharded
  over a device mesh, orbax checkpoints to resume) -> `CalibrationStats`.
- `pask_jax.calibration.compiler`: `CalibrationStats` -> a persistence policy carrying its statistics (the compiler
  core is `pask_jax.policy_compiler`, so a loaded policy compiles other budgets without this package).
"""
