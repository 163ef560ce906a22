"""The results' figures come from their CSVs: each block of README.md's Results and of every page
of docs/results/ is what ``python -m lowcomm_bench figures`` renders from the committed CSVs it
links, and the prose around the blocks quotes no figure of its own. The docs stay readable and
their links resolve: no page over 400 lines, nothing under docs/ named after an issue, every
relative link of README.md and docs/ (and lab/notes/) to a file that exists, every data file that
moved listed in docs/bench/moved.csv and cited by no page under its old path."""

import csv
import re
import subprocess
from pathlib import Path

import pytest

from lowcomm_bench import committed, figures

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
RESULT_PAGES = sorted((ROOT / "docs" / "results").glob("*.md"))


def _tracked(*patterns: str) -> list[Path]:
    out = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard", *patterns], cwd=ROOT,
                         capture_output=True, text=True, check=True).stdout.split()
    return [ROOT / p for p in out if (ROOT / p).exists()]


def _pages() -> list[Path]:
    """README.md and every Markdown page under docs/ and lab/notes/."""
    return [ROOT / "README.md", *_tracked("docs/*.md", "docs/**/*.md", "lab/notes/*.md", "lab/notes/**/*.md")]


def test_every_results_block_is_its_csvs_rendering():
    assert set(figures.blocks(README)) == {"recipes", "compare", "replica_bytes"}
    assert len(RESULT_PAGES) >= 8
    for page in [ROOT / "README.md", *RESULT_PAGES]:
        found = figures.blocks(page.read_text())
        assert set(found) <= set(figures.RENDER), page
        for name, body in found.items():
            assert body == figures.render(name, page), \
                f"{page.name}: block {name!r} drifted: python -m lowcomm_bench figures --write"
    # every results page but the index shows a figure, and every renderer is on a page
    assert all(figures.blocks(p.read_text()) for p in RESULT_PAGES if p.name != "README.md")
    shown = {name for p in [ROOT / "README.md", *RESULT_PAGES] for name in figures.blocks(p.read_text())}
    assert shown == set(figures.RENDER)


def test_results_quote_no_figure_outside_the_rendered_blocks():
    for page in [ROOT / "README.md", *RESULT_PAGES]:
        assert figures.prose_figures(page) == [], page.name


def test_a_drifted_or_loose_figure_fails_the_check():
    """The check itself: a figure changed inside a block, or one written in the prose beside it,
    fails; the same figure inside a command or a link target does not."""
    page = ROOT / "docs" / "results" / "replicas.md"
    text = page.read_text()
    body = figures.blocks(text)["replica_bytes"]
    drifted = text.replace(body, body.replace("3.50x", "3.40x", 1))
    assert drifted != text and figures.stale(page, drifted) == ["replica_bytes"] and figures.stale(page) == []
    claim = "The claim."
    assert figures.prose_figures(page, text.replace(claim, claim + " It sends 97.6 kB at 8 replicas, 1.75x less.")) \
        == ["97.6", "1.75"]
    assert figures.prose_figures(page, text.replace(claim, claim + " Run `bench --target 1.9333`.")) == []
    readme = ROOT / "README.md"
    assert figures.prose_figures(readme, README.replace("## Results\n", "## Results\n\nIt needs 125 steps.\n")) \
        == ["125 steps"]


def test_the_first_command_trains_the_recipe_and_its_baseline():
    first = next(line for line in README.splitlines() if "ds-lowcomm compare" in line)
    methods = first.split("--methods ", 1)[1].split()[0].split(",")
    assert methods[:2] == ["muon", "muloco_sign"]
    rows = list(csv.DictReader(open(committed.BENCH / committed.COMPARE_RESULTS)))
    assert [r["method"] for r in rows] == methods  # the committed results are that command's


