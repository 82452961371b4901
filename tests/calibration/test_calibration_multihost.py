"""Multi-host calibration as a TPU pod runs it: the same `pask-jax calibrate` command on every host, joined by
`jax.distributed` (here two local CPU processes with CPU collectives), gives the statistics of one process."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from support import free_port
from test_calibrate_data import _same, calibrate_command, write_model_dir, write_requests

from pask_jax import cli
from pask_jax.calibration.run import CalibrationStats
from pask_jax.policy import PersistencePolicy

PROCESSES = 2
ITEMS = ("--max-items", "2")  # of the 4 calibration requests: enough to compare, and quick


def test_two_processes_give_the_statistics_of_one(tmp_path: Path, capsys):
    model_dir = write_model_dir(tmp_path / "model", layers=2)
    data = write_requests(tmp_path / "requests.jsonl", per_tool_set=1)
    # every host runs the same command; --out and --checkpoint lie on storage both see (as on a pod: NFS, GCS FUSE)
    progress = tmp_path / "pod-progress"
    command = calibrate_command(model_dir, data, tmp_path / "pod", "--checkpoint", str(progress), *ITEMS)
    cluster = {
        "JAX_COORDINATOR_ADDRESS": f"localhost:{free_port()}",
        "JAX_NUM_PROCESSES": str(PROCESSES),
        "JAX_PLATFORMS": "cpu",
        "XLA_FLAGS": "",  # one CPU device per process: the mesh's two devices are one per host
    }
    hosts = [
        subprocess.Popen(
            [sys.executable, "-m", "pask_jax.cli", *command],
            env=os.environ | cluster | {"JAX_PROCESS_ID": str(i)},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(PROCESSES)
    ]
    try:
        outputs = [host.communicate(timeout=300) for host in hosts]
    finally:
        for host in hosts:  # a host whose peer failed waits for it: end it
            host.kill()
    for host, (_, err) in zip(hosts, outputs, strict=True):
        assert host.returncode == 0, err[-3000:]
    (first, _), (second, _) = outputs
    assert "2 items calibrated" in first and "policy for" not in second  # process 1 knew it was not the first

    with pytest.raises(SystemExit) as exit_info:
        cli.main(calibrate_command(model_dir, data, tmp_path / "one", *ITEMS))
    assert exit_info.value.code == 0 and "2 items calibrated" in capsys.readouterr().out
    pod, one = (CalibrationStats.load(tmp_path / part / "stats.json") for part in ("pod", "one"))
    assert pod.n_items == 2 and not pod.skipped
    _same(pod, one)
    assert (
        PersistencePolicy.load(tmp_path / "pod").content_hash()
        == PersistencePolicy.load(tmp_path / "one").content_hash()
    )
