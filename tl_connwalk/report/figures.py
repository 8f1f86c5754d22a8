"""The report's figures, as PNG files: walks, head defects, drift, the residual and the scale.

Each figure says in its title what is plotted and in which units (every quantity here is
dimensionless), labels both axes and draws its baseline beside every defect (spec §3: a defect
means little without one): random transports for the transport defects and the pairing, as a
band of mean ± `BAND` standard deviations (the page's "below the baseline" is below that
band); the uniform walk on the same edges for reversibility; float rounding for stochasticity
and the identity. Every figure is `WIDTH` inches wide at `DPI`, so all have one pixel width
and the page shows them at one scale. Built on ``matplotlib.figure.Figure`` with the Agg
canvas, never ``pyplot``: no global backend or state is touched.
"""

from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pandas as pd
from matplotlib.artist import Artist
from matplotlib.axes import Axes
from matplotlib.colors import LogNorm
from matplotlib.figure import Figure
from matplotlib.layout_engine import ConstrainedLayoutEngine
from matplotlib.ticker import MaxNLocator

DPI = 110
#: every figure's width in inches (at `DPI`: 1100 pixels)
WIDTH = 10.0
#: the baseline band's half-width in standard deviations over the draws
BAND = 2
SINK_STYLES = {
    "": ("with sink (key 0 kept)", "C0", "-"),
    "_nosink": ("no sink (key 0 dropped)", "C2", "--"),
}
BASELINE_COLOR = "C1"
#: the identity check's pass bound (relative error, float32)
IDENTITY_BOUND = 1e-5
#: the residual figure's height per row of panels, in inches
PANEL_HEIGHT = 3.4


def _layer_axis(ax: Axes, label: str = "layer") -> None:
    ax.set_xlabel(label)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.grid(alpha=0.3)


def _figure(height: float) -> Figure:
    """A `WIDTH` by ``height`` inch figure whose layout keeps every label inside it."""
    return Figure(figsize=(WIDTH, height), layout=ConstrainedLayoutEngine(w_pad=0.08, h_pad=0.08))


def _save(fig: Figure, path: Path) -> Path:
    # the figure's own size, not "tight": every PNG has the same width in pixels
    fig.savefig(path, dpi=DPI)
    return path


def _band(
    ax: Axes, layers: np.ndarray, mean: np.ndarray, std: np.ndarray, color: str, label: str
) -> None:
    """The random baseline: its mean dotted, mean ± `BAND` std shaded and outlined."""
    low, high = mean - BAND * std, mean + BAND * std
    ax.fill_between(layers, low, high, color=color, alpha=0.35, linewidth=0, label=label)
    for edge in (low, high):
        ax.plot(layers, edge, color=color, linewidth=0.9, alpha=0.9)
    ax.plot(layers, mean, color=color, linestyle=":", linewidth=1.8)


def walk_heatmaps(walks: dict[int, np.ndarray], subtitle: str, path: Path) -> Path:
    """``W_ij`` of each layer in ``walks`` (sequence 0) on a log colour scale; zeros grey."""
    layers = sorted(walks)
    fig = _figure(4.2)
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


def _baseline_band(ax: Axes, frame: pd.DataFrame, column: str, color: str, label: str) -> None:
    _band(
        ax,
        frame["layer"].to_numpy(),
        frame[f"{column}_baseline"].to_numpy(),
        frame[f"{column}_baseline_std"].to_numpy(),
        color,
        label,
    )


def _random_label(draws: int) -> str:
    return f"random transports: mean ± {BAND} std ({draws} draws)"


def head_defects(heads: pd.DataFrame, draws: int, subtitle: str, path: Path) -> Path:
    """Every head's ``delta(T^h)`` by layer, their mean, and the random baseline (`_band`).

    The baseline is the same on every layer when the layers' heads have one shape: ``delta``
    ignores the scale, so the matched head norms do not enter, and the draws use one seed.
    """
    fig = _figure(4.8)
    ax = fig.subplots()
    ax.scatter(heads["layer"], heads["head_defect"], s=10, color="0.55", label="one head")
    by_layer = heads.groupby("layer", as_index=False).mean(numeric_only=True)
    ax.plot(by_layer["layer"], by_layer["head_defect"], color="C0", marker="o", ms=3,
            label="mean over heads")  # fmt: skip
    _baseline_band(
        ax, by_layer, "head_defect", BASELINE_COLOR,
        f"random heads of the same shapes, mean over heads: mean ± {BAND} std ({draws} draws)"
        "\n(one value on every layer: δ ignores the heads' norms)",
    )  # fmt: skip
    _layer_axis(ax)
    ax.set_ylabel("isometry defect δ(T^h)\n(0 = scaled partial isometry)")
    ax.set_ylim(bottom=0)
    ax.legend(loc="upper right", fontsize="small", framealpha=0.9)
    fig.suptitle(
        "Head transport defects δ(W_V^h W_O^h), rank r = d_head (dimensionless)\n" + subtitle
    )
    return _save(fig, path)


