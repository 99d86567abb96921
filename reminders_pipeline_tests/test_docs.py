"""The documents the code cites exist, and the operator's guide lists exactly the settings read."""

from __future__ import annotations

import re
from pathlib import Path

from reminders_pipeline.config.settings import Settings
from reminders_pipeline.config.settings_table import markdown_table

ROOT = Path(__file__).resolve().parent.parent
GUIDE = ROOT / "docs" / "operations.md"
# Where a path to a document or deploy file may be cited: the package, the benchmarks, the docs,
# the deploy examples and the project's own files (the tests' fixtures may name made-up paths).
CITING = [
    "README.md",
    "pyproject.toml",
    "dagster.yaml",
    "workspace.yaml",
    "docs/*.md",
    "deploy/**/*",
    "reminders_pipeline/**/*.py",
    "bench/*.py",
]
CITED = re.compile(r"\b(?:docs|deploy)/[A-Za-z0-9_./-]*[A-Za-z0-9_-]\.(?:md|yaml|yml|json)\b")


def test_every_cited_document_exists():
    cited: dict[str, set[str]] = {}
    for pattern in CITING:
        for path in ROOT.glob(pattern):
            if path.is_file():
                for ref in CITED.findall(path.read_text(errors="replace")):
                    cited.setdefault(ref, set()).add(str(path.relative_to(ROOT)))
    assert "docs/operations.md" in cited  # pyproject.toml cites it: the scan sees what it should
    missing = {ref: sorted(where) for ref, where in cited.items() if not (ROOT / ref).exists()}
    assert not missing, f"cited but missing: {missing}"


def test_the_operations_guide_has_the_settings_table_the_model_generates():
    """Regenerate it with ``python -m reminders_pipeline.config.settings_table`` after changing a setting."""
    guide = GUIDE.read_text()
    start = guide.index("| variable | default | meaning |\n")
    table = guide[start : guide.index("\n\n", start) + 1]
    assert table == markdown_table()
    assert len(Settings.model_fields) > 50
    rows = re.findall(r"^\| `(REMINDERS_[A-Z_]+)` \|", guide, flags=re.MULTILINE)
    assert len(rows) == len(set(rows)) == len(Settings.model_fields)  # no second table of settings


def test_the_readme_is_a_newcomers_page():
    """At most 200 lines: what it does, the two commands, the flow and a row's states as diagrams, a
    glossary, where to start reading; everything else lives in docs/."""
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 200
    assert readme.count("```mermaid") == 2 and "stateDiagram" in readme and "flowchart" in readme
    for heading in ("## The two commands", "## Glossary", "## Where to start reading", "## Read next"):
        assert heading in readme
