"""The report's summary in the terminal: one ``rich`` table row per layer and the findings."""

import math
from collections.abc import Sequence

import pandas as pd
from rich.console import Console
from rich.table import Table


def _pair(row: pd.Series, column: str) -> str:
    return f"{row[column]:.3f} ({row[f'{column}_baseline']:.3f})"


def _num(value: float, spec: str = ".3f") -> str:
    return "n/a" if math.isnan(value) else format(value, spec)


def print_summary(
    console: Console, title: str, summary: pd.DataFrame, findings: Sequence[str], out: str
) -> None:
    """Print the per-layer table (random baselines in brackets) and the findings."""
    table = Table(title=title, caption="(random baseline mean in brackets)", show_lines=False)
    headers = ["layer", "identity err", "reversib.", "head δ", "ε", "ε no sink", "field",
               "scale s", "drift", "drift no sink"]  # fmt: skip
    for header in headers:
        table.add_column(header, justify="right")
    for _, row in summary.iterrows():
        table.add_row(
            str(int(row["layer"])),
            f"{row['identity_error']:.1e}",
            f"{row['reversibility']:.3f}",
            _pair(row, "head_defect"),
            _pair(row, "transport_defect"),
            _pair(row, "transport_defect_nosink"),
            _pair(row, "field_defect"),
            _num(row["scale"], ".3g"),
            _num(row["drift_to_next"]),
            _num(row["drift_to_next_nosink"]),
        )
    console.print(table)
    for text in findings:
        console.print(f"• {text}", highlight=False)
    console.print(f"report written to [bold]{out}[/bold]")
