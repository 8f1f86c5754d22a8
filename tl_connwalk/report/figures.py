"""The report's figures, as PNG files: walks, head defects, drift, the residual and the scale.

Each figure says in its title what is plotted and in which units (every quantity here is
dimensionless), labels both axes and draws the random baseline beside every defect (spec §3: a
defect means little without one). Built on ``matplotlib.figure.Figure`` with the Agg canvas,
never ``pyplot``: no global backend or state is touched.
"""

from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pandas as pd
from matplotlib.axes import Axes
from matplotlib.colors import LogNorm
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

DPI = 110
SINK_STYLES = {
    "": ("with sink (key 0 kept)", "C0", "-"),
    "_nosink": ("no sink (key 0 dropped)", "C2", "--"),
}
BASELINE_COLOR = "C1"
#: the identity check's pass bound (relative error, float32)
IDENTITY_BOUND = 1e-5


def _layer_axis(ax: Axes, label: str = "layer") -> None:
    ax.set_xlabel(label)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.grid(alpha=0.3)


def _save(fig: Figure, path: Path) -> Path:
    # "tight" grows the canvas to every label, which constrained layout alone can clip
    fig.savefig(path, dpi=DPI, bbox_inches="tight", pad_inches=0.15)
    return path


def walk_heatmaps(walks: dict[int, np.ndarray], subtitle: str, path: Path) -> Path:
    """``W_ij`` of each layer in ``walks`` (sequence 0) on a log colour scale; zeros grey."""
    layers = sorted(walks)
    fig = Figure(figsize=(4.2 * len(layers) + 1.0, 5.0), layout="constrained")
    axes = fig.subplots(1, len(layers), squeeze=False)[0]
    positive = [w[w > 0] for w in walks.values()]
    floor = max(1e-4, min(float(p.min()) for p in positive if p.size))
    norm = LogNorm(vmin=floor, vmax=1.0)
    images = []
    for ax, layer in zip(axes, layers, strict=True):
        walk = np.ma.masked_less_equal(walks[layer], 0.0)
        images.append(ax.imshow(walk, norm=norm, cmap="viridis", interpolation="nearest"))
        ax.set_facecolor("0.85")
        ax.set_title(f"layer {layer}")
        ax.set_xlabel("key position j (sender)")
        ax.set_ylabel("query position i (receiver)")
    bar = fig.colorbar(images[0], ax=list(axes), shrink=0.9)
    bar.set_label("walk weight W_ij (log scale; grey = 0)")
    fig.suptitle(
        "Walk matrix W_ij = mean over heads of attention A^h_ij (dimensionless, rows sum to 1)\n"
        + subtitle
    )
    return _save(fig, path)


def _baseline_band(ax: Axes, frame: pd.DataFrame, column: str, label: str) -> None:
    mean = frame[f"{column}_baseline"].to_numpy()
    std = frame[f"{column}_baseline_std"].to_numpy()
    layers = frame["layer"].to_numpy()
    ax.plot(layers, mean, color=BASELINE_COLOR, linestyle=":", label=label)
    ax.fill_between(layers, mean - std, mean + std, color=BASELINE_COLOR, alpha=0.25)


def head_defects(heads: pd.DataFrame, draws: int, subtitle: str, path: Path) -> Path:
    """Every head's ``delta(T^h)`` by layer, their mean, and the random baseline mean +- std."""
    fig = Figure(figsize=(8.5, 4.8), layout="constrained")
    ax = fig.subplots()
    ax.scatter(heads["layer"], heads["head_defect"], s=10, color="0.55", label="one head")
    by_layer = heads.groupby("layer", as_index=False).mean(numeric_only=True)
    ax.plot(by_layer["layer"], by_layer["head_defect"], color="C0", marker="o", ms=3,
            label="mean over heads")  # fmt: skip
    _baseline_band(
        ax, by_layer, "head_defect", f"random factors, same norms: mean ± std ({draws} draws)"
    )
    _layer_axis(ax)
    ax.set_ylabel("isometry defect δ(T^h) (0 = scaled partial isometry)")
    ax.set_ylim(bottom=0)
    ax.legend(loc="best", fontsize="small")
    fig.suptitle(
        "Head transport defects δ(W_V^h W_O^h), rank r = d_head (dimensionless)\n" + subtitle
    )
    return _save(fig, path)


