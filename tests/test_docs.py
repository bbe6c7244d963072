"""The docs cannot rot: README.md and docs/*.md checked against the code, conf/ and the reports.

- every `python -m X` names a module that can be imported;
- every Hydra group option a command uses (`model=moe`, `parallel=tp2`, `bench_preset=moe`, ...) is a file under
  conf/, every `converter=` a registered converter, every `compute=` a device preset, every link preset a link;
- every relative link names a file that exists, and a `#anchor` into a Markdown page a heading it has;
- every table of results equals what eval.doc_tables writes from the committed reports (no number copied by hand);
- the README stays a page a newcomer reads in minutes;
- no tracked file points outside the repository (an issue number, the planning files).
"""

import importlib.util
import re
from pathlib import Path

import pytest

import models
from eval import doc_tables
from eval.simulator.device import DEVICES
from parallel.link import LINK_PRESETS

ROOT = Path(__file__).resolve().parents[1]
PAGES = doc_tables.pages()
GROUPS = {p.name for p in (ROOT / "conf").iterdir() if p.is_dir()}
MODULE = re.compile(r"python -m ([A-Za-z_][\w.]*)")
OVERRIDE = re.compile(r"(?<![\w.+/-])([a-z_]+)=([\w.@-]+)")
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def _page_id(page: Path) -> str:
    return page.relative_to(ROOT).as_posix()


def _code(text: str) -> str:
    """The page's code: fenced blocks, indented blocks and inline spans (where commands are written)."""
    fenced = re.findall(r"```.*?\n(.*?)```", text, re.S)
    indented = re.findall(r"^(?: {4}|\t)(.+)$", text, re.M)
    inline = re.findall(r"`([^`\n]+)`", text)
    return "\n".join(fenced + indented + inline)


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation but - and _ dropped, spaces to -."""
    text = re.sub(r"[`*]", "", heading.strip().lower())
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", text)
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    prose = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)  # a `# comment` in a code block is no heading
    return {slug(h) for h in re.findall(r"^#{1,6} (.+)$", prose, re.M)}


def test_pages_exist():
    names = {_page_id(p) for p in PAGES}
    assert "README.md" in names
    for topic in ["architectures", "parallelism", "training", "checkpoints", "speed", "quality", "adding-an-architecture"]:
        assert f"docs/{topic}.md" in names, f"docs/{topic}.md is missing"


@pytest.mark.parametrize("page", PAGES, ids=_page_id)
def test_modules_import(page):
    modules = set(MODULE.findall(page.read_text()))
    missing = [m for m in sorted(modules) if importlib.util.find_spec(m) is None]
    assert not missing, f"{_page_id(page)} runs modules that do not exist: {missing}"


@pytest.mark.parametrize("page", PAGES, ids=_page_id)
def test_hydra_options_exist(page):
    wrong = []
    for key, value in OVERRIDE.findall(_code(page.read_text())):
        if "..." in value:  # a placeholder (`converter=...`), not an option
            continue
        if key in GROUPS and not (ROOT / "conf" / key / f"{value}.yaml").exists():
            wrong.append(f"{key}={value}")
        if key == "converter" and value not in models.CONVERTERS:
            wrong.append(f"converter={value}")
        if key == "compute" and value not in DEVICES:
            wrong.append(f"compute={value}")
    for links in re.findall(r"simulated\.links=\[([^\]]*)\]", page.read_text()):
        wrong += [f"link {name}" for name in links.split(",") if name.strip() and name.strip() not in LINK_PRESETS]
    assert not wrong, f"{_page_id(page)} uses options that do not exist: {wrong}"



@pytest.mark.parametrize("page", PAGES, ids=_page_id)
def test_links_exist(page):
    broken = []
    for target in LINK.findall(page.read_text()):
        if re.match(r"[a-z]+:", target):  # http(s):, mailto:
            continue
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        if not file.exists():
            broken.append(target)
        elif anchor and file.suffix == ".md" and anchor not in anchors(file):
            broken.append(f"{target} (no such heading)")
    assert not broken, f"{_page_id(page)} links to what does not exist: {broken}"


def test_tables_equal_the_reports():
    assert not doc_tables.stale(), (
        f"these pages quote report numbers that differ from the reports: {doc_tables.stale()}; "
        "run `python -m eval.doc_tables` to rewrite their tables")


def test_every_table_block_is_known_and_used():
    used = {m["name"] for p in PAGES for m in doc_tables.BLOCK.finditer(p.read_text())}
    assert used == set(doc_tables.TABLES), f"tables written but never shown, or shown but unknown: {used ^ set(doc_tables.TABLES)}"


def test_a_stale_table_is_found(tmp_path, monkeypatch):
    # The check can fail: a page whose table holds a hand-edited number is reported stale.
    page = tmp_path / "README.md"
    fresh = doc_tables.render("<!-- table:costmodel -->\n<!-- end table:costmodel -->\n", "")
    eff = f"{doc_tables._load(doc_tables.COSTMODEL)['constants']['eff_flops']:.3f}"
    assert eff in fresh
    page.write_text(fresh.replace(eff, f"{float(eff) + 0.011:.3f}"))
    monkeypatch.setattr(doc_tables, "ROOT", tmp_path)
    monkeypatch.setattr(doc_tables, "PAGES", ["README.md"])
    monkeypatch.setattr(doc_tables, "_load", lambda path: __import__("json").loads((ROOT / path).read_text()))
    assert doc_tables.stale() == ["README.md"]


def test_readme_is_short():
    lines = (ROOT / "README.md").read_text().count("\n")
    assert lines <= 210, f"README.md has {lines} lines; move detail to docs/ (a newcomer reads ~200)"


def test_readme_gives_the_two_commands():
    text = (ROOT / "README.md").read_text()
    head = "\n".join(text.splitlines()[:40])
    assert "make demo" in head and "make test" in head


# A pointer out of the repository (the project's planning files, its issue tracker) that a reader of a clone cannot
# follow. "issue" as a verb ("issue 2L all-reduces") is not an issue number.
OUTSIDE = re.compile(r"\.\./shared|\bDESIGN\.md|\bSTYLE\.md|\bspecs/\w+\.md|(?<![\w-])[Ii]ssue #?\d+\b")


def test_no_file_points_outside_the_repository():
    import subprocess

    files = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    found = []
    for name in files:
        path = ROOT / name
        if name == "tests/test_docs.py" or path.suffix not in {".py", ".md", ".yaml", ".json", ".toml", ".txt", ""}:
            continue
        if not path.is_file():
            continue
        for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            if OUTSIDE.search(line):
                found.append(f"{name}:{number}: {OUTSIDE.search(line).group(0)}")
    assert not found, "files that point outside the repository:\n" + "\n".join(found)
