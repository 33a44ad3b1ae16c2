"""The docs read as a book: a short front page, chapters in docs/, and every link inside the repository landing."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from helpers import PROJECT_ROOT

README = PROJECT_ROOT / "README.md"
BENCHMARKS = PROJECT_ROOT / "benchmarks" / "README.md"
DOCS = sorted([README, BENCHMARKS, *(PROJECT_ROOT / "docs").glob("*.md")])
PACKAGE = PROJECT_ROOT / "src" / "gptlab"
LAYERS = sorted(p.name for p in PACKAGE.iterdir() if (p / "__init__.py").is_file())

FENCE = re.compile(r"^```.*?^```", re.M | re.S)
LINK = re.compile(r"\]\(([^)\s]+)\)")
HEADING = re.compile(r"^#{1,6} +(.+?) *$", re.M)


def prose(path: Path) -> str:
    """The Markdown without its fenced code blocks, where a `](...)` is code, not a link."""
    return FENCE.sub("", path.read_text(encoding="utf-8"))


def anchor(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces as hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")


def broken_links(path: Path, root: Path = PROJECT_ROOT) -> list[str]:
    """Each relative link of `path` whose file, or heading within it, does not exist under `root`."""
    broken = []
    for target in LINK.findall(prose(path)):
        if re.match(r"[a-z]+:", target):  # https:, mailto: ...: outside the repository
            continue
        name, _, fragment = target.partition("#")
        linked = (path.parent / name).resolve() if name else path
        if root.resolve() not in linked.parents:
            broken.append(f"{target}: outside the repository")
        elif not linked.is_file():
            broken.append(f"{target}: no such file")
        elif fragment and fragment not in {anchor(h) for h in HEADING.findall(prose(linked))}:
            broken.append(f"{target}: no such heading")
    return broken


@pytest.mark.parametrize("path", DOCS, ids=[p.relative_to(PROJECT_ROOT).as_posix() for p in DOCS])
def test_every_relative_link_lands_on_a_file_of_the_repository(path: Path) -> None:
    assert not broken_links(path)


def test_the_link_check_sees_a_broken_link(tmp_path: Path) -> None:
    root = tmp_path / "repo"
    (root / "docs").mkdir(parents=True)
    (root / "there.md").write_text("# A heading\n", encoding="utf-8")
    (tmp_path / "elsewhere.md").write_text("# Elsewhere\n", encoding="utf-8")
    page = root / "docs" / "page.md"
    page.write_text(
        "[ok](../there.md) [ok](../there.md#a-heading) [web](https://example.com) [up](../../elsewhere.md)\n"
        "[gone](missing.md) [lost](../there.md#no-heading)\n```bash\n[code](not-a-link)\n```\n",
        encoding="utf-8",
    )
    assert broken_links(page, root) == [
        "../../elsewhere.md: outside the repository",
        "missing.md: no such file",
        "../there.md#no-heading: no such heading",
    ]


def test_the_front_page_and_the_benchmarks_stay_short() -> None:
    assert len(README.read_text(encoding="utf-8").splitlines()) <= 250
    assert len(BENCHMARKS.read_text(encoding="utf-8").splitlines()) <= 340  # + the files corpus's figures


def test_the_front_page_links_every_chapter() -> None:
    linked = set(LINK.findall(prose(README)))
    chapters = {p.relative_to(PROJECT_ROOT).as_posix() for p in (PROJECT_ROOT / "docs").glob("*.md")}
    assert chapters and chapters <= linked


@pytest.mark.parametrize("layer", LAYERS)
def test_the_architecture_section_gives_each_layer_the_job_its_init_states(layer: str) -> None:
    init = PACKAGE / layer / "__init__.py"
    docstring = ast.get_docstring(ast.parse(init.read_text(encoding="utf-8"))) or ""
    job = docstring.removeprefix(f"The {layer} layer: ").rstrip(".")
    front_page = README.read_text(encoding="utf-8").splitlines()
    (line,) = [line for line in front_page if line.startswith(f"  {layer}/")]
    assert job.lower() in line.lower(), (layer, job)


OWN_DATA = PROJECT_ROOT / "docs" / "own-data.md"


@pytest.mark.parametrize(
    "block",
    re.findall(r"```yaml\n(.*?)```", OWN_DATA.read_text(encoding="utf-8"), re.S),
    ids=lambda b: b[:30],
)
def test_each_params_block_of_the_own_data_page_loads_over_params_yaml(block: str, tmp_path: Path) -> None:
    """The page's params are real keys with values of the right types, as a profile holding them is checked."""
    from gptlab.experiments.profiles import profile_params

    profile = tmp_path / "profile.yaml"
    profile.write_text(block, encoding="utf-8")
    profile_params(profile, PROJECT_ROOT / "params.yaml")


def test_each_gptlab_command_of_the_own_data_page_parses() -> None:
    from gptlab.cli.main import parse

    blocks = re.findall(r"```bash\n(.*?)```", OWN_DATA.read_text(encoding="utf-8"), re.S)
    commands = [
        line.split("#")[0].split() for b in blocks for line in b.splitlines() if line.startswith("gptlab ")
    ]
    assert len(commands) >= 3
    for command in commands:
        parse(command[1:])
