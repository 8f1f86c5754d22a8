"""tl_connwalk.report end to end on a toy model: every file, the JSON, atomic writing."""

import json
import os

import pandas as pd
import pytest
from rich.console import Console

from tests.architectures import bridge_only
from tl_connwalk.errors import ConnWalkError
from tl_connwalk.report import ReportConfig, figures, run_report
from tl_connwalk.report.run import FILES, heatmap_layers

QUICK = {"model": "toy-gpt2", "max_tokens": 16, "baseline_draws": 2, "progress": False}


def quiet() -> Console:
    return Console(quiet=True)


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    out = tmp_path_factory.mktemp("reports") / "toy"
    run_report(ReportConfig(out=out, **QUICK), quiet())
    return out


def test_every_file_written(report):
    assert sorted(p.name for p in report.iterdir()) == sorted(FILES)
    for png in report.glob("*.png"):
        assert png.read_bytes().startswith(b"\x89PNG")


def test_report_json(report):
    record = json.loads((report / "report.json").read_text())
    expected = {"model", "transformer_lens_version", "text", "tokens", "layers", "layer_drift",
                "summary", "findings", "files", "baseline_draws", "processing_summary"}  # fmt: skip
    assert expected <= record.keys()
    assert record["model"]["name"] == "toy-gpt2"
    assert record["model"]["backend"] == "bridge"
    assert record["model"]["class"] == "TransformerBridge"
    assert record["tokens"]["count"] == len(record["tokens"]["ids"]) == 16
    assert [layer["layer"] for layer in record["layers"]] == [0, 1, 2, 3]
    for layer in record["layers"]:
        assert layer["identity_error"] < figures.IDENTITY_BOUND  # the bound the report shows
        assert isinstance(layer["processing"], dict)
        residuals = layer["laplacian_residual"]
        assert residuals["with_sink"]["exclude_sink"] is False
        assert residuals["without_sink"]["exclude_sink"] is True
        assert residuals["with_sink"]["pairing"] is None  # causal: not applicable
        assert set(residuals["with_sink"]["baseline"]) == {
            "head_defects", "transport_defect", "field_defect"
        }  # fmt: skip
    assert len(record["layer_drift"]["with_sink"]) == 3


def test_geometry_csv_has_both_sink_settings(report):
    table = pd.read_csv(report / "geometry.csv")
    assert set(table["exclude_sink"]) == {False, True}
    assert set(table[table["head"] == "all"]["layer"]) == {0, 1, 2, 3}


def test_index_html_is_self_contained(report):
    page = (report / "index.html").read_text()
    assert page.count("data:image/png;base64,") == len(figures.FIGURES)
    assert "http://" not in page and "https://" not in page and "<script" not in page


def test_refuses_a_non_empty_out(tmp_path):
    out = tmp_path / "taken"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    with pytest.raises(ConnWalkError, match="--overwrite"):
        run_report(ReportConfig(out=out, **QUICK), quiet())
    assert os.listdir(out) == ["notes.txt"]


def test_overwrite_replaces_the_folder(tmp_path):
    out = tmp_path / "again"
    out.mkdir()
    (out / "old.txt").write_text("old")
    run_report(ReportConfig(out=out, overwrite=True, **QUICK), quiet())
    assert sorted(p.name for p in out.iterdir()) == sorted(FILES)
    assert os.listdir(tmp_path) == ["again"]


def test_failure_midway_leaves_nothing(tmp_path, monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("injected")

    # the residual figure comes after the CSV and the first PNGs are already written
    monkeypatch.setattr(figures, "residual_components", broken)
    out = tmp_path / "half"
    with pytest.raises(RuntimeError, match="injected"):
        run_report(ReportConfig(out=out, **QUICK), quiet())
    assert os.listdir(tmp_path) == []


def test_failure_keeps_the_old_report(tmp_path, monkeypatch):
    out = tmp_path / "kept"
    out.mkdir()
    (out / "old.txt").write_text("old")
    monkeypatch.setattr(figures, "effective_scale", lambda *a, **k: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        run_report(ReportConfig(out=out, overwrite=True, **QUICK), quiet())
    assert os.listdir(tmp_path) == ["kept"]
    assert os.listdir(out) == ["old.txt"]


def test_chosen_layers(tmp_path):
    out = tmp_path / "some"
    run_report(ReportConfig(out=out, layers=[-1, 1], **QUICK), quiet())
    record = json.loads((out / "report.json").read_text())
    assert [layer["layer"] for layer in record["layers"]] == [1, 3]
    assert len(record["layer_drift"]["with_sink"]) == 3  # drift is over all layers


def test_heatmap_layers():
    assert heatmap_layers([0, 1, 2, 3, 4]) == [0, 2, 4]
    assert heatmap_layers([3]) == [3]


@bridge_only
@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"layers": [7]}, "out of range"),
        ({"baseline_draws": 1}, ">= 2"),
        ({"max_tokens": 1}, "at least 2"),
        ({"model": "toy-t5"}, "unknown toy model"),
        ({"backend": "hooked"}, "TransformerBridge"),
        ({"dtype": "int8"}, "dtype"),
    ],
)
def test_bad_options(tmp_path, options, match):
    config = ReportConfig(out=tmp_path / "bad", **(QUICK | options))
    with pytest.raises(ConnWalkError, match=match):
        run_report(config, quiet())
    assert not (tmp_path / "bad").exists()
