"""The views drawn by a real browser (headless Chromium, where one is installed).

The page's script must run without error (it leaves ``data-state="ok"`` on the view) and draw
what the data says: one chip per token with the target marked and kept beside its neighbour,
the largest source shown on load, every percentage explained, the head grid, the strongest
edges as arcs with labels that do not overlap, colour bars that state their scale, a sequence
selector for a batch; the drawn page still loads nothing. A screenshot is taken too
(``--screenshot``), as the docs' images are.
"""

import html
import itertools
import math
import re
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
from tl_connwalk import ConnectionWalk

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
    """The drawn DOM, parsed, and its markup without the page's own script and style (so that
    text found there was drawn, not merely written in the code); checked to be drawn without
    error or reference."""
    text = browse(page, "--dump-dom")
    dom = Page(text)
    [root] = [attrs for attrs in dom.named("div") if attrs.get("class") == "cwv"]
    assert root.get("data-state") == "ok", "the view's script failed"
    assert dom.external() == []
    return dom, re.sub(r"<(script|style)\b.*?</\1>", "", text, flags=re.DOTALL)


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
    # the target chip wraps with its neighbour, never alone on a line
    [glued] = re.findall(r'<span class="cwv-glue">(.*?)</span></span></span>', text)
    assert re.findall(r'data-pos="(\d+)"', glued) == ["5", "6"]
    # on load, the source with the largest |score| is shown, and the shares are explained
    largest = int(result.scores[0].abs().argmax())
    assert "No token selected" not in text
    shown = html.unescape(re.search(r"Selected token: <span[^>]*>(.*?)</span>", text)[1])
    assert shown == f"\u2018{labels[largest]}\u2019 ({largest})"
    assert "can be more than 100% of T" in text and "% of T" in text


def test_a_baseline_method_draws_its_scores_only(tmp_path):
    result = tl_connwalk.attribute(default_model(), tokens(), position=6, method="rollout")
    dom, text = drawn(result.to_html(tmp_path / "rollout.html"))
    chips = [attrs for attrs in dom.named("span") if "cwv-tok" in classes(attrs)]
    assert len(chips) == 9
    assert dom.named("table") == [] and dom.named("path") == []  # no grid, no edge flows
    assert "No routes: routes belong to method=" in html.unescape(text)
    assert "% of T" not in text  # its scores do not split the target


def test_walk_page_draws_heatmaps_and_arcs(tmp_path):
    walk = padded_walk()
    edge = torch.rand(2, 6, 6, generator=torch.Generator().manual_seed(1)) * walk.walk
    dom, _ = drawn(walk.to_html(tmp_path / "walk.html", edge_contributions=edge))
    assert len(dom.named("canvas")) == 1 + walk.n_heads + 1  # W, the gates, the contributions
    arcs = [attrs for attrs in dom.named("path") if "arc" in classes(attrs)]
    assert len(arcs) == 6  # every key of the last query of the first sequence
    bars = [attrs for attrs in dom.named("div") if "cwv-cbar" in classes(attrs)]
    assert [bar["data-scale"] for bar in bars] == ["log"] * 3  # each heatmap's, log by default
    switches = [attrs for attrs in dom.named("select") if attrs.get("aria-label") == "colour scale"]
    assert len(switches) == 1


def test_walk_page_names_its_default_contributions_norms(tmp_path):
    _, text = drawn(padded_walk().to_html(tmp_path / "walk.html"))
    assert "log scale" in text
    assert "Norm per head" in text and "they do not add up to the edge" in text


def test_arc_labels_never_overlap(tmp_path):
    """100 positions in 1200 pixels: the rotated key labels are thinned out, hover shows all."""
    n_pos = 100
    generator = torch.Generator().manual_seed(0)
    scores = torch.randn(1, 2, n_pos, n_pos, generator=generator)
    pattern = scores.masked_fill(torch.ones(n_pos, n_pos).triu(1).bool(), -torch.inf).softmax(-1)
    walk = ConnectionWalk.from_pattern(
        pattern,
        torch.randn(1, n_pos, 8, generator=generator),
        torch.randn(2, 8, 4, generator=generator),
        torch.randn(2, 4, 8, generator=generator),
    )
    labels = [f"word{i}" for i in range(n_pos)]
    _, text = drawn(walk.to_html(tmp_path / "walk.html", str_tokens=labels))
    [every] = re.findall(r'data-label-every="(\d+)"', text)
    assert int(every) > 1 and "hover the axis for each token" in text
    drawn_labels = re.findall(r'<text class="tokl" x="([\d.]+)"[^>]*transform="rotate', text)
    xs = sorted(float(x) for x in drawn_labels)
    across = [(b - a) * math.sin(math.radians(55)) for a, b in itertools.pairwise(xs)]
    assert len(xs) < n_pos and min(across) >= 13  # one label's height apart, across the text
    slots = re.findall(r'<rect class="slot"', text)
    assert len(slots) == n_pos  # every position answers a hover


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
