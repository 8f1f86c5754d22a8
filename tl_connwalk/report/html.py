"""``index.html``: the report on one self-contained page (figures inlined, no scripts, no CDN).

The page repeats the report's findings, the run's metadata, every figure (as base64 PNG, so the
file can be mailed on its own; the PNGs also sit beside it) and the per-layer summary table.
"""

import base64
import html
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pandas as pd

STYLE = """
body { font-family: system-ui, sans-serif; margin: 2em auto; max-width: 1200px; color: #222; }
h1 { font-size: 1.5em; } h2 { font-size: 1.2em; margin-top: 2em; }
table { border-collapse: collapse; font-size: 0.85em; }
th, td { border: 1px solid #ccc; padding: 2px 6px; text-align: right; }
th { background: #f0f0f0; } td:first-child, th:first-child { text-align: left; }
dl { display: grid; grid-template-columns: max-content auto; gap: 2px 1em; }
dt { font-weight: 600; } dd { margin: 0; }
img { max-width: 100%; border: 1px solid #ddd; }
code { background: #f4f4f4; padding: 0 3px; }
"""

#: the summary table's columns on the page, with their headers
COLUMNS = {
    "layer": "layer",
    "identity_error": "identity error",
    "stochasticity": "stochasticity (C1)",
    "reversibility": "reversibility (C2)",
    "head_defect": "head δ (mean)",
    "head_defect_baseline": "head δ random",
    "transport_defect": "ε",
    "transport_defect_baseline": "ε random",
    "transport_defect_nosink": "ε no sink",
    "transport_defect_nosink_baseline": "ε no sink random",
    "field_defect": "field defect",
    "field_defect_baseline": "field random",
    "scale": "scale s",
    "drift_to_next": "drift to next",
    "drift_to_next_nosink": "drift no sink",
}


def _image(path: Path) -> str:
    data = base64.b64encode(path.read_bytes()).decode("ascii")
    return f'<img alt="{html.escape(path.name)}" src="data:image/png;base64,{data}">'


def _metadata(meta: dict[str, Any]) -> str:
    rows = "".join(
        f"<dt>{html.escape(str(key))}</dt><dd>{html.escape(str(value))}</dd>"
        for key, value in meta.items()
    )
    return f"<dl>{rows}</dl>"


def _table(summary: pd.DataFrame) -> str:
    frame = summary[[c for c in COLUMNS if c in summary]].rename(columns=COLUMNS)
    formatters = {
        COLUMNS["layer"]: str,
        COLUMNS["identity_error"]: lambda v: f"{v:.1e}",
        COLUMNS["stochasticity"]: lambda v: f"{v:.1e}",
    }
    return frame.to_html(
        index=False, float_format=lambda v: f"{v:.4f}", formatters=formatters, na_rep="n/a"
    )


def write_index(
    path: Path,
    title: str,
    meta: dict[str, Any],
    findings: Sequence[str],
    figures: Sequence[tuple[Path, str]],
    summary: pd.DataFrame,
) -> Path:
    """Write the page to ``path``; ``figures`` are ``(png, heading)`` pairs."""
    sections = "".join(
        f"<h2>{html.escape(heading)}</h2>\n{_image(png)}\n" for png, heading in figures
    )
    items = "".join(f"<li>{html.escape(text)}</li>" for text in findings)
    page = f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8">
<title>{html.escape(title)}</title><style>{STYLE}</style></head>
<body>
<h1>{html.escape(title)}</h1>
<p>Attention as a connection walk (tl_connwalk): every layer's walk, transports and how far its
generator is from a random-walk connection Laplacian. Defects are drawn beside random
transports of the same shapes, value-head sharing and norms; "below the baseline" means
below its mean minus two standard deviations. Numbers: <code>report.json</code>,
<code>geometry.csv</code>.</p>
<h2>Findings</h2><ul>{items}</ul>
<h2>Run</h2>{_metadata(meta)}
{sections}
<h2>Summary by layer (batch means)</h2>
{_table(summary)}
</body></html>
"""
    path.write_text(page, encoding="utf-8")
    return path
