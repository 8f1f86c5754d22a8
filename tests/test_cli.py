import re
from pathlib import Path

import pytest

from tests.architectures import HAS_HOOKED, bridge_only
from tests.zoo.helpers import save_tiny
from tl_connwalk.cli import main
from tl_connwalk.report.inputs import toy_names
from tl_connwalk.zoo import available

PERFORMANCE = Path(__file__).parents[1] / "docs" / "performance.md"


def test_demo_checks_the_identity(capsys):
    assert main(["demo", "--positions", "5"]) == 0
    out = capsys.readouterr().out
    assert "identity holds" in out
    assert out.count("max |error| / max |output|") == 4


def test_report_help_lists_every_option(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["report", "--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    options = ["--model", "--backend", "--text", "--dataset", "--max-tokens", "--out", "--device",
               "--dtype", "--layers", "--baseline-draws", "--overwrite"]  # fmt: skip
    for option in options:
        assert option in out


def test_report_help_names_every_kind_of_model_and_where_the_cost_is_measured(capsys):
    with pytest.raises(SystemExit):
        main(["report", "--help"])
    text = " ".join(capsys.readouterr().out.split())  # argparse wraps lines to the terminal
    for name in [*available(), *toy_names()]:
        assert name in text
    assert "local Hugging Face directory" in text
    assert "HookedTransformer.from_pretrained" in text
    assert 'Performance page (docs/performance.md, "The report")' in text
    assert "\n### The report\n" in PERFORMANCE.read_text(encoding="utf-8")
    assert not re.search(r"\d s\b|\bmin\b", text), "the time is stated on the Performance page"


@bridge_only
def test_report_on_a_toy_model(tmp_path, capsys):
    out = tmp_path / "toy"
    args = ["report", "--model", "toy-llama", "--max-tokens", "12", "--baseline-draws", "2",
            "--out", str(out), "--no-progress"]  # fmt: skip
    assert main(args) == 0
    assert (out / "index.html").is_file()
    assert "toy-llama: connection-walk geometry, 12 tokens" in capsys.readouterr().out
    assert main(args) == 2  # the folder is taken now
    assert "--overwrite" in capsys.readouterr().err


BAR = re.compile(r"\d+%\|")  # how tqdm draws a bar: "  58%|█████▊    | 157/272"


@pytest.mark.parametrize(
    "backend",
    (["hooked"] if HAS_HOOKED else []) + [pytest.param("bridge", marks=bridge_only)],
)
def test_no_progress_draws_no_bar(tmp_path, capfd, backend):
    """A local model's report: its loading bar is drawn by default, and nothing with
    --no-progress (stderr captured at the file descriptor)."""
    save_tiny("llama", tmp_path / "tiny")
    args = ["report", "--model", str(tmp_path / "tiny"), "--backend", backend, "--max-tokens",
            "8", "--baseline-draws", "2", "--overwrite"]  # fmt: skip
    assert main([*args, "--out", str(tmp_path / "shown")]) == 0
    assert BAR.search(capfd.readouterr().err)  # the check below can fail
    assert main([*args, "--out", str(tmp_path / "quiet"), "--no-progress"]) == 0
    err = capfd.readouterr().err
    assert not BAR.search(err), err