def layer_drift(drift: dict[str, np.ndarray], subtitle: str, path: Path) -> Path:
    """Layer drift ``(1/n) sum_i TV(W^l_i., W^{l+1}_i.)`` by layer, with and without the sink."""
    fig = _figure(4.6)
    ax = fig.subplots()
    for key, suffix in (("with_sink", ""), ("without_sink", "_nosink")):
        label, color, style = SINK_STYLES[suffix]
        values = drift[key]
        ax.plot(np.arange(len(values)), values, color=color, linestyle=style, marker="o", ms=3,
                label=label)  # fmt: skip
    _layer_axis(ax, "layer l (drift from layer l to l + 1)")
    ax.set_ylabel("mean total variation\nbetween rows of W^l and W^(l+1)")
    ax.set_ylim(0, 1.05 * max(1e-3, *(float(np.max(v)) for v in drift.values() if len(v))))
    ax.legend(loc="best", fontsize="small")
    fig.suptitle(
        "Layer drift: how much the walk changes from one layer to the next "
        "(0 = same walk, 1 = disjoint rows)\n" + subtitle
    )
    return _save(fig, path)


def _defect_panel(ax: Axes, summary: pd.DataFrame, column: str, draws: int) -> None:
    """``column`` with and without the sink, each beside its random baseline band."""
    for suffix, (label, color, style) in SINK_STYLES.items():
        name = column + suffix
        if summary[name].isna().all():
            continue
        ax.plot(summary["layer"], summary[name], color=color, linestyle=style, marker="o",
                ms=3, label=label)  # fmt: skip
        _baseline_band(ax, summary, name, color, f"{_random_label(draws)}, {label}")


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


def _stochasticity_panel(ax: Axes, summary: pd.DataFrame, draws: int, noise: float) -> None:
    ax.plot(summary["layer"], summary["stochasticity"], marker="o", ms=3, color="C0",
            label="measured")  # fmt: skip
    ax.axhline(noise, color=BASELINE_COLOR, linestyle="--", label=f"float rounding {noise:.1e}")
    ax.set_title("(C1) stochasticity\nmax_i |Σ_j W_ij - 1|")
    ax.set_ylabel("residual (0 = rows sum to 1)")
    ax.ticklabel_format(axis="y", style="sci", scilimits=(-3, 3))
    ax.set_ylim(bottom=0)
    ax.legend(loc="best", fontsize="small")


def _reversibility_panel(ax: Axes, summary: pd.DataFrame, draws: int, noise: float) -> None:
    mu = ",".join(sorted(set(",".join(summary["mu"]).split(","))))
    ax.plot(summary["layer"], summary["reversibility"], marker="o", ms=3, color="C0",
            label="measured (sink kept)")  # fmt: skip
    ax.plot(summary["layer"], summary["reversibility_baseline"], color=BASELINE_COLOR,
            linestyle=":", linewidth=2.2, label="uniform walk on the same edges")  # fmt: skip
    ax.set_title(f"(C2) reversibility (μ: {mu})\n‖M - Mᵀ‖/‖M + Mᵀ‖, M = diag(μ)W")
    ax.set_ylabel("residual (0 = detailed balance)")
    ax.set_ylim(0, 1.05)
    ax.legend(loc="best", fontsize="small")


def _pairing_panel(ax: Axes, summary: pd.DataFrame, draws: int, noise: float) -> None:
    _defect_panel(ax, summary, "pairing", draws)
    ax.set_title("(C3) pairing, walk-weighted\n‖T_ji - T_ijᵀ‖/‖T_ij‖")
    ax.set_ylabel("residual (0 = reverse edge transposes)")


