"""``index.html``: the report on one self-contained page (figures inlined, no scripts, no CDN).

The page repeats the report's findings, the run's metadata, every figure (as base64 PNG, so the
file can be mailed on its own; the PNGs also sit beside it, all one width) and the per-layer
summary table, and defines every symbol they use (`SYMBOLS`), written the same way in each. A
column with one value on every layer is not repeated down the table: a line under it gives
the value and why it does not change (`constant_columns`).
"""

# ruff: noqa: RUF001  (the symbols are written in Unicode, as the page shows them)

import base64
import html
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import pandas as pd

from tl_connwalk.report.figures import BAND

STYLE = """
body { font-family: system-ui, sans-serif; margin: 2em auto; max-width: 1200px; color: #222; }
h1 { font-size: 1.5em; } h2 { font-size: 1.2em; margin-top: 2em; }
table { border-collapse: collapse; font-size: 0.85em; }
th, td { border: 1px solid #ccc; padding: 2px 6px; text-align: right; }
th { background: #f0f0f0; } td:first-child, th:first-child { text-align: left; }
dl { display: grid; grid-template-columns: max-content auto; gap: 2px 1em; }
dt { font-weight: 600; } dd { margin: 0; }
img { display: block; max-width: 100%; border: 1px solid #ddd; }
code { background: #f4f4f4; padding: 0 3px; }
dl.symbols { grid-template-columns: 11em auto; font-size: 0.92em; }
p.note { font-size: 0.9em; color: #444; margin: 0.3em 0; }
"""

#: every symbol the findings, figures and table use, and what it means (spec §1-§4 of the docs)
SYMBOLS: Sequence[tuple[str, str]] = (
    (
        "A^h, W",
        "A^h_ij: head h's attention from query i (receiver) to key j (sender). The walk "
        "W_ij = mean over heads of A^h_ij: every row sums to 1.",
    ),
    ("x_j (field)", "the field at position j: exactly the vector the value projection reads."),
    (
        "T^h, T_ij",
        "T^h = W_V^h W_O^h: head h's OV map. T_ij = H Σ_h g^h_ij T^h: the effective "
        "transport of the edge j → i, with gates g^h_ij = A^h_ij / Σ_h' A^h'_ij.",
    ),
    (
        "P, c, identity",
        "(PX)_i = Σ_j W_ij x_j T_ij, and c the bias: PX + c is the attention "
        "output exactly. Identity error: max |PX + c − attention output| / max |attention output|.",
    ),
    ("(C1) stochasticity", "max_i |Σ_j W_ij − 1|: 0 when every row of W sums to 1."),
    (
        "(C2) reversibility, μ",
        "‖M − Mᵀ‖ / ‖M + Mᵀ‖ with M = diag(μ) W: 0 when the walk is in "
        'detailed balance with μ. μ is the walk\'s stationary distribution ("stationary") or, for '
        'a walk without a unique one such as a causal walk, uniform ("uniform"). Its baseline, '
        '"uniform walk": the same residual for the walk that spreads each query evenly over the '
        "same keys (the transports do not enter (C2), so random ones give no baseline for it).",
    ),
    (
        "(C3) metric compatibility",
        "every T_ij a scaled isometry and the reverse edge its "
        "transpose. Pairing: ‖T_ji − T_ijᵀ‖ / ‖T_ij‖, not applicable to causal walks.",
    ),
    (
        "δ (delta)",
        "isometry defect δ(T) = √(1 − (Σ σ)² / (r Σ σ²)) over the top r singular "
        "values σ of T: 0 for a scaled (partial) isometry. Head δ: δ(T^h) with r = d_head.",
    ),
    (
        "ε (epsilon)",
        "Gram defect ε(T) = √(1 − (Σ σ²)² / (r Σ σ⁴)), 0 likewise. The effective "
        "transport defect ε is the walk-weighted mean of ε(T_ij), with r the rank the transports "
        "can have, min(d_model, H_kv d_head) (H_kv: distinct value heads).",
    ),
    ("scale s", "the common scale: walk-weighted ‖T_ij‖_F / √r."),
    (
        "field defect",
        "walk-weighted coefficient of variation of ‖x_j T_ij‖ / ‖x_j‖ over the "
        "messages sent: 0 when the transports scale every message by one factor.",
    ),
    (
        "sink, no sink",
        "the sink is the first token, to which decoders send much of their walk "
        'mass. "No sink" (sink excluded): key 0 dropped from the walk and every row renormalised.',
    ),
    (
        "drift",
        "layer drift from layer l to l + 1: the mean over rows i of the total variation "
        "between W^l_i and W^(l+1)_i (0 = same walk, 1 = disjoint rows).",
    ),
    (
        "random, baseline",
        "the same defect for random Gaussian transports of the same shapes, value-head sharing "
        f"and head norms: mean ± {BAND} standard deviations over the draws, the shaded band in "
        'the figures. "Below the baseline": below the band, its mean minus two standard '
        "deviations.",
    ),
)

