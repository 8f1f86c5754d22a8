"""The report's headline numbers: the paper's testable claims (spec §5) read off the tables.

Plain statements with their numbers, never a verdict the numbers do not carry: "below the
random baseline" means below its mean minus two standard deviations over draws.
"""

import math
from typing import Any

import numpy as np
import pandas as pd


def _rank_correlation(values: np.ndarray) -> float:
    """Spearman correlation of ``values`` with their index (NaN for fewer than 3 values)."""
    if len(values) < 3:
        return math.nan
    series = pd.Series(values)
    return float(series.rank().corr(pd.Series(np.arange(len(values), dtype=float))))


def _thirds(values: np.ndarray) -> tuple[float, float]:
    third = max(1, len(values) // 3)
    return float(np.mean(values[:third])), float(np.mean(values[-third:]))


def _margin(frame: pd.DataFrame, column: str) -> pd.Series:
    """Two standard deviations of a random transport's defect about the baseline's estimate:
    the draws' spread and the estimate's own standard error (where the frame has it)."""
    spread = frame[f"{column}_baseline_std"] ** 2
    se = f"{column}_baseline_se"
    if se in frame:
        spread = spread + frame[se].fillna(0.0) ** 2
    return 2 * np.sqrt(spread)


def _below(frame: pd.DataFrame, column: str) -> pd.Series:
    return frame[column] < frame[f"{column}_baseline"] - _margin(frame, column)


def _above(frame: pd.DataFrame, column: str) -> pd.Series:
    return frame[column] > frame[f"{column}_baseline"] + _margin(frame, column)


def findings(
    summary: pd.DataFrame, heads: pd.DataFrame, drift: dict[str, np.ndarray]
) -> dict[str, Any]:
    """Numbers and one sentence each: identity, head and effective defects, drift, reversibility."""
    out: dict[str, Any] = {}
    worst = float(summary["identity_error"].max())
    out["identity"] = {
        "max_error": worst,
        "text": f"identity PX + c = attention output: worst relative error {worst:.1e}",
    }
    n_heads = len(heads)
    below, above = int(_below(heads, "head_defect").sum()), int(_above(heads, "head_defect").sum())
    mean, base = float(heads["head_defect"].mean()), float(heads["head_defect_baseline"].mean())
    out["head_defect"] = {
        "n_heads": n_heads,
        "below_baseline": below,
        "above_baseline": above,
        "mean": mean,
        "baseline_mean": base,
        "text": (
            f"head transport defects δ(T^h): mean {mean:.3f} vs random {base:.3f}; "
            f"{below}/{n_heads} heads below the baseline, {above} above"
        ),
    }
    record: dict[str, Any] = {}
    parts = []
    for suffix, sink in (("", "with sink"), ("_nosink", "no sink")):
        name = "transport_defect" + suffix
        n_below, n_above = int(_below(summary, name).sum()), int(_above(summary, name).sum())
        mean, base = float(summary[name].mean()), float(summary[f"{name}_baseline"].mean())
        record["without_sink" if suffix else "with_sink"] = {
            "mean": mean,
            "baseline_mean": base,
            "layers_below_baseline": n_below,
            "layers_above_baseline": n_above,
        }
        parts.append(
            f"{sink}: mean {mean:.3f} vs random {base:.3f}, "
            f"{n_below}/{len(summary)} layers below, {n_above} above"
        )
    record["text"] = "effective transport defect ε: " + "; ".join(parts)
    out["transport_defect"] = record
    drift_record: dict[str, Any] = {}
    parts = []
    for key, sink in (("with_sink", "with sink"), ("without_sink", "no sink")):
        values = drift[key]
        if len(values) == 0:
            continue
        early, late = _thirds(values)
        rho = _rank_correlation(values)
        drift_record[key] = {"first_third": early, "last_third": late, "spearman_depth": rho}
        parts.append(
            f"{sink}: {early:.3f} (first third) -> {late:.3f} (last third), "
            f"rank correlation with depth {rho:+.2f}"
        )
    if parts:
        drift_record["text"] = "layer drift by depth: " + "; ".join(parts)
        out["drift"] = drift_record
    rev, uniform = summary["reversibility"], summary["reversibility_baseline"]
    mus = ",".join(sorted(set(",".join(summary["mu"]).split(","))))
    pairing = summary["pairing"].dropna()
    pairing_text = "(C3) pairing not applicable (causal walks)"
    if not pairing.empty:
        base = float(summary["pairing_baseline"].mean())
        pairing_text = f"(C3) pairing {pairing.min():.3f}..{pairing.max():.3f} vs random {base:.3f}"
    out["reversibility"] = {
        "min": float(rev.min()),
        "median": float(rev.median()),
        "max": float(rev.max()),
        "uniform_walk_mean": float(uniform.mean()),
        "mu": mus,
        "pairing_applicable": not pairing.empty,
        "text": (
            f"(C2) reversibility (μ: {mus}) {rev.min():.3f}..{rev.max():.3f}, "
            f"median {rev.median():.3f} vs {uniform.mean():.3f} for the uniform walk on the "
            f"same edges; {pairing_text}"
        ),
    }
    return out
