"""`dvc plots show` draws offline: the page template in .dvc/ inlines Vega instead of loading it from a CDN."""

from __future__ import annotations

import hashlib
import re
import shutil
from pathlib import Path

import pytest

from helpers import PROJECT_ROOT, dvc, git

TEMPLATE = PROJECT_ROOT / ".dvc" / "plots" / "template.html"
# Each inlined build: `<!-- name@version path sha256:HEX (license) -->` followed by its <script>.
INLINED = re.compile(
    r"<!-- (\S+)@(\S+) (\S+) sha256:([0-9a-f]{64}) \([^)]+\) -->\s*<script>\n(.*?)</script>", re.S
)


def inlined_scripts() -> dict[str, str]:
    return {name: code for name, _, _, _, code in INLINED.findall(TEMPLATE.read_text(encoding="utf-8"))}


def test_the_template_inlines_vega_lite_and_embed_as_npm_builds_them() -> None:
    found = INLINED.findall(TEMPLATE.read_text(encoding="utf-8"))
    assert [name for name, *_ in found] == ["vega", "vega-lite", "vega-embed"]
    for name, version, path, sha256, code in found:
        assert hashlib.sha256(code.encode("utf-8")).hexdigest() == sha256, f"{name}@{version} {path}"


@pytest.mark.slow
def test_dvc_plots_show_writes_a_page_that_needs_no_network(tmp_path: Path) -> None:
    git(tmp_path, "init", "-q")
    dvc(tmp_path, "init", "-q")
    # The project's DVC config (plots.html_template) and the template it names, as a clone has them.
    shutil.copy2(PROJECT_ROOT / ".dvc" / "config", tmp_path / ".dvc" / "config")
    shutil.copytree(TEMPLATE.parent, tmp_path / ".dvc" / "plots")
    (tmp_path / "losses.csv").write_text("step,train_loss,val_loss\n0,9.781,9.933\n5,7.25,7.5\n")
    (tmp_path / "dvc.yaml").write_text(
        "plots:\n  - losses.csv:\n      x: step\n      y: [train_loss, val_loss]\n"
    )

    dvc(tmp_path, "plots", "show")

    page = (tmp_path / "dvc_plots" / "index.html").read_text(encoding="utf-8")
    assert not re.search(r"<script[^>]*\bsrc\s*=", page), "the page loads a script from elsewhere"
    scripts = inlined_scripts()
    assert all(code in page for code in scripts.values())
    # The UMD builds define the globals the page's plot calls.
    assert re.search(r"\.vega=\{\}", scripts["vega"]) and re.search(r"\.vegaLite=\{\}", scripts["vega-lite"])
    assert ".vegaEmbed=" in scripts["vega-embed"]
    assert "vegaEmbed('#losses_csv', spec)" in page and '"val_loss": "7.5"' in page