def test_the_model_size_csv_has_dense_and_the_recipe_per_size():
    rows = list(csv.DictReader(open(committed.BENCH / committed.SCALE)))
    assert {"entry", "parameters", "device", "seed", "H", "steps_to_target", "bytes_sent_per_worker"} <= set(rows[0])
    sizes = {int(r["parameters"]) for r in rows}
    reference = figures.reference_parameters()
    assert reference in sizes and any(10 * reference <= s <= 30 * reference for s in sizes)
    for size in sizes:  # dense Muon and the recipe at 2+ values of H on 3 measuring seeds, at every CPU size
        at = [r for r in rows if int(r["parameters"]) == size and r["device"] == "cpu" and r["role"] == "seed"
              and r["form"] == "muon"]
        assert {r["seed"] for r in at if r["entry"] == "muon"} == {"1", "2", "3"}, size
        for h in {r["H"] for r in at if r["entry"] == "muloco_sign"}:
            assert {r["seed"] for r in at if r["entry"] == "muloco_sign" and r["H"] == h} == {"1", "2", "3"}, (size, h)
        assert len({r["H"] for r in at if r["entry"] == "muloco_sign"}) >= 2, size


def test_every_committed_file_code_reads_exists():
    names = {k: v for k, v in vars(committed).items() if k.isupper() and isinstance(v, str)}
    assert len(names) > 30
    for name, rel in names.items():
        assert (committed.BENCH / rel).is_file(), (name, rel)


def test_docs_pages_are_short():
    """No page under docs/ over 400 lines (the data files are not pages)."""
    long = {p.relative_to(ROOT).as_posix(): n for p in _tracked("docs/*.md", "docs/**/*.md")
            if (n := len(p.read_text().splitlines())) > 400}
    assert long == {}


ISSUE = re.compile(r"\bissues?[\s_-]*#?\d+|#\d+\b", re.I)


def test_nothing_under_docs_is_named_after_an_issue():
    """Files and folders name what they hold; headings say what a section shows."""
    paths = [p.relative_to(ROOT).as_posix() for p in _tracked("docs")]
    assert [p for p in paths if ISSUE.search(p)] == []
    headings = [f"{p.name}: {line}" for p in _tracked("docs/*.md", "docs/**/*.md")
                for line in p.read_text().splitlines() if line.startswith("#") and ISSUE.search(line)]
    assert headings == []


LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def _slug(heading: str) -> str:
    """GitHub's anchor of a heading."""
    text = re.sub(r"[`*]", "", heading.strip().lstrip("#").strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def test_every_relative_link_resolves():
    """Every relative link of README.md, docs/ and lab/notes/ to a file that exists, and an anchor
    (``page.md#heading``) to a heading of that page."""
    broken = []
    for page in _pages():
        text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
        for target in LINK.findall(text):
            if re.match(r"[a-z]+:", target) or target.startswith("#"):
                continue
            path, _, anchor = target.partition("#")
            file = (page.parent / path).resolve()
            if not file.exists():
                broken.append(f"{page.relative_to(ROOT)}: {target}")
            elif anchor and file.suffix == ".md":
                slugs = {_slug(line) for line in file.read_text().splitlines() if line.startswith("#")}
                if anchor not in slugs:
                    broken.append(f"{page.relative_to(ROOT)}: {target} (no such heading)")
    assert broken == []


def test_moved_files_are_listed_and_cited_by_their_new_paths():
    """docs/bench/moved.csv: each old path gone, each new path there (empty: deleted), and no page
    citing an old path."""
    rows = list(csv.DictReader(open(ROOT / "docs" / "bench" / "moved.csv")))
    assert rows and {tuple(r) for r in rows} == {("old_path", "new_path")}
    for r in rows:
        assert not (ROOT / r["old_path"]).exists(), r
        assert r["new_path"] == "" or (ROOT / r["new_path"]).is_file(), r
    cited = []
    for page in _pages():
        text = page.read_text()
        cited += [f"{page.relative_to(ROOT)}: {r['old_path']}" for r in rows
                  if r["old_path"] in text or r["old_path"].removeprefix("docs/") in text]
    assert cited == []


def test_the_lab_notebook_pages_are_gone():
    """docs/benchmarks.md and docs/results.md are gone, and README.md and docs/ cite neither."""
    gone = ("benchmarks.md", "results.md")
    assert not any((ROOT / "docs" / name).exists() for name in gone)
    citing = [p.relative_to(ROOT).as_posix() for p in [ROOT / "README.md", *_tracked("docs/*.md")]
              if any(name in p.read_text() for name in gone)]
    assert citing == []
