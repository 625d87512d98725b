"""The README and docs/ stay true to the tree: the README fits a newcomer's sitting, every relative link
resolves inside the repository (file and #anchor), every module has its line in docs/architecture.md's map,
no heading is named for an issue, and nothing tracked points outside the repository but through the trace
variable. Host only."""

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
MAX_README_LINES = 200
OUTSIDE = "../" + "shared"  # the folder beside the repository (spelt in two parts, so this file does not name it)
DOCS = [ROOT / "README.md", ROOT / "CHANGELOG.md", *sorted((ROOT / "docs").glob("*.md"))]


def _without_code_blocks(text: str) -> str:
    return re.sub(r"```.*?```", "", text, flags=re.S)


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: link text kept, lower case, punctuation dropped, spaces to dashes."""
    heading = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading).strip().lower()
    return "".join(c for c in heading if c.isalnum() or c in " -_").replace(" ", "-")


def anchors(path: Path) -> set[str]:
    found, seen = set(), {}
    for m in re.finditer(r"^#{1,6}\s+(.*)$", _without_code_blocks(path.read_text()), flags=re.M):
        s = slug(m.group(1))
        found.add(s if s not in seen else f"{s}-{seen[s]}")
        seen[s] = seen.get(s, 0) + 1
    return found


def broken_links(path: Path) -> list[str]:
    bad = []
    for m in re.finditer(r"\]\(([^)\s]+)\)", _without_code_blocks(path.read_text())):
        target = m.group(1)
        if re.match(r"[a-z]+://|mailto:", target):
            continue
        file, _, fragment = target.partition("#")
        dest = (path.parent / file).resolve() if file else path
        if not dest.exists() or not dest.is_relative_to(ROOT):
            bad.append(f"{target}: no such file in the repository")
        elif fragment and dest.suffix == ".md" and fragment not in anchors(dest):
            bad.append(f"{target}: no such heading")
    return bad


def test_the_readme_fits_a_sitting():
    lines = len((ROOT / "README.md").read_text().splitlines())
    assert lines <= MAX_README_LINES, f"README.md has {lines} lines; the rest belongs in docs/"


@pytest.mark.parametrize("path", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(path):
    assert not broken_links(path), broken_links(path)


def test_the_link_check_finds_a_missing_file_and_a_missing_heading(tmp_path):
    """Control: a page with a bad file link and a bad anchor gives two errors."""
    page = ROOT / "docs" / "testing.md"
    probe = page.parent / f".probe-{tmp_path.name}.md"
    probe.write_text("# Title\n\n[a](no-such-file.md) [b](#no-such-heading) [c](#title) [d](testing.md)\n")
    try:
        assert len(broken_links(probe)) == 2
    finally:
        probe.unlink()


def test_every_module_has_a_line_in_the_architecture_map():
    text = (ROOT / "docs" / "architecture.md").read_text()
    modules = [p for package in ("jaxinfer", "kernels_cpu", "kernels_pallas") for p in (ROOT / package).rglob("*.py")
               if p.name != "__init__.py"]
    missing = [str(p.relative_to(ROOT)) for p in modules if f"`{p.name}`" not in text and f"`{p.relative_to(ROOT)}`" not in text]
    assert not missing, f"docs/architecture.md's module map lacks {missing}"


def test_no_heading_is_named_for_an_issue():
    headings = [(p.name, h) for p in DOCS for h in re.findall(r"^#{1,6}\s+(.*)$", p.read_text(), flags=re.M)]
    assert not [h for h in headings if re.search(r"\bissue\b", h[1], re.I)]


def test_nothing_tracked_points_outside_the_repository_but_through_the_trace_variable():
    """The real traces live beside the repository; code, docs and notebooks reach them only through
    $JAXINFER_TRACE_DIR (the Makefile gives it a default)."""
    tracked = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    offenders = [name for name in tracked if name != "Makefile" and (ROOT / name).is_file()
                 and name.endswith((".py", ".md", ".ipynb", ".sh", ".toml", ".cfg", ".txt"))
                 and OUTSIDE in (ROOT / name).read_text(errors="replace")]
    assert not offenders, offenders
