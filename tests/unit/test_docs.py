"""The documentation cannot rot: its marked Python examples run, every flag its commands show
exists, and the server reference is what `docs/gen_cli.py` writes from the parser.

A Python block runs when the line before its fence is `<!-- test: run -->` (invisible on
GitHub and in the site); a Python or shell block marked `<!-- test: run with the server -->`
runs against one server, as the pages start it (the demo model, `--tool-call-parser hermes
--reasoning-parser qwen3`) on the port they name; the others need a GPU or files of the
reader's own.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import inspect
import io
import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path
from unittest import mock

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = [
    ROOT / "README.md",
    *sorted((ROOT / "docs").glob("*.md")),
    ROOT / "benchmarks" / "README.md",
]
RUN = "<!-- test: run -->"
SERVED = "<!-- test: run with the server -->"
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.M | re.S)
COMMAND = re.compile(r"python -m (server|benchmarks\.\w+)\b([^\n]*)")


def _fenced(page: Path) -> list[tuple[str, str, int, str | None]]:
    """Each fenced block of a page: its language, code, first line, and its mark (RUN,
    SERVED or None)."""
    text = page.read_text()
    out = []
    for m in FENCE.finditer(text):
        line = text.count("\n", 0, m.start()) + 1
        before = text[: m.start()].rstrip("\n").rsplit("\n", 1)[-1].strip()
        out.append((m.group(1), m.group(2), line + 1, before if before in (RUN, SERVED) else None))
    return out


def _commands() -> list[tuple[str, str, list[str]]]:
    """Every `python -m server` / `python -m benchmarks.X` command the pages show, in shell
    blocks or inline code: (where, module, its flags)."""
    found = []
    for page in PAGES:
        text = page.read_text()
        # a shell block's lines (continuations joined) are commands; inline code may wrap
        shell = [
            code.replace("\\\n", " ")
            for lang, code, _, _ in _fenced(page)
            if lang in ("bash", "sh", "")
        ]
        inline = [" ".join(s.split()) for s in re.findall(r"`([^`]+)`", FENCE.sub("", text))]
        for snippet in shell + inline:
            for m in COMMAND.finditer(snippet):
                rest = re.split(r"&&|\||;|\s#", m.group(2))[0]
                flags = [t.split("=")[0] for t in shlex.split(rest) if t.startswith("--")]
                found.append((str(page.relative_to(ROOT)), m.group(1), flags))
    return found


def _benchmark_flags(module: str) -> set[str]:
    """The flags a benchmark's `--help` lists (its parser is built inside `main`)."""
    main = importlib.import_module(module).main
    out = io.StringIO()
    argv = ["--help"]
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit):
        if inspect.signature(main).parameters:
            main(argv)
        else:
            with mock.patch.object(sys, "argv", [module, *argv]):
                main()
    return set(re.findall(r"(?<![\w-])--[\w-]+", out.getvalue()))


def test_every_flag_the_docs_show_exists():
    from server.cli import build_parser

    commands = _commands()
    assert any(module == "server" for _, module, _ in commands)
    known = {"server": set(build_parser()._option_string_actions)}
    unknown = []
    for where, module, flags in commands:
        if module not in known:
            known[module] = _benchmark_flags(module)
        unknown += [f"{where}: python -m {module} {f}" for f in flags if f not in known[module]]
    assert not unknown, unknown


def test_server_reference_is_generated():
    spec = importlib.util.spec_from_file_location("gen_cli", ROOT / "docs" / "gen_cli.py")
    assert spec is not None and spec.loader is not None
    gen_cli = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen_cli)
    from server.cli import build_parser

    assert gen_cli.PAGE.read_text() == gen_cli.render(build_parser()), (
        "docs/server-reference.md is stale: run `python docs/gen_cli.py`"
    )


# Runs the examples one after the other in one process, each in a namespace of its own. Two
# changes keep it cheap without changing what an example prints: a model is loaded once per
# set of arguments (no example changes weights), and an LLM skips warm-up (compiling every
# token bucket up front, ~40 s an engine here) unless the example asks for it.
RUNNER = """
import functools, gc, json, subprocess, sys, traceback

from jpaged import models
from jpaged.engine import llm
from jpaged.engine.compile import use_compilation_cache

use_compilation_cache(sys.argv[1])
models.load = functools.cache(models.load)
init = llm.LLM.__init__


def without_warmup(self, model, **options):
    options.setdefault("warmup", False)
    init(self, model, **options)


def serve():
    # the pages' server (python -m server --no-warmup --tool-call-parser hermes
    # --reasoning-parser qwen3) in a thread, on a free port: its address
    import socket, threading, time

    import uvicorn

    from jpaged.config import EngineConfig
    from jpaged.engine.async_engine import AsyncEngine
    from jpaged.engine.engine import Engine
    from server.app import build_app
    from server.parse import Options

    loaded = models.load("smollm2-135m", "float32")
    config = EngineConfig(dtype="float32", warmup=False, max_seq_len=1024, max_batch_size=4)
    options = Options(tool_call_parser="hermes", reasoning_parser="qwen3")
    app = build_app(AsyncEngine(Engine(loaded, config)), "SmolLM2-135M-Instruct", options=options)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True).start()
    while not server.started:
        time.sleep(0.05)
    return f"127.0.0.1:{sock.getsockname()[1]}"


llm.LLM.__init__ = without_warmup
address = None
for where, lang, code, served in json.load(sys.stdin):
    print(f"--- {where}", flush=True)
    if served:
        address = address or serve()
        code = code.replace("127.0.0.1:8000", address)
    try:
        if lang == "python":
            exec(compile(code, where, "exec"), {"__name__": "__main__"})
        else:  # a shell block: curl fails on an error status
            code = code.replace("curl ", "curl -sS --fail-with-body ")
            subprocess.run(["bash", "-ec", code], check=True)
            print(flush=True)
    except Exception:
        traceback.print_exc()
        sys.exit(f"the example at {where} failed")
    gc.collect()  # the example's engine and its KV pool
"""


@pytest.mark.slow
def test_examples_run(demo_gguf):
    demo_gguf("smollm2-135m")  # (a skip that says how to install it)
    examples = [
        (f"{page.relative_to(ROOT)}:{line}", lang, code, mark == SERVED)
        for page in PAGES
        for lang, code, line, mark in _fenced(page)
        if mark is not None
    ]
    # (the server's last: it starts once, for them)
    examples.sort(key=lambda example: example[3])
    assert all(lang in ("python", "bash") for _, lang, _, _ in examples)
    assert len(examples) >= 8 and sum(served for *_, served in examples) >= 3
    cache = os.environ.get("JPAGED_TEST_XLA_CACHE", "~/.cache/jpaged/xla")
    done = subprocess.run(
        [sys.executable, "-c", RUNNER, cache],
        input=json.dumps(examples),
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        timeout=600,
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-8000:]
