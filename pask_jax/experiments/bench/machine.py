"""What a benchmark records about where it ran: the machine, the device's memory, the code, the XLA compiles."""

from __future__ import annotations

import functools
import hashlib
import json
import os
import platform
import subprocess
from pathlib import Path

import jax

import pask_jax

COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"  # jax.monitoring: one per XLA backend compile
PACKAGE = Path(pask_jax.__file__).resolve().parent


def cpu_name() -> str:
    """The CPU's model name (Linux /proc/cpuinfo), else what `platform` knows."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        lines = []
    names = (line.split(":", 1)[1].strip() for line in lines if line.startswith("model name"))
    return next(names, platform.processor())


def machine_info() -> dict:
    """CPU, cores (all and usable), Python, JAX version, backend and devices, device memory, load at the start."""
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {
        "platform": platform.platform(),
        "cpu": cpu_name(),
        "cpu_count": os.cpu_count(),
        "cpu_affinity": usable,
        "python": platform.python_version(),
        "jax": jax.__version__,
        "jax_backend": jax.default_backend(),
        "devices": [str(d) for d in jax.devices()],
        "device_memory": device_memory(),
        "loadavg_start": os.getloadavg(),
    }


def device_memory() -> dict[str, int] | None:
    """The first device's `memory_stats()` (bytes in use, peak, limit, ...); None where the backend has none (CPU)."""
    stats = jax.devices()[0].memory_stats()
    return {k: int(v) for k, v in stats.items()} if stats else None


def device_peak_bytes() -> int | None:
    """The device's peak bytes in use so far (process-wide), where the backend reports it."""
    stats = device_memory()
    return stats.get("peak_bytes_in_use") if stats else None


def code_state() -> dict:
    """The commit, the uncommitted package files and a hash of the runtime's sources: which code produced the
    numbers."""

    def git(*args: str) -> str:
        try:
            run = subprocess.run(["git", *args], capture_output=True, text=True, check=True, cwd=PACKAGE.parent)
        except (OSError, subprocess.CalledProcessError):  # not a git checkout (an installed wheel)
            return ""
        return run.stdout.strip()

    return {
        "commit": git("rev-parse", "HEAD"),
        "dirty_package_files": git("status", "--porcelain", "--", PACKAGE.name).splitlines(),
        "runtime_sha256": hashlib.sha256(
            b"".join(p.read_bytes() for p in sorted((PACKAGE / "runtime").glob("*.py")))
        ).hexdigest()[:16],
    }


def int_list(text: str) -> tuple[int, ...]:
    """A comma-separated list of integers (an argparse `type=`)."""
    return tuple(int(x) for x in text.split(","))


def write_json(path: str | Path, data: dict) -> None:
    """Write JSON atomically, the parent directory made if missing: a temporary file renamed over `path`, so an
    interrupted run never leaves half a file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=1) + "\n")
    os.replace(tmp, path)


def write_result(out: str | Path, result: dict) -> None:
    """Write a benchmark's JSON (`write_json`), the machine's load at the end beside it."""
    result["loadavg_end"] = list(os.getloadavg())
    write_json(out, result)


_compiles = [0]


@functools.cache
def _listen_for_compiles() -> None:
    def on_duration(event: str, duration: float, **kwargs) -> None:
        if event == COMPILE_EVENT:
            _compiles[0] += 1

    jax.monitoring.register_event_duration_secs_listener(on_duration)


def compiles_so_far() -> int:
    """XLA backend compiles in this process since the first call (which starts listening)."""
    _listen_for_compiles()
    return _compiles[0]