def _transport_panel(ax: Axes, summary: pd.DataFrame, draws: int, noise: float) -> None:
    _defect_panel(ax, summary, "transport_defect", draws)
    ax.set_title("(C3 up to scale) effective transport defect\nε(T_ij), walk-weighted")
    ax.set_ylabel("Gram defect ε (0 = scaled isometry)")


def _field_panel(ax: Axes, summary: pd.DataFrame, draws: int, noise: float) -> None:
    _defect_panel(ax, summary, "field_defect", draws)
    ax.set_title("field defect\nwalk-weighted CV of ‖x_j T_ij‖/‖x_j‖")
    ax.set_ylabel("coefficient of variation\n(0 = one factor)")


def _identity_panel(ax: Axes, summary: pd.DataFrame, draws: int, noise: float) -> None:
    errors = summary["identity_error"].clip(lower=1e-17)
    ax.semilogy(summary["layer"], errors, marker="o", ms=3, color="C0", label="measured")
    ax.axhline(IDENTITY_BOUND, color="C3", linestyle="--", label=f"bound {IDENTITY_BOUND:g}")
    ax.set_title("identity\nmax|PX + c - attn out| / max|attn out|")
    ax.set_ylabel("relative error")
    ax.legend(loc="best", fontsize="small")


#: the residual figure's panels, in order; `residual_omissions` says which are left out.
#: Each draws itself on an axis from the summary, the baseline draws and the rounding bound.
RESIDUAL_PANELS = {
    "stochasticity": _stochasticity_panel,
    "reversibility": _reversibility_panel,
    "pairing": _pairing_panel,
    "transport_defect": _transport_panel,
    "field_defect": _field_panel,
    "identity": _identity_panel,
}
#: the panels whose series are the sink kept and excluded beside their random bands: one
#: legend, under the figure or in its empty cell, names them for all
SHARED_LEGEND = ("pairing", "transport_defect", "field_defect")


def residual_components(
    summary: pd.DataFrame, draws: int, subtitle: str, path: Path, noise: float
) -> Path:
    """The laplacian residual's components by layer (spec §2-4), one panel each, two a row.

    Panels with nothing to show (float rounding only, or not applicable) are left out, as
    `residual_omissions` with the same ``noise`` says; the page states them in words.
    """
    omitted = residual_omissions(summary, noise)
    names = [name for name in RESIDUAL_PANELS if name not in omitted]
    n_cols = min(2, len(names))
    n_rows = -(-len(names) // n_cols)
    spare = n_rows * n_cols > len(names)
    fig = _figure(PANEL_HEIGHT * n_rows + (0.8 if spare else 1.5))
    axes = list(fig.subplots(n_rows, n_cols, squeeze=False).flat)
    handles: dict[str, Artist] = {}
    for ax, name in zip(axes, names, strict=False):
        RESIDUAL_PANELS[name](ax, summary, draws, noise)
        _layer_axis(ax)
        if name in SHARED_LEGEND:
            for handle, label in zip(*ax.get_legend_handles_labels(), strict=True):
                handles.setdefault(label, handle)
    for ax in axes[len(names) :]:  # the grid's empty cell holds the shared legend
        ax.set_axis_off()
    if handles and spare:
        axes[-1].legend(handles.values(), handles.keys(), loc="center", fontsize="small")
    elif handles:
        fig.legend(handles.values(), handles.keys(), loc="outside lower center", ncols=2,
                   fontsize="small")  # fmt: skip
    fig.suptitle(
        "Laplacian residual by layer: how far L = I - P is from a random-walk connection "
        "Laplacian\n(all dimensionless; batch means) " + subtitle
    )
    return _save(fig, path)


def effective_scale(summary: pd.DataFrame, subtitle: str, path: Path) -> Path:
    """The common scale ``s`` (walk-weighted ``||T_ij||_F / sqrt(r)``) by layer."""
    fig = _figure(4.8)
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
        "Effective transport scale s = walk-weighted ‖T_ij‖_F / √r, "
        "r = min(d_model, H_kv d_head)\n"
        "(the RMS singular value of the edge transports, of rank up to r: "
        "output norm per unit input norm)\n" + subtitle
    )
    return _save(fig, path)


FIGURES: Sequence[tuple[str, str]] = (
    ("walks.png", "Walk matrices"),
    ("head_defects.png", "Head transport defects"),
    ("layer_drift.png", "Layer drift"),
    ("residual.png", "Laplacian residual"),
    ("scale.png", "Effective scale"),
)
