"""Execute every tutorial notebook top to bottom on its small default model (slow; CI runs it).

Each ``tutorials/*.ipynb`` is run with nbclient in a temporary directory, figures on the Agg
backend; any cell error fails the test. The ``.ipynb`` files are the jupytext pairs of the
``.py`` sources, so the test also checks that each pair is in sync.

On TransformerLens 4.x (no HookedTransformer) the notebooks run with ``BACKEND = "bridge"``
(TransformerBridge); a notebook without that parameter would be skipped there.
"""

from pathlib import Path

import pytest

from tests.architectures import HAS_HOOKED

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
jupytext = pytest.importorskip("jupytext")

TUTORIALS = Path(__file__).resolve().parents[1] / "tutorials"
NOTEBOOKS = sorted(TUTORIALS.glob("*.ipynb"))


def test_every_source_has_a_notebook() -> None:
    sources = {p.stem for p in TUTORIALS.glob("[0-9]*.py")}
    assert sources, "no tutorials found"
    assert sources == {p.stem for p in NOTEBOOKS}


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_in_sync_with_source(path: Path) -> None:
    source = jupytext.read(path.with_suffix(".py"))
    notebook = nbformat.read(path, as_version=4)
    assert [c.source for c in source.cells] == [c.source for c in notebook.cells], (
        f"{path.name} is out of date: run `jupytext --sync {path.with_suffix('.py')}`"
    )
    assert all(not c.get("outputs") for c in notebook.cells if c.cell_type == "code")


HOOKED_BACKEND = 'BACKEND = "hooked"'


def parameters_cell(notebook: "nbformat.NotebookNode") -> "nbformat.NotebookNode":
    cells = [c for c in notebook.cells if "parameters" in c.get("metadata", {}).get("tags", [])]
    assert len(cells) == 1, "a tutorial has exactly one cell tagged 'parameters'"
    return cells[0]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_backend_parameter_defaults_to_hooked(path: Path) -> None:
    """Where a tutorial has a ``BACKEND`` parameter, its default is the line the TL 4.x run
    below rewrites; a changed default would silently stop that run."""
    source = parameters_cell(nbformat.read(path, as_version=4)).source
    backend = [line for line in source.splitlines() if line.startswith("BACKEND")]
    assert not backend or backend == [line for line in backend if line.startswith(HOOKED_BACKEND)]


@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_executes(path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MPLBACKEND", "Agg")
    notebook = nbformat.read(path, as_version=4)
    if not HAS_HOOKED:  # TransformerLens 4.x: only TransformerBridge
        parameters = parameters_cell(notebook)
        if HOOKED_BACKEND not in parameters.source:
            pytest.skip("this tutorial needs HookedTransformer hook points (TransformerLens 3.x)")
        parameters.source = parameters.source.replace(HOOKED_BACKEND, 'BACKEND = "bridge"', 1)
    client = nbclient.NotebookClient(
        notebook,
        timeout=1800,
        kernel_name="python3",
        resources={"metadata": {"path": str(tmp_path)}},
    )
    client.execute()
    errors = [o for c in notebook.cells for o in c.get("outputs", []) if o.output_type == "error"]
    assert not errors, errors
