"""The docs cannot rot: README.md and docs/*.md checked against the code, conf/ and the reports.

- every `python -m X` names a module that can be imported;
- every Hydra group option a command uses (`model=moe`, `parallel=tp2`, `bench_preset=moe`, ...) is a file under
  conf/, every `converter=` a registered converter, every `compute=` a device preset, every link preset a link;
- every relative link names a file that exists, and a `#anchor` into a Markdown page a heading it has;
- every table of results equals what eval.doc_tables writes from the committed reports (no number copied by hand);
- every repository path a page names (`models/common/cache.py`, `conf/parallel/`) exists, every Python name
  (`models.common.cache.BatchSplit`) imports, every config key set as `a.b=` is a key of a conf/ file, and every
  default quoted for a conf/ key (`` `parallel.overlap`, default `none` ``) is that file's value;
- the docs say what is: no history words ("no longer", "as before", ...) outside code;
- the README stays a page a newcomer reads in minutes;
- no tracked file points outside the repository (an issue number, the planning files).
"""

import importlib
import importlib.util
import re
from pathlib import Path

import pytest
from omegaconf import OmegaConf

import models
from eval import doc_tables
from parallel.devices import DEVICES
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


# A machine's own directory (a checkout, a home) written into a committed report; /tmp is a config's scratch default.
MACHINE_PATH = re.compile(r"(?<![\w.])/(?:work|home|Users|root|mnt|scratch)/[\w.-]+")


def test_no_report_holds_a_machine_path():
    import subprocess

    files = subprocess.run(["git", "ls-files", "reports"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    found = [f"{name}: {MACHINE_PATH.search(text).group(0)}" for name in files if Path(name).suffix in {".json", ".md"}
             and MACHINE_PATH.search(text := (ROOT / name).read_text(errors="replace"))]  # fmt: skip
    assert not found, "committed reports that hold a machine's path:\n" + "\n".join(found)


# --- paths, names, config keys and defaults a page names -------------------------------------------------------

TOP = ("models", "parallel", "train", "eval", "conf", "tests", "reports", "docs")
# A repository path: under a top folder, ending in a file's extension or in "/" (a folder).
PATH = re.compile(rf"(?<![\w./<-])((?:{'|'.join(TOP)})/(?:[\w.-]+/)*(?:[\w-]+\.(?:py|md|yaml|json|png|jsonl|txt|toml)\b|))")
# W&B metric names (`train/aux/<name>`) look like folders of train/: a folder path under it need not exist.
METRIC_PREFIXES = ("train/",)
NAME = re.compile(r"`((?:models|parallel|train|eval)(?:\.\w+)+)")
KEY = re.compile(r"(?<![\w.+/-])([a-z_]+(?:\.\w+)+)=")
DEFAULT = re.compile(r"`([a-z_][\w.]*)`[^`]{0,30}?\(?\bdefault:? (?:`([^`]+)`|([\w.+-]+))")
DEFAULT_AFTER = re.compile(r"`([a-z_][\w.]*)(?:=|: )([^`]+)`,? \(?(?:the )?default\b")
HISTORY = re.compile(r"\b(?:no longer|as before|before:|\(before\b|previously|formerly|any ?more\b|has been (?:removed|"
                     r"replaced|renamed|moved)|now (?:has|takes|uses|is|are|does|gives|runs|holds)\b)", re.I)


def _flat(tree, prefix=""):
    out = {}
    if isinstance(tree, dict):
        for key, value in tree.items():
            out[f"{prefix}{key}"] = value
            out.update(_flat(value, f"{prefix}{key}."))
    return out


def conf_keys() -> dict[str, list]:
    """Every key of every conf/ file as a dotted path from the config's root (a group file's keys under its group,
    `parallel.overlap`; a `# @package _global_` file's at the root), with the values the files give it."""
    keys: dict[str, list] = {}
    for file in sorted((ROOT / "conf").rglob("*.yaml")):
        text = file.read_text()
        tree = OmegaConf.to_container(OmegaConf.create(text)) if text.strip() else {}
        if not isinstance(tree, dict):
            continue
        tree.pop("defaults", None)
        group = file.relative_to(ROOT / "conf").parts[:-1]
        if group and "@package _global_" not in text:
            for name in reversed(group):
                tree = {name: tree}
        for key, value in _flat(tree).items():
            keys.setdefault(key, []).append(value)
    return keys


CONF_KEYS = conf_keys()


def _resolves(dotted: str) -> bool:
    """Whether `dotted` is an importable module or a name defined in one (`models.common.cache.BatchSplit`)."""
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ModuleNotFoundError:
            continue
        for attr in parts[i:]:
            if not hasattr(obj, attr):
                return False
            obj = getattr(obj, attr)
        return True
    return False


def _prose(text: str) -> str:
    """The page without its code (fenced blocks and inline spans): what is said, not what is run or printed."""
    return re.sub(r"`[^`\n]*`", "", re.sub(r"```.*?```", "", text, flags=re.S))


def wrong_names(text: str) -> list[str]:
    """What a page's text names that is not there: paths, Python names, config keys, defaults (module docstring)."""
    wrong = []
    for path in PATH.findall(text):
        if not (ROOT / path).exists() and not (path.endswith("/") and path.startswith(METRIC_PREFIXES)):
            wrong.append(f"path {path}")
    for dotted in NAME.findall(text):
        if not _resolves(dotted) and dotted not in CONF_KEYS:
            wrong.append(f"name {dotted}")
    for key in KEY.findall(_code(text)):
        if key not in CONF_KEYS:
            wrong.append(f"config key {key}=")
    joined = re.sub(r"\s*\n\s*", " ", text)
    for match in [*DEFAULT.finditer(joined), *DEFAULT_AFTER.finditer(joined)]:
        key, value = match.group(1), match.group(2) or match.group(3)
        found = [k for k in CONF_KEYS if k == key or k.endswith(f".{key}")]
        values = [v for k in found for v in CONF_KEYS[k]]
        if not values or None in values or any(isinstance(v, (dict, list)) for v in values):
            continue  # not a conf/ key (a config class field), or null: a default computed in code, said in words
        if value.lower() not in {str(v).lower() for v in values}:
            wrong.append(f"default {key}: the page says {value!r}, conf/ has {sorted({str(v) for v in values})}")
    return wrong


@pytest.mark.parametrize("page", PAGES, ids=_page_id)
def test_what_a_page_names_exists(page):
    wrong = wrong_names(page.read_text())
    assert not wrong, f"{_page_id(page)} names what is not in the repository or conf/: {wrong}"


def test_wrong_names_are_found():
    # The check can fail: each kind of claim, once true and once false.
    good = ("`models/common/cache.py` holds `models.common.cache.BatchSplit`; `parallel.overlap=token_split` "
            "(`parallel.overlap`, default `none`)")
    assert wrong_names(good) == []
    bad = ("`models/common/kache.py` holds `models.common.cache.BatchSplat`; `parallel.overlay=token_split` "
           "(`parallel.overlap`, default `token_split`)")
    assert [w.split()[0] for w in wrong_names(bad)] == ["path", "name", "name", "config", "default"]


@pytest.mark.parametrize("page", PAGES, ids=_page_id)
def test_a_page_says_what_is(page):
    found = [line.strip() for line in _prose(page.read_text()).splitlines() if HISTORY.search(line)]
    assert not found, f"{_page_id(page)} narrates history (git log holds it; say what is): {found}"
