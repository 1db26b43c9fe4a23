"""mkdocs hook: the site holds README.md, docs/ and benchmarks/'s pages at their repository
paths, so the relative links that GitHub follows are the links `mkdocs build --strict` checks."""

from __future__ import annotations

from pathlib import Path

from mkdocs.config.defaults import MkDocsConfig
from mkdocs.structure.files import File, Files

# Besides docs/: repository files that are pages of the site (or images the pages show).
PATTERNS = ("README.md", "benchmarks/*.md", "benchmarks/*.png", "benchmarks/results/*.md")


def on_files(files: Files, config: MkDocsConfig) -> Files:
    root = Path(config.config_file_path).resolve().parent
    docs = Path(config.docs_dir).resolve()
    out = []
    for f in files:
        path = Path(f.abs_src_path or "").resolve()
        if not path.is_relative_to(docs):
            out.append(f)  # the theme's own files
        elif path.suffix != ".py":  # (this hook and the CLI page's generator)
            out.append(File(path.relative_to(root).as_posix(), str(root), **_dest(config)))
    for pattern in PATTERNS:
        for path in sorted(root.glob(pattern)):
            out.append(File(path.relative_to(root).as_posix(), str(root), **_dest(config)))
    return Files(out)


def _dest(config: MkDocsConfig) -> dict:
    return {"dest_dir": config.site_dir, "use_directory_urls": config.use_directory_urls}
