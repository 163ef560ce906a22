"""README.md's figures come from their CSVs (issue 55): each results block is what
``python -m lowcomm_bench figures`` renders from the CSVs it links, and the rest of the Results
section quotes no figure of its own. docs/bench/scale.csv holds what the issue asks of it."""

import csv
import re
from pathlib import Path

from lowcomm_bench import figures

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
# a figure: a decimal, or a number with a unit or a ratio's x
FIGURE = re.compile(r"\d+\.\d+|\b\d+(?:\s*(?:x\b|%|MB|kB|GB|Mbit|Gbit|steps\b|s\b|ms\b))")


def test_every_results_block_is_its_csvs_rendering():
    found = figures.blocks(README)
    assert set(found) == set(figures.RENDER)
    for name, body in found.items():
        assert body == figures.RENDER[name](), f"README block {name!r} drifted: python -m lowcomm_bench figures --write"


def test_results_quote_no_figure_outside_the_rendered_blocks():
    results = README[README.index("## Results\n"):README.index("\n## ", README.index("## Results\n") + 5)]
    prose = figures.BLOCK.sub("", results)
    prose = re.sub(r"```.*?```", "", prose, flags=re.S)  # commands
    prose = re.sub(r"\]\([^)]*\)", "]", prose)  # link targets
    assert FIGURE.findall(prose) == []


def test_the_first_command_trains_the_recipe_and_its_baseline():
    first = next(line for line in README.splitlines() if "ds-lowcomm compare" in line)
    methods = first.split("--methods ", 1)[1].split()[0].split(",")
    assert methods[:2] == ["muon", "muloco_sign"]
    rows = list(csv.DictReader(open(ROOT / "docs" / "bench" / "compare" / "results.csv")))
    assert [r["method"] for r in rows] == methods  # the committed results are that command's


def test_scale_csv_has_what_the_issue_asks():
    rows = list(csv.DictReader(open(ROOT / "docs" / "bench" / "scale.csv")))
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
