"""The documentation points only at what the repository has, and says what the code does.

* Every relative markdown link in README.md, docs/, benchmarks/ and examples/ resolves to a
  file or folder of the repository (and a `#fragment` to a heading of the target).
* Every repository path a reader's document names in backquotes (`benchmarks/swap_in.py`,
  `docs/pd.md`, a results file) exists.
* No file of the repository cites the design document or research notes kept outside it.
* README.md's feature table says, per backend, what the backends' feature tables say.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from hisparse.backends.cpu import CPU_FEATURES
from hisparse.backends.cuda import CUDA_FEATURES
from hisparse.backends.features import Feature, FeatureTable, Status
from hisparse.backends.rocm import ROCM_FEATURES
from hisparse.backends.xpu import XPU_FEATURES

ROOT = Path(__file__).resolve().parent.parent
DOCUMENTS = sorted({ROOT / "README.md", *(ROOT / "docs").glob("*.md"),
                    *(ROOT / "benchmarks").glob("*.md"), *(ROOT / "examples").rglob("*.md")})
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")
# A path in backquotes that starts at a top-level folder of the repository.
CODE_PATH = re.compile(r"`((?:benchmarks|docs|scripts|tests|src|configs|examples|\.ci)/[^`\s]*)`")
# Words that mark a path as a pattern for the reader to fill in, not a file.
PLACEHOLDERS = ("DIR", "FILE", "PATH", "NAME", "ROUND", "<", "...")
NOT_HERE = ("DESIGN" + ".md", "research" + "/")  # spelled apart: this file names them too
# Tests that check some output no longer names them (and say what it named before): they
# mention the names without citing them.
ABSENCE_CHECKS = {"tests/test_cli_inputs.py"}


def link_targets(path: Path) -> list[str]:
    text = re.sub(r"```.*?```", "", path.read_text(encoding="utf-8"), flags=re.S)
    return [target for target in LINK.findall(text)
            if not re.match(r"^[a-z][a-z0-9+.-]*:", target)]  # http:, mailto: ...


def heading_slugs(path: Path) -> set[str]:
    """GitHub's anchors for the headings of a markdown file."""
    slugs = set()
    for line in path.read_text(encoding="utf-8").splitlines():
        if match := re.match(r"^#{1,6}\s+(.*)$", line):
            words = re.sub(r"[^\w\- ]", "", match[1].strip().lower())
            slugs.add(words.replace(" ", "-"))
    return slugs


@pytest.mark.parametrize("path", DOCUMENTS, ids=[str(p.relative_to(ROOT)) for p in DOCUMENTS])
def test_every_relative_link_resolves(path: Path) -> None:
    broken = []
    for target in link_targets(path):
        file_part, _, fragment = target.partition("#")
        resolved = (path.parent / file_part).resolve() if file_part else path
        if not resolved.exists():
            broken.append(f"{target} (nothing at {resolved})")
        elif fragment and resolved.suffix == ".md" and fragment not in heading_slugs(resolved):
            broken.append(f"{target} (no heading #{fragment} in {resolved.name})")
    assert not broken, f"{path.relative_to(ROOT)} links to what is not there: {broken}"


# benchmarks/NOTES.md is the lab notebook: it names files as they were when each entry was
# written, and says how to find the ones since removed in git history.
READER_DOCUMENTS = [path for path in DOCUMENTS if path.name != "NOTES.md"]


@pytest.mark.parametrize("path", READER_DOCUMENTS,
                         ids=[str(p.relative_to(ROOT)) for p in READER_DOCUMENTS])
def test_every_path_a_document_names_exists(path: Path) -> None:
    text = path.read_text(encoding="utf-8")
    missing = []
    for named in CODE_PATH.findall(text):
        named = named.rstrip(".,:;)")
        if any(word in named for word in PLACEHOLDERS) or "::" in named:
            continue
        if not list(ROOT.glob(named)):
            missing.append(named)
    if path.name == "README.md" and path.parent.name == "benchmarks":
        # Its results table names files of benchmarks/results/ by their bare names.
        for named in re.findall(r"`([\w*.-]+\.(?:json|png|txt))`", text):
            if not list((ROOT / "benchmarks" / "results").glob(named)):
                missing.append(f"results/{named}")
    assert not missing, f"{path.relative_to(ROOT)} names paths the repository lacks: {missing}"


def repository_files() -> list[Path]:
    listed = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"],
                            cwd=ROOT, capture_output=True, text=True, check=True).stdout
    return [ROOT / name for name in listed.splitlines() if (ROOT / name).is_file()]


def test_no_file_cites_what_lives_outside_the_repository() -> None:
    citing = []
    for path in repository_files():
        if str(path.relative_to(ROOT)) in ABSENCE_CHECKS:
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue  # binary: a plot, a wheel
        for number, line in enumerate(text.splitlines(), 1):
            if any(name in line for name in NOT_HERE):
                citing.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()[:80]}")
    assert not citing, "state the fact inline or cite a file of the repository:\n" + "\n".join(
        citing)


BACKEND_TABLES: dict[str, FeatureTable] = {"cuda": CUDA_FEATURES, "rocm": ROCM_FEATURES,
                                           "xpu": XPU_FEATURES, "cpu": CPU_FEATURES}
WORDS = {"yes": Status.SUPPORTED, "off": Status.DISABLED, "no": Status.UNSUPPORTED}


def readme_feature_table() -> tuple[list[str], dict[Feature, list[str]]]:
    """The README's table: its backend columns and, per feature, the cell of each."""
    lines = (ROOT / "README.md").read_text(encoding="utf-8").splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("| feature |"))
    columns = [cell.strip() for cell in lines[start].strip("|").split("|")][1:]
    rows: dict[Feature, list[str]] = {}
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        cells = [cell.strip() for cell in line.strip("|").split("|")]
        (name,) = re.findall(r"`([a-z_]+)`", cells[0])[:1]
        assert Feature(name) not in rows, f"README names {name} twice"
        rows[Feature(name)] = cells[1:]
    return columns, rows


def test_the_readme_feature_table_says_what_the_backends_do() -> None:
    columns, rows = readme_feature_table()
    assert columns == list(BACKEND_TABLES)
    assert set(rows) == set(Feature), f"README lacks {set(Feature) - set(rows)}"
    wrong = []
    for feature, cells in rows.items():
        for backend, cell in zip(columns, cells, strict=True):
            said = WORDS.get(re.split(r"[^a-z]", cell, maxsplit=1)[0])
            actual = BACKEND_TABLES[backend][feature].status
            if said is not actual:
                wrong.append(f"{feature} on {backend}: README '{cell}', the table {actual}")
    assert not wrong, wrong
