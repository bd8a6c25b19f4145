"""The repository explains itself: code cites docs/ only, and every citation points somewhere.

- no tracked .py file cites the design notes that lived outside the repository (their
  content is in docs/architecture.md and docs/style.md, with the same numbering);
- every `docs/<name>.md` a .py file names exists;
- `docs/architecture.md §N` has a `## N.` heading, `docs/architecture.md, "Name"` (or
  `docs/operations.md, "Name"`) a heading that starts with Name, and `docs/style.md rule N` (or `rules N and M`, `rule N/M`) a
  `### Rule N:` heading;
- the docs (docs/*.md, docs/decisions/*.md) are held to the same citation rules, and their relative
  links (files and `#anchors`) resolve;
- docstrings and comments under algorithms/, datasets/, fedcli/ and tracking/ cite no issue number,
  nor does docs/architecture.md (the reference; history is in docs/decisions/);
- the decision records are numbered without gaps, indexed, and each has its context, decision and
  consequences.
"""

from __future__ import annotations

import ast
import io
import re
import subprocess
import tokenize
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
OLD_NOTES = re.compile(r"\b(?:DESIGN|STYLE)\.md\b")  # the notes outside the repo (not docs/*.md)
DOC_PATH = re.compile(r"\bdocs/[A-Za-z0-9_./-]+?\.md\b")
ARCH_SECTION = re.compile(r"\barchitecture\.md,?\s*§\s*(\d+)")
NAMED = re.compile(r"\b(architecture|operations)\.md,?\s*\(?\"([^\"]+)\"")  # the references cited by name
STYLE_RULES = re.compile(r"\bstyle\.md\s+rules?\s+(\d+(?:\s*(?:,|/|and)\s*\d+)*)")
SKIP_DIRS = {".git", ".venv", "build", "fedcli-runs", "mlruns", "__pycache__", "node_modules"}


def python_files() -> list[Path]:
    """Tracked .py files (git ls-files), or every .py file outside build/venv folders without git."""
    try:
        out = subprocess.run(
            ["git", "ls-files", "-z", "--", "*.py"], cwd=ROOT, capture_output=True, timeout=30, check=True
        ).stdout
        files = [ROOT / name for name in out.decode().split("\0") if name]
    except (OSError, subprocess.SubprocessError):
        files = [
            p
            for p in ROOT.rglob("*.py")
            if not SKIP_DIRS & set(p.relative_to(ROOT).parts)
            and not any(
                part.startswith(".") or part.endswith(".egg-info") for part in p.relative_to(ROOT).parts
            )
        ]
    return sorted(p for p in files if p.is_file())


