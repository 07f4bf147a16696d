"""The repository explains itself: no file of it cites a document outside it (the contract it implements is
docs/contract.md, in the project's own words)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TREES = ("tether", "tests", "bench", "docs", "deploy", ".ci")
FILES = ("README.md", "Dockerfile", "Makefile", "pyproject.toml", ".dockerignore")
OUTSIDE = re.compile(r"\b(DESIGN|STYLE)\.md\b|\.\./shared/")


def ours() -> list[Path]:
    found = [ROOT / name for name in FILES if (ROOT / name).exists()]
    for tree in TREES:
        found += [p for p in (ROOT / tree).rglob("*") if p.is_file() and "__pycache__" not in p.parts
                  and p.suffix not in (".png", ".pyc", ".db")]
    return found


def test_no_file_cites_a_document_outside_the_repository() -> None:
    files = ours()
    assert len(files) > 100 and ROOT / "tether" / "capability" / "chain.py" in files  # the walk sees the code
    cited = [f"{p.relative_to(ROOT)}:{n}" for p in files if p != Path(__file__).resolve()
             for n, line in enumerate(p.read_text(errors="replace").splitlines(), 1) if OUTSIDE.search(line)]
    assert cited == []


def test_the_contract_page_has_every_section_the_code_cites() -> None:
    contract = (ROOT / "docs" / "contract.md").read_text()
    sections = {int(m) for m in re.findall(r"^## (\d+)\. ", contract, re.M)}
    cites = {int(n) for p in ours() for n in re.findall(r"contract\.md sections? (\d+)",
                                                        p.read_text(errors="replace"))}
    assert cites and cites <= sections, cites - sections
