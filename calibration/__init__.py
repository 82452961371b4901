"""Offline calibration of PASK persistence policies (task-error sensitivity, attention-output distortion per bucket).

Sits above `pask_jax.bfcl` in the dependency order (DESIGN.md section 2); the passes land with the PASK issue.
"""
