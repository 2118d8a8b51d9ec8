"""The documentation site: `mkdocs build --strict` succeeds, every public loss has
its API page, the math of the docstrings is rendered (MathML, no script from
elsewhere), and the site's search finds a loss by a peer's name."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import pytest

import flashcl

pytest.importorskip("mkdocs")
pytest.importorskip("mkdocstrings")
pytest.importorskip("latex2mathml")
ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    out = tmp_path_factory.mktemp("site")
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={**__import__("os").environ, "NO_MKDOCS_2_WARNING": "1"},
    )
    assert result.returncode == 0, result.stdout + result.stderr
    return out


def test_every_public_loss_and_module_is_in_the_api_reference(site: pathlib.Path) -> None:
    pages = "".join((site / "api" / page / "index.html").read_text() for page in ("losses", "modules", "training"))
    for name in flashcl.__all__:
        if name.endswith("_loss") or name.endswith("Loss"):
            assert f'id="flashcl.{name}"' in pages, name


def test_docstring_math_is_rendered(site: pathlib.Path) -> None:
    page = (site / "api" / "losses" / "index.html").read_text()
    assert page.count("<math") >= 4  # CoSENT, the triplets, CosFace, ArcFace
    assert "$$" not in page and 'class="arithmatex"' not in page


@pytest.mark.parametrize(
    "peer_name", ["MultipleNegativesRankingLoss", "SupConLoss", "BatchAllTripletLoss", "CosFaceLoss", "DistillClipLoss"]
)
def test_search_finds_a_loss_by_a_peers_name(site: pathlib.Path, peer_name: str) -> None:
    index = json.loads((site / "search" / "search_index.json").read_text())
    hits = [doc["location"] for doc in index["docs"] if peer_name in doc["text"] or peer_name in doc["title"]]
    assert any(hit.startswith(("losses/", "api/")) for hit in hits), hits
