"""The views drawn by a real browser (headless Chromium, where one is installed).

The page's script must run without error (it leaves ``data-state="ok"`` on the view) and draw
what the data says: one chip per token with the target marked, the head grid, the strongest
edges as arcs, a sequence selector for a batch; the drawn page still loads nothing. A
screenshot is taken too (``--screenshot``), as the docs' images are.
"""

import shutil
import subprocess
from pathlib import Path

import matplotlib.image
import pytest
import torch

import tl_connwalk
from tests.architectures import default_model, tokens
from tests.views.pages import Page
from tests.views.test_walk import padded_walk

BROWSER = next(
    (
        path
        for name in ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")
        if (path := shutil.which(name))
    ),
    None,
)

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(BROWSER is None, reason="no headless Chromium installed"),
]

HOSTILE = "</script><img src=x onerror=alert(1)>"


def browse(page: Path, *options: str) -> str:
    """Chromium's output for ``page``: the drawn DOM with ``--dump-dom``."""
    assert BROWSER is not None
    done = subprocess.run(
        [
            BROWSER,
            "--headless",
            "--no-sandbox",  # tests may run as root; the page is a local file
            "--disable-gpu",
            "--hide-scrollbars",
            "--window-size=1200,1400",
            "--virtual-time-budget=5000",
            *options,
            page.as_uri(),
        ],
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


def drawn(page: Path) -> tuple[Page, str]:
    """The drawn DOM, parsed and as text, checked to be drawn without error or reference."""
    text = browse(page, "--dump-dom")
    dom = Page(text)
    [root] = [attrs for attrs in dom.named("div") if attrs.get("class") == "cwv"]
    assert root.get("data-state") == "ok", "the view's script failed"
    assert dom.external() == []
    return dom, text


def classes(attrs: dict[str, str | None]) -> set[str]:
    return set((attrs.get("class") or "").split())


def test_attribution_page_draws_tokens_grid_arcs_and_selector(tmp_path):
    model = default_model()
    labels = [HOSTILE, *(f"t{i}" for i in range(8))]
    result = tl_connwalk.attribute(model, tokens(), position=6)
    path = result.to_html(tmp_path / "attribution.html", str_tokens=labels, top_edges=5)
    dom, text = drawn(path)
    chips = [attrs for attrs in dom.named("span") if "cwv-tok" in classes(attrs)]
    assert [chip["data-pos"] for chip in chips] == [str(i) for i in range(9)]
    assert [chip["data-pos"] for chip in chips if "target" in classes(chip)] == ["6"]
    cells = [attrs["data-component"] for attrs in dom.named("td") if "data-component" in attrs]
    assert sorted(cells) == sorted(n for n in result.component_names() if n != "embed")
    arcs = [attrs for attrs in dom.named("path") if "arc" in classes(attrs)]
    assert len(arcs) == 5
    assert len(dom.named("option")) == 2  # one per sequence
    assert dom.named("img") == []
    assert "&lt;/script&gt;&lt;img src=x onerror=alert(1)&gt;" in text  # drawn as text


def test_walk_page_draws_heatmaps_and_arcs(tmp_path):
    walk = padded_walk()
    edge = torch.rand(2, 6, 6, generator=torch.Generator().manual_seed(1)) * walk.walk
    dom, _ = drawn(walk.to_html(tmp_path / "walk.html", edge_contributions=edge))
    assert len(dom.named("canvas")) == 1 + walk.n_heads + 1  # W, the gates, the contributions
    arcs = [attrs for attrs in dom.named("path") if "arc" in classes(attrs)]
    assert len(arcs) == 6  # every key of the last query of the first sequence


def test_screenshot(tmp_path):
    model = default_model()
    result = tl_connwalk.attribute(model, tokens(batch=1), position=-1)
    page = result.to_html(tmp_path / "attribution.html")
    browse(page, f"--screenshot={tmp_path / 'view.png'}")
    image = (tmp_path / "view.png").read_bytes()
    assert image[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = int.from_bytes(image[16:20], "big"), int.from_bytes(image[20:24], "big")
    assert (width, height) == (1200, 1400)
    pixels = matplotlib.image.imread(tmp_path / "view.png")
    assert pixels[..., :3].std() > 0.05  # something was drawn, not a blank page