#: weight-processing flags (``walk.processing``) in words
PROCESSING = {
    "fold_ln": "LayerNorm scales folded into W_V",
    "center_writing_weights": "W_O centred: each output's mean subtracted (inferred from the "
    "weights)",
    "fold_value_biases": "value biases b_V W_O moved into b_O (inferred from the weights)",
    "compatibility_mode": "TransformerBridge in compatibility mode",
    "weights_processed": "TransformerBridge weights processed",
}

#: the summary table's columns on the page, with their headers
COLUMNS = {
    "layer": "layer",
    "identity_error": "identity error",
    "stochasticity": "stochasticity (C1)",
    "reversibility": "reversibility (C2)",
    "reversibility_baseline": "(C2) uniform walk",
    "pairing": "pairing (C3)",
    "pairing_baseline": "pairing random",
    "head_defect": "head δ (mean)",
    "head_defect_baseline": "head δ random",
    "transport_defect": "ε",
    "transport_defect_baseline": "ε random",
    "transport_defect_nosink": "ε no sink",
    "transport_defect_nosink_baseline": "ε no sink random",
    "field_defect": "field defect",
    "field_defect_baseline": "field defect random",
    "scale": "scale s",
    "drift_to_next": "drift",
    "drift_to_next_nosink": "drift no sink",
}


def _image(path: Path) -> str:
    data = base64.b64encode(path.read_bytes()).decode("ascii")
    return f'<img alt="{html.escape(path.name)}" src="data:image/png;base64,{data}">'


def processing_lines(layers: Sequence[Mapping[str, bool]]) -> list[str]:
    """One line per weight-processing flag: its name, whether the layers had it, what it does.

    ``layers`` holds each measured layer's ``processing``; a flag that differs between layers
    lists the layers that had it.

    >>> processing_lines([{"fold_ln": True}, {"fold_ln": True}])
    ['fold_ln (LayerNorm scales folded into W_V): yes']
    """
    names = list(dict.fromkeys(name for layer in layers for name in layer))
    lines = []
    for name in names:
        had = [index for index, layer in enumerate(layers) if layer.get(name)]
        if len(had) == len(layers):
            state = "yes"
        elif not had:
            state = "no"
        else:
            state = f"in {len(had)} of {len(layers)} measured layers"
        what = PROCESSING.get(name)
        lines.append(f"{name}" + (f" ({what})" if what else "") + f": {state}")
    return lines


def _value(value: Any) -> str:
    if isinstance(value, list):
        items = "".join(f"<li>{html.escape(str(item))}</li>" for item in value)
        return f"<ul>{items}</ul>"
    return html.escape(str(value))


def _metadata(meta: dict[str, Any]) -> str:
    rows = "".join(
        f"<dt>{html.escape(str(key))}</dt><dd>{_value(value)}</dd>" for key, value in meta.items()
    )
    return f"<dl>{rows}</dl>"


def _symbols() -> str:
    rows = "".join(
        f"<dt>{html.escape(symbol)}</dt><dd>{html.escape(meaning)}</dd>"
        for symbol, meaning in SYMBOLS
    )
    return f'<dl class="symbols">{rows}</dl>'