def layer_drift(drift: dict[str, np.ndarray], subtitle: str, path: Path) -> Path:
    """Layer drift ``(1/n) sum_i TV(W^l_i., W^{l+1}_i.)`` by layer, with and without the sink."""
    fig = Figure(figsize=(8.5, 4.6), layout="constrained")
    ax = fig.subplots()
    for key, suffix in (("with_sink", ""), ("without_sink", "_nosink")):
        label, color, style = SINK_STYLES[suffix]
        values = drift[key]
        ax.plot(np.arange(len(values)), values, color=color, linestyle=style, marker="o", ms=3,
                label=label)  # fmt: skip
    _layer_axis(ax, "layer l (drift from layer l to l + 1)")
    ax.set_ylabel("mean total variation between rows of W^l and W^(l+1)")
    ax.set_ylim(0, 1.05 * max(1e-3, *(float(np.max(v)) for v in drift.values() if len(v))))
    ax.legend(loc="best", fontsize="small")
    fig.suptitle(
        "Layer drift: how much the walk changes from one layer to the next "
        "(0 = same walk, 1 = disjoint rows)\n" + subtitle
    )
    return _save(fig, path)


def _defect_panel(ax: Axes, summary: pd.DataFrame, column: str, draws: int) -> None:
    for suffix, (label, color, style) in SINK_STYLES.items():
        name = column + suffix
        ax.plot(summary["layer"], summary[name], color=color, linestyle=style, marker="o",
                ms=3, label=label)  # fmt: skip
        mean = summary[f"{name}_baseline"].to_numpy()
        std = summary[f"{name}_baseline_std"].to_numpy()
        ax.plot(summary["layer"], mean, color=color, linestyle=":", alpha=0.9,
                label=f"random ± std ({draws} draws), {label}")  # fmt: skip
        ax.fill_between(summary["layer"], mean - std, mean + std, color=color, alpha=0.2)
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=1, fontsize="x-small")


def residual_omissions(summary: pd.DataFrame, noise: float) -> dict[str, str]:
    """The residual figure's panels with nothing to show, each with the sentence that replaces it.

    ``"stochasticity"`` when every layer's ``max_i |Σ_j W_ij - 1|`` is at most ``noise`` (float
    rounding of a row sum), ``"pairing"`` when no layer has an edge in both directions (causal
    walks: not applicable), ``"identity"`` when every layer's relative error is within
    `IDENTITY_BOUND`. A panel whose numbers carry information is never left out.
    """
    omitted = {}
    worst = float(summary["stochasticity"].max())
    if worst <= noise:
        omitted["stochasticity"] = (
            f"(C1) stochasticity is not drawn: every walk row sums to 1 up to float rounding "
            f"on every layer (max_i |Σ_j W_ij - 1| = {worst:.1e}, rounding bound {noise:.1e})."
        )
    pairing = [column for column in ("pairing", "pairing_nosink") if column in summary]
    if all(summary[column].isna().all() for column in pairing):
        omitted["pairing"] = (
            "(C3) pairing is not drawn: not applicable, causal walks have no edge in both "
            "directions."
        )
    worst = float(summary["identity_error"].max())
    if worst <= IDENTITY_BOUND:
        omitted["identity"] = (
            f"The identity PX + c = attention output is not drawn: it holds on every layer "
            f"(worst relative error {worst:.1e}, bound {IDENTITY_BOUND:g})."
        )
    return omitted


def _stochasticity_panel(ax: Axes, summary: pd.DataFrame, draws: int) -> None:
    ax.plot(summary["layer"], summary["stochasticity"], marker="o", ms=3, color="C0")
    ax.set_title("(C1) stochasticity\nmax_i |Σ_j W_ij - 1|")
    ax.set_ylabel("residual (0 = rows sum to 1)")
    ax.ticklabel_format(axis="y", style="sci", scilimits=(-3, 3))
    ax.set_ylim(bottom=0)


def _reversibility_panel(ax: Axes, summary: pd.DataFrame, draws: int) -> None:
    mu = ",".join(sorted(set(",".join(summary["mu"]).split(","))))
    ax.plot(summary["layer"], summary["reversibility"], marker="o", ms=3, color="C0")
    ax.set_title(f"(C2) reversibility (μ: {mu})\n‖M - Mᵀ‖/‖M + Mᵀ‖, M = diag(μ)W")
    ax.set_ylabel("residual (0 = detailed balance)")
    ax.set_ylim(0, 1.05)


def _pairing_panel(ax: Axes, summary: pd.DataFrame, draws: int) -> None:
    ax.set_title("(C3) pairing, walk-weighted\n‖T_ji - T_ijᵀ‖/‖T_ij‖")
    ax.set_ylabel("residual (0 = reverse edge transposes)")
    for suffix, (label, color, style) in SINK_STYLES.items():
        ax.plot(summary["layer"], summary["pairing" + suffix], color=color, linestyle=style,
                marker="o", ms=3, label=label)  # fmt: skip
    ax.legend(loc="best", fontsize="x-small")


