"""The built wheel works outside the source checkout: console script, package data, a tiny-model generation."""

from __future__ import annotations

import subprocess
import sys
import sysconfig
import textwrap
import venv
from pathlib import Path

REPO = Path(__file__).parents[2]

GENERATE = textwrap.dedent(
    """
    import json, pathlib, sys
    from flax import nnx
    import pask_jax
    from pask_jax.factory import make_engine
    from pask_jax.methods import DEFAULT_METHOD_CONFIG, load_method_config
    from pask_jax.models.decoder import Decoder, ModelConfig
    from pask_jax.policy import SHIPPED_POLICIES, PersistencePolicy

    model = Decoder(ModelConfig.tiny("qwen2"), rngs=nnx.Rngs(0))
    engine = make_engine(model, "snapkv", 0.5)
    (gen,) = engine.generate([[1, 2, 3, 4, 5, 6, 7, 8]])
    policy = PersistencePolicy.load(SHIPPED_POLICIES / "qwen2.5-coder-0.5b")
    print(json.dumps({
        "package": pask_jax.__file__,
        "tokens": len(gen.tokens),
        "method_config": sorted(load_method_config()),
        "config_file": str(DEFAULT_METHOD_CONFIG),
        "policy_budgets": [t.budget for t in policy.tables],
    }))
    """
)


def test_wheel_installs_and_runs_outside_the_checkout(tmp_path: Path):
    wheels = tmp_path / "wheels"
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", wheels, REPO],
        check=True,
    )
    (wheel,) = wheels.glob("pask_jax-*.whl")
    env_dir = tmp_path / "venv"
    venv.create(env_dir)  # no pip of its own (ensurepip takes seconds): this environment's pip installs into it
    python = env_dir / "bin" / "python"
    subprocess.run([sys.executable, "-m", "pip", "--python", python, "install", "-q", "--no-deps", wheel], check=True)
    # Dependencies come from the test environment's site-packages, appended after the new venv's own (a .pth line
    # only extends sys.path: the checkout's editable-install hook there is not run).
    site = subprocess.run(
        [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], capture_output=True, text=True
    ).stdout.strip()
    (Path(site) / "deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    outside = tmp_path / "elsewhere"
    outside.mkdir()

    help_text = subprocess.run(
        [env_dir / "bin" / "pask-jax", "--help"], cwd=outside, capture_output=True, text=True, check=True
    ).stdout
    assert "run" in help_text and "calibrate" in help_text and "bench" in help_text
    out = subprocess.run([python, "-c", GENERATE], cwd=outside, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]
    import json

    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["package"].startswith(site) and str(REPO) not in result["package"]
    assert result["config_file"].startswith(site)
    assert result["tokens"] >= 1 and "pask:v1" in result["method_config"]
    assert result["policy_budgets"] == [0.2, 0.33, 0.5]
