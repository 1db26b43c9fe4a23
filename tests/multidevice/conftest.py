"""What the multi-device tests borrow from tests/integration (its files are not packages:
pytest imports them by path)."""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest


@pytest.fixture(scope="session")
def integration() -> Callable[[str], Any]:
    """`integration("conftest")`: that module of tests/integration, loaded once."""
    loaded: dict[str, Any] = {}

    def load(name: str) -> Any:
        if name not in loaded:
            path = Path(__file__).parents[1] / "integration" / f"{name}.py"
            spec = importlib.util.spec_from_file_location(f"integration_{name}", path)
            assert spec is not None and spec.loader is not None
            module = importlib.util.module_from_spec(spec)
            sys.modules[spec.name] = module  # a dataclass in it looks its module up
            spec.loader.exec_module(module)
            loaded[name] = module
        return loaded[name]

    return load