def _transport_panel(ax: Axes, summary: pd.DataFrame, draws: int) -> None:
    _defect_panel(ax, summary, "transport_defect", draws)
    ax.set_title("(C3 up to scale) effective transport defect\nε(T_ij), walk-weighted")
    ax.set_ylabel("Gram defect ε (0 = scaled isometry)")


def _field_panel(ax: Axes, summary: pd.DataFrame, draws: int) -> None:
    _defect_panel(ax, summary, "field_defect", draws)
    ax.set_title("field defect\nwalk-weighted CV of ‖x_j T_ij‖/‖x_j‖")
    ax.set_ylabel("coefficient of variation (0 = one factor)")


def _identity_panel(ax: Axes, summary: pd.DataFrame, draws: int) -> None:
    errors = summary["identity_error"].clip(lower=1e-17)
    ax.semilogy(summary["layer"], errors, marker="o", ms=3, color="C0", label="measured")
    ax.axhline(IDENTITY_BOUND, color="C3", linestyle="--", label=f"bound {IDENTITY_BOUND:g}")
    ax.set_title("identity\nmax|PX + c - attn out| / max|attn out|")
    ax.set_ylabel("relative error")
    ax.legend(loc="best", fontsize="x-small")


#: the residual figure's panels, in order; `residual_omissions` says which are left out
RESIDUAL_PANELS = {
    "stochasticity": _stochasticity_panel,
    "reversibility": _reversibility_panel,
    "pairing": _pairing_panel,
    "transport_defect": _transport_panel,
    "field_defect": _field_panel,
    "identity": _identity_panel,
}


def residual_components(
    summary: pd.DataFrame, draws: int, subtitle: str, path: Path, noise: float
) -> Path:
    """The laplacian residual's components by layer (spec §2-4), one panel each.

    Panels with nothing to show (float rounding only, or not applicable) are left out, as
    `residual_omissions` with the same ``noise`` says; the page states them in words.
    """
    omitted = residual_omissions(summary, noise)
    panels = [draw for name, draw in RESIDUAL_PANELS.items() if name not in omitted]
    n_cols = min(3, len(panels))
    n_rows = -(-len(panels) // n_cols)
    fig = Figure(figsize=(5 * n_cols, 4.25 * n_rows + 0.5), layout="constrained")
    axes = list(fig.subplots(n_rows, n_cols, squeeze=False).flat)
    for ax, draw in zip(axes, panels, strict=False):
        draw(ax, summary, draws)
        _layer_axis(ax)
    for ax in axes[len(panels) :]:  # the grid's empty cells
        ax.set_visible(False)
    fig.suptitle(
        "Laplacian residual by layer: how far L = I - P is from a random-walk connection "
        "Laplacian (all dimensionless; batch means)\n" + subtitle
    )
    return _save(fig, path)


def effective_scale(summary: pd.DataFrame, subtitle: str, path: Path) -> Path:
    """The common scale ``s`` (walk-weighted ``||T_ij||_F / sqrt(r)``) by layer."""
    fig = Figure(figsize=(8.5, 4.6), layout="constrained")
    ax = fig.subplots()
    values = []
    for suffix, (label, color, style) in SINK_STYLES.items():
        column = summary["scale" + suffix]
        values.append(column.to_numpy())
        ax.plot(summary["layer"], column, color=color, linestyle=style, marker="o", ms=3,
                label=label)  # fmt: skip
    flat = np.concatenate(values)
    positive = flat[flat > 0]
    if positive.size and positive.max() / positive.min() > 30:
        ax.set_yscale("log")
        ax.set_ylabel("scale s (log axis)")
    else:
        ax.set_ylabel("scale s")
        ax.set_ylim(bottom=0)
    _layer_axis(ax)
    ax.legend(loc="best", fontsize="small")
    fig.suptitle(
        "Effective transport scale s = walk-weighted ‖T_ij‖_F / √r "
        "(r = min(d_model, H_kv d_head): the rank the transports can have)\n"
        "(RMS singular value of the edge transports: output norm per unit input norm)\n" + subtitle
    )
    return _save(fig, path)


FIGURES: Sequence[tuple[str, str]] = (
    ("walks.png", "Walk matrices"),
    ("head_defects.png", "Head transport defects"),
    ("layer_drift.png", "Layer drift"),
    ("residual.png", "Laplacian residual"),
    ("scale.png", "Effective scale"),
)