def headings(doc: Path) -> list[str]:
    return [
        line.lstrip("#").strip()
        for line in doc.read_text(encoding="utf-8").splitlines()
        if line.startswith("#")
    ]


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to dashes."""
    return re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")


def doc_files() -> list[Path]:
    return sorted(DOCS.glob("*.md")) + sorted(DOCS.glob("decisions/*.md"))


def citations() -> list[tuple[Path, str]]:
    """(path, text) of every .py file but this one (its patterns and docstring are not citations) and
    of every doc."""
    this = Path(__file__).resolve()
    files = [path for path in python_files() if path.resolve() != this] + doc_files()
    return [(path, path.read_text(encoding="utf-8")) for path in files]


def where(path: Path, text: str, pos: int) -> str:
    return f"{path.relative_to(ROOT)}:{text.count(chr(10), 0, pos) + 1}"


def test_no_python_file_cites_the_notes_outside_the_repo() -> None:
    found = [
        where(path, text, m.start()) + f": {m.group(0)}"
        for path, text in citations()
        for m in OLD_NOTES.finditer(text)
        if text[max(0, m.start() - 5) : m.start()] != "docs/"
    ]
    assert not found, "cite docs/architecture.md §N / docs/style.md rule N instead:\n" + "\n".join(found)


def test_cited_docs_exist() -> None:
    missing = [
        where(path, text, m.start()) + f": {m.group(0)}"
        for path, text in citations()
        for m in DOC_PATH.finditer(text)
        if not (ROOT / m.group(0)).is_file()
    ]
    assert not missing, "\n".join(missing)


def test_cited_sections_and_rules_exist() -> None:
    arch, style = headings(DOCS / "architecture.md"), headings(DOCS / "style.md")
    sections = {m.group(1) for h in arch if (m := re.match(r"(\d+)\.\s", h))}
    names = {
        doc: [re.sub(r"^\d+\.\s*", "", h).lower() for h in headings(DOCS / f"{doc}.md")]
        for doc in ("architecture", "operations")
    }
    rules = {m.group(1) for h in style if (m := re.match(r"Rule (\d+):", h))}
    bad = []
    for path, text in citations():
        for m in ARCH_SECTION.finditer(text):
            if m.group(1) not in sections:
                bad.append(where(path, text, m.start()) + f": no '## {m.group(1)}.' in docs/architecture.md")
        for m in NAMED.finditer(text):
            cited = " ".join(m.group(2).lower().split())  # a name may wrap across lines
            if not any(name.startswith(cited) for name in names[m.group(1)]):
                bad.append(
                    where(path, text, m.start()) + f": no heading {m.group(2)!r} in docs/{m.group(1)}.md"
                )
        for m in STYLE_RULES.finditer(text):
            for number in re.findall(r"\d+", m.group(1)):
                if number not in rules:
                    bad.append(where(path, text, m.start()) + f": no 'Rule {number}:' in docs/style.md")
    assert not bad, "\n".join(bad)


def test_style_keeps_rules_1_to_19_and_architecture_sections_1_to_9() -> None:
    """Old citations used these numbers; the docs keep them."""
    rules = [int(m.group(1)) for h in headings(DOCS / "style.md") if (m := re.match(r"Rule (\d+):", h))]
    sections = [
        int(m.group(1)) for h in headings(DOCS / "architecture.md") if (m := re.match(r"(\d+)\.\s", h))
    ]
    assert rules == list(range(1, 20))
    assert sections == list(range(1, 10))


@pytest.mark.parametrize("doc", doc_files(), ids=lambda p: p.relative_to(DOCS).as_posix())
def test_links_between_docs_resolve(doc: Path) -> None:
    text = doc.read_text(encoding="utf-8")
    text = re.sub(r"```.*?```", "", text, flags=re.S)  # code blocks hold no links
    bad = []
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"[a-z]+://", target):
            continue
        file_part, _, anchor = target.partition("#")
        linked = (doc.parent / file_part).resolve() if file_part else doc
        if not linked.exists():
            bad.append(f"{target}: no such file")
        elif anchor and linked.suffix == ".md" and anchor not in {slug(h) for h in headings(linked)}:
            bad.append(f"{target}: no such heading")
    assert not bad, f"{doc.name}: " + "; ".join(bad)


def test_the_reference_cites_no_issue_number() -> None:
    text = (DOCS / "architecture.md").read_text(encoding="utf-8")
    found = [
        f"architecture.md:{text.count(chr(10), 0, m.start()) + 1}: {m.group()}" for m in ISSUE.finditer(text)
    ]
    assert not found, "say what was decided (history goes to docs/decisions/):\n" + "\n".join(found)


ISSUE = re.compile(r"[Ii]ssue \d+")
NO_ISSUE_DIRS = (
    "algorithms/",
    "datasets/",
    "fedcli/",
    "tracking/",
)  # docstrings and comments cite docs/, not issues


def issue_citations(source: str) -> list[tuple[int, str]]:
    """(line, text) of every `issue N` in a module's docstrings and comments (string values are not read)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef) and node.body:
            first = node.body[0]
            if (
                isinstance(first, ast.Expr)
                and isinstance(first.value, ast.Constant)
                and isinstance(first.value.value, str)
            ):
                doc = first.value.value  # its line: the docstring's first + the newlines before the match
                found += [
                    (first.lineno + doc.count("\n", 0, m.start()), m.group()) for m in ISSUE.finditer(doc)
                ]
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT:
            found += [(token.start[0], m.group()) for m in ISSUE.finditer(token.string)]
    return found


def test_issue_citations_are_found_in_docstrings_and_comments_only() -> None:
    sample = (
        '"""Module (issue 7)."""\n\ndef f():\n    """Why (issue 12)."""\n    return "issue 3"  # issue 4\n'
    )
    assert sorted(issue_citations(sample)) == [(1, "issue 7"), (4, "issue 12"), (5, "issue 4")]


def test_no_docstring_or_comment_cites_an_issue_number() -> None:
    """Docstrings and comments under algorithms/, datasets/, fedcli/ and tracking/ explain the code in words and
    cite docs/ (docs/benchmarks.md for timings), never an issue number."""
    files = [p for p in python_files() if p.relative_to(ROOT).as_posix().startswith(NO_ISSUE_DIRS)]
    assert files, "no .py files found under " + ", ".join(NO_ISSUE_DIRS)
    bad = [
        f"{path.relative_to(ROOT)}:{line}: {text}"
        for path in files
        for line, text in issue_citations(path.read_text(encoding="utf-8"))
    ]
    assert not bad, "say what the issue decided, or cite the docs/ section that describes it:\n" + "\n".join(
        bad
    )


def test_decision_records_are_numbered_indexed_and_complete() -> None:
    """docs/decisions/NNNN-title.md: numbered from 0001 without gaps, each with its context, decision and
    consequences, each listed in docs/decisions/README.md."""
    records = sorted(p for p in (DOCS / "decisions").glob("*.md") if p.name != "README.md")
    numbers = [
        int(m.group(1)) if (m := re.match(r"(\d{4})-[a-z0-9-]+\.md$", p.name)) else -1 for p in records
    ]
    assert numbers == list(range(1, len(records) + 1)), [p.name for p in records]
    index = (DOCS / "decisions" / "README.md").read_text(encoding="utf-8")
    bad = [p.name for p in records if f"]({p.name})" not in index]
    for p in records:
        text = p.read_text(encoding="utf-8")
        bad += [
            f"{p.name}: no {part}"
            for part in ("**Context.**", "**Decision.**", "**Consequences.**")
            if part not in text
        ]
    assert not bad, "\n".join(bad)
