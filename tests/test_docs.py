"""The docs and the code say the same: one glossary, kept in two places."""

from __future__ import annotations

import re
from pathlib import Path

import zeroshard.layout.flat_buffer

ROOT = Path(__file__).parent.parent


def _terms(text: str, bullet: str) -> dict[str, str]:
    """``{term: "(shape): definition"}`` of every ``<bullet> **term** (...): ...`` item, whitespace and quoting normalized."""
    items = re.split(rf"\n\s*{re.escape(bullet)} (?=\*\*)", "\n" + text)[1:]
    terms = {}
    for item in items:
        item = " ".join(item.split()).replace("``", "`")
        term, rest = re.fullmatch(r"\*\*(.+?)\*\* (.*)", item).groups()
        terms[term] = rest
    return terms


def test_the_code_note_and_the_design_glossary_define_the_same_terms_alike():
    design = (ROOT / "docs" / "design.md").read_text()
    glossary = design[design.index("## Glossary") : design.index("## Code map")]
    note = zeroshard.layout.flat_buffer.__doc__
    note = note[note.index("[Note: zeroshard buffers]") :]
    in_docs, in_code = _terms(glossary, "-"), _terms(note, "*")
    for needed in ("bucket", "slice", "shard", "piece", "chunk", "run", "virtual parameter"):
        assert needed in in_docs, needed
    assert in_code == in_docs
