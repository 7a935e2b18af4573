"""The README stays a five-minute read, the docs' links lead somewhere, and the code's references stay inside the
repository (a reader can follow each one)."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))
MAX_README_WORDS = 1500
# what `git grep -nE "DESIGN §|[Ii]ssue [0-9]+"` looks for, plurals included
OUTSIDE_REF = re.compile(r"DESIGN ?§|[Ii]ssues? #?[0-9]+")
CODE_GLOBS = ("dflash/**/*.py", "experiments/**/*.py", "sweeps/**/*.py", "conf/**/*.yaml", "benchmarks/**/*.sh",
              "benchmarks/**/*.py")
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[`*_]", "", heading.strip().lower())
    return re.sub(r"\s", "-", re.sub(r"[^\w\s-]", "", text))


def _headings(path: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)
    return {m.group(1).strip() for m in re.finditer(r"^#{1,6}\s+(.+)$", text, re.M)}


def test_readme_is_a_five_minute_read():
    words = len(README.read_text().split())
    assert words <= MAX_README_WORDS, f"README.md has {words} words (at most {MAX_README_WORDS}): move detail to docs/"


@pytest.mark.parametrize("md", [README, *DOCS], ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_points_to_a_file(md):
    text = re.sub(r"```.*?```", "", md.read_text(), flags=re.S)
    bad = []
    for target in LINK.findall(text):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
            continue
        file_part, _, anchor = target.partition("#")
        dest = (md.parent / file_part).resolve() if file_part else md
        if not dest.exists():
            bad.append(f"{target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in {_slug(h) for h in _headings(dest)}:
            bad.append(f"{target}: no heading #{anchor} in {dest.relative_to(ROOT)}")
    assert not bad, f"{md.relative_to(ROOT)}: {bad}"


def _code_files():
    for pattern in CODE_GLOBS:
        yield from sorted(ROOT.glob(pattern))


def test_code_references_stay_inside_the_repository():
    hits = [f"{p.relative_to(ROOT)}:{i}: {line.strip()}" for p in _code_files()
            for i, line in enumerate(p.read_text(errors="replace").splitlines(), 1) if OUTSIDE_REF.search(line)]
    assert not hits, "references a reader cannot follow (name a file in the repo, or say the fact):\n" + "\n".join(hits)


def test_docs_named_in_code_exist_with_the_sections_named():
    design = {h for h in _headings(ROOT / "docs" / "DESIGN.md")}
    bad = []
    for p in _code_files():
        text = p.read_text(errors="replace")
        for name in re.findall(r"\bdocs/([\w.-]+\.md)", text):
            if not (ROOT / "docs" / name).is_file():
                bad.append(f"{p.relative_to(ROOT)}: docs/{name} does not exist")
        for quoted in re.findall(r'docs/DESIGN\.md, ((?:"[^"\n]+"(?:, |; )?)+)', text):
            bad += [f"{p.relative_to(ROOT)}: docs/DESIGN.md has no section {s!r}"
                    for s in re.findall(r'"([^"]+)"', quoted) if s not in design]
    assert not bad, "\n".join(bad)
    assert len(design) >= 8


def test_readme_config_table_lists_every_option():
    from experiments.config import GROUPS, group_options
    rows = {m.group(1): m.group(2) for m in re.finditer(r"^\| `(\w+)` \| (.+?) \|", README.read_text(), re.M)}
    missing = {g: [o for o in group_options(g) if f"`{o}`" not in rows.get(g, "")] for g in GROUPS}
    assert not {g: m for g, m in missing.items() if m}, f"README's config groups table misses {missing}"


def test_quick_start_is_what_ci_runs():
    text = README.read_text()
    assert "pip install -e . && python -m experiments.run\n" in text
    assert 'pip install -e ".[dev]" && python -m pytest -q\n' in text
    ci = (ROOT / ".ci" / "run").read_text()
    assert 'pip install -q -e ".[dev]"' in ci and "python -m pytest -q" in ci


@pytest.mark.parametrize("md", [README, *DOCS], ids=lambda p: str(p.relative_to(ROOT)))
def test_paths_the_docs_name_exist(md):
    """A path in backticks (`dflash/training/buffer.py`, `conf/campaign/`) is a file or folder of the repo."""
    top = "dflash|experiments|sweeps|conf|tests|benchmarks|notebooks|docs"
    named = re.findall(rf"`((?:{top})/[\w/.\-]*)`", md.read_text())
    missing = sorted({p for p in named if not (ROOT / p.rstrip("/")).exists()})
    assert not missing, f"{md.relative_to(ROOT)} names paths that do not exist: {missing}"