#: why a summary column can have one value on every layer
CONSTANT_REASONS = {
    "head_defect_baseline": (
        "δ is invariant under scaling, so the head norms the random heads match do not enter "
        "it; the random heads have the layers' one shape and are drawn from one seed, so "
        "their δ is the same on every layer"
    ),
    "reversibility_baseline": (
        "it depends on the walk's edges alone (which keys each query reaches), and every layer "
        "has the same edges (a causal model's are the causal mask)"
    ),
}


def constant_columns(summary: pd.DataFrame) -> dict[str, float]:
    """The table's columns (`COLUMNS`) with one value on every layer, and that value.

    Only over two or more layers, and never ``layer``; a column of NaN (not applicable) is
    not constant but missing.

    >>> constant_columns(pd.DataFrame({"layer": [0, 1], "head_defect_baseline": [0.2, 0.2]}))
    {'head_defect_baseline': 0.2}
    """
    if len(summary) < 2:
        return {}
    return {
        column: float(summary[column].iloc[0])
        for column in COLUMNS
        if column in summary
        and column != "layer"
        and summary[column].notna().all()
        and summary[column].nunique() == 1
    }


def _table(summary: pd.DataFrame) -> str:
    """The table of the columns that vary, and a line per constant column under it."""
    constant = constant_columns(summary)
    shown = [c for c in COLUMNS if c in summary and c not in constant and summary[c].notna().any()]
    frame = summary[shown].rename(columns=COLUMNS)
    formatters = {
        COLUMNS["layer"]: str,
        COLUMNS["identity_error"]: lambda v: f"{v:.1e}",
        COLUMNS["stochasticity"]: lambda v: f"{v:.1e}",
    }
    table = frame.to_html(
        index=False,
        float_format=lambda v: f"{v:.4f}",
        formatters={k: f for k, f in formatters.items() if k in frame},
        na_rep="n/a",
    )
    lines = [
        f"{COLUMNS[column]}: {value:.4f} on every layer"
        + (f": {CONSTANT_REASONS[column]}" if column in CONSTANT_REASONS else "")
        + "."
        for column, value in constant.items()
    ]
    if "drift_to_next" in shown and summary["drift_to_next"].isna().any():
        lines.append("drift n/a: the model's last layer has no layer after it.")
    notes = "".join(f'<p class="note">{html.escape(line)}</p>\n' for line in lines)
    return table + "\n" + notes


def write_index(
    path: Path,
    title: str,
    meta: dict[str, Any],
    findings: Sequence[str],
    figures: Sequence[tuple[Path, str]],
    summary: pd.DataFrame,
    notes: Mapping[str, Sequence[str]] | None = None,
) -> Path:
    """Write the page to ``path``; ``figures`` are ``(png, heading)`` pairs.

    ``notes``: sentences shown under the figure of that file name (e.g. what it leaves out).
    """
    notes = notes or {}
    sections = "".join(
        f"<h2>{html.escape(heading)}</h2>\n{_image(png)}\n"
        + "".join(f'<p class="note">{html.escape(text)}</p>\n' for text in notes.get(png.name, ()))
        for png, heading in figures
    )
    items = "".join(f"<li>{html.escape(text)}</li>" for text in findings)
    page = f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8">
<title>{html.escape(title)}</title><style>{STYLE}</style></head>
<body>
<h1>{html.escape(title)}</h1>
<p>Attention as a connection walk (tl_connwalk): every layer's walk, transports and how far its
generator is from a random-walk connection Laplacian, (C1) to (C3) below. Every defect is
shown beside its baseline: the transport defects (δ, ε, field defect) and the pairing beside
random transports of the same shapes, value-head sharing and norms (the shaded band: mean ±
{BAND} standard deviations; "below the baseline" means below the band); reversibility, which
the transports do not enter, beside the uniform walk on the same edges; stochasticity and the
identity beside their float-rounding bounds. The symbols are defined under "Symbols".
Numbers: <code>report.json</code>, <code>geometry.csv</code>.</p>
<h2>Findings</h2><ul>{items}</ul>
<h2>Run</h2>{_metadata(meta)}
<h2>Symbols</h2>{_symbols()}
{sections}
<h2>Summary by layer (batch means)</h2>
{_table(summary)}
</body></html>
"""
    path.write_text(page, encoding="utf-8")
    return path
