from tl_connwalk.cli import main


def test_demo_checks_the_identity(capsys):
    assert main(["demo", "--positions", "5"]) == 0
    out = capsys.readouterr().out
    assert "identity holds" in out
    assert out.count("max |error| / max |output|") == 4
