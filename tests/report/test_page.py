"""The report's page: every symbol it shows is defined, processing reads as a list, the
residual figure leaves out panels with nothing to show (saying so in words), every defect has
its baseline, the figures have one width, and constant columns are explained, not repeated."""

import html as html_lib
import json
import re

import matplotlib.image
import pandas as pd
import pytest
import torch
from rich.console import Console

from tl_connwalk.report import ReportConfig, figures, html, run_report

QUICK = {"model": "toy-gpt2", "max_tokens": 16, "baseline_draws": 2, "progress": False}
#: the notation the findings and the table may use, each of which the page must define
NOTATION = ("δ", "ε", "(C1)", "(C2)", "(C3)", "field", "sink", "drift", "random", "scale s", "μ")


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    out = tmp_path_factory.mktemp("page") / "toy"
    run_report(ReportConfig(out=out, **QUICK), Console(quiet=True))
    return out


@pytest.fixture(scope="module")
def page(report):
    return html_lib.unescape((report / "index.html").read_text(encoding="utf-8"))


@pytest.fixture(scope="module")
def summary(report):
    return pd.DataFrame(json.loads((report / "report.json").read_text())["summary"])


def defined_terms() -> str:
    return " ".join(symbol for symbol, _ in html.SYMBOLS)


def test_every_notation_used_is_defined_on_the_page(page):
    findings = re.search(r"<h2>Findings</h2><ul>(.*?)</ul>", page, re.DOTALL)
    table = page[page.index("<h2>Summary by layer") :]
    assert findings
    shown = findings.group(1) + " ".join(re.findall(r"<th>(.*?)</th>", table))
    used = [token for token in NOTATION if token in shown]
    assert {"δ", "ε", "(C2)", "sink", "random"} <= set(used)
    undefined = [token for token in used if token not in defined_terms()]
    assert not undefined, f"the page uses {undefined} without defining them"
    assert "<h2>Symbols</h2>" in page
    for symbol, _ in html.SYMBOLS:
        assert f"<dt>{symbol}</dt>" in page


def test_findings_and_table_write_the_defects_one_way(page):
    """δ and ε, as in the table and the figures: not also "delta(" and "eps"."""
    findings = re.search(r"<h2>Findings</h2><ul>(.*?)</ul>", page, re.DOTALL)
    assert findings
    assert not re.search(r"\bdelta\(|\beps\b|\bmu:", findings.group(1))


def test_weight_processing_is_a_list(page, report):
    record = json.loads((report / "report.json").read_text())
    flags = record["layers"][0]["processing"]
    block = re.search(r"<dt>weight processing</dt><dd><ul>(.*?)</ul></dd>", page, re.DOTALL)
    assert block, "weight processing is not rendered as a list"
    items = re.findall(r"<li>(.*?)</li>", block.group(1))
    assert [item.split(":")[0].split(" (")[0] for item in items] == list(flags)
    assert "{" not in block.group(1)  # no dict repr


def test_processing_lines_name_what_differs_between_layers():
    lines = html.processing_lines(
        [{"fold_ln": True, "custom": False}, {"fold_ln": False, "custom": False}]
    )
    assert lines == [
        "fold_ln (LayerNorm scales folded into W_V): in 1 of 2 measured layers",
        "custom: no",
    ]


def test_causal_report_states_the_omitted_panels(page):
    residual = page[page.index("<h2>Laplacian residual</h2>") :]
    notes = re.findall(r'<p class="note">(.*?)</p>', residual.split("<h2>", 2)[1])
    assert any("pairing is not drawn: not applicable" in note for note in notes)


def test_omissions_follow_the_numbers(summary):
    noise = 16 * 1.2e-7
    exact = summary.assign(stochasticity=noise / 2, identity_error=1e-7)
    assert set(figures.residual_omissions(exact, noise)) == {"stochasticity", "pairing", "identity"}
    informative = exact.assign(
        stochasticity=10 * noise,
        pairing=0.5,
        pairing_nosink=0.4,
        identity_error=10 * figures.IDENTITY_BOUND,
    )
    assert figures.residual_omissions(informative, noise) == {}
    one_layer_off = exact.copy()
    one_layer_off.loc[one_layer_off.index[-1], "stochasticity"] = 2 * noise
    assert "stochasticity" not in figures.residual_omissions(one_layer_off, noise)


@pytest.mark.parametrize("informative", [False, True])
def test_residual_figure_draws_the_panels_left(summary, tmp_path, informative, monkeypatch):
    noise = 16 * 1.2e-7
    frame = summary.assign(stochasticity=noise / 2)
    if informative:
        frame = frame.assign(
            stochasticity=10 * noise,
            pairing=0.5,
            pairing_nosink=0.4,
            pairing_baseline=1.4,
            pairing_baseline_std=0.01,
            pairing_nosink_baseline=1.4,
            pairing_nosink_baseline_std=0.01,
        )
    drawn = []
    for name, draw in figures.RESIDUAL_PANELS.items():
        monkeypatch.setitem(
            figures.RESIDUAL_PANELS,
            name,
            lambda ax, s, d, n, name=name, draw=draw: (drawn.append(name), draw(ax, s, d, n)),
        )
    path = figures.residual_components(frame, 2, "toy", tmp_path / "residual.png", noise)
    assert path.read_bytes().startswith(b"\x89PNG")
    omitted = figures.residual_omissions(frame, noise)
    assert drawn == [name for name in figures.RESIDUAL_PANELS if name not in omitted]
    assert ("pairing" in drawn) == informative


def test_every_figure_has_one_width(report):
    widths = {png.name: matplotlib.image.imread(png).shape[1] for png in report.glob("*.png")}
    assert len(widths) == len(figures.FIGURES)
    assert set(widths.values()) == {round(figures.WIDTH * figures.DPI)}, widths


def test_every_defect_has_its_baseline(summary, page):
    """Reversibility beside the uniform walk on the same edges; the rest beside random draws."""
    assert summary["reversibility_baseline"].between(0, 1).all()
    assert (summary["reversibility_baseline"] > 0).all()  # a causal walk's edges are not reversible
    for column in ("head_defect", "transport_defect", "field_defect"):
        assert summary[f"{column}_baseline"].notna().all()
        assert (summary[f"{column}_baseline_std"] >= 0).all()
    intro = page[: page.index("<h2>Findings</h2>")]
    assert "uniform walk on the same edges" in intro and "float-rounding bounds" in intro
    findings = re.search(r"<h2>Findings</h2><ul>(.*?)</ul>", page, re.DOTALL)
    assert findings and "for the uniform walk on the same edges" in findings.group(1)


def test_constant_columns_are_explained_not_repeated(summary, page):
    """The random heads' δ does not depend on the layer (δ ignores scale, one seed, one shape):
    the page gives its value once, with the reason, instead of a column of equal numbers."""
    constant = html.constant_columns(summary)
    assert "head_defect_baseline" in constant
    assert summary["head_defect_baseline"].nunique() == 1
    table = page[page.index("<h2>Summary by layer") :]
    headers = re.findall(r"<th>(.*?)</th>", table)
    assert "head δ random" not in headers and "head δ (mean)" in headers
    for column, value in constant.items():
        assert f"{html.COLUMNS[column]}: {value:.4f} on every layer" in table
    assert html.CONSTANT_REASONS["head_defect_baseline"] in table
    varying = summary.assign(head_defect_baseline=summary["layer"] / 10)
    assert "head_defect_baseline" not in html.constant_columns(varying)
    assert html.constant_columns(summary.iloc[:1]) == {}


def test_a_bidirectional_report_draws_the_pairing_beside_random_transports(tmp_path):
    out = tmp_path / "bert"
    run_report(ReportConfig(out=out, **(QUICK | {"model": "toy-bert"})), Console(quiet=True))
    frame = pd.DataFrame(json.loads((out / "report.json").read_text())["summary"])
    for suffix in ("", "_nosink"):
        assert frame[f"pairing{suffix}"].notna().all()
        assert frame[f"pairing{suffix}_baseline"].notna().all()
    # every pair of positions: reversible, up to the rounding of mu's float64 solve
    assert (frame["reversibility_baseline"] <= 16 * torch.finfo(torch.float64).eps).all()
    page = html_lib.unescape((out / "index.html").read_text(encoding="utf-8"))
    assert "vs random" in re.search(r"\(C3\) pairing [^<]*", page).group(0)
