# ---
# jupyter:
#   jupytext:
#     formats: ipynb,py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#       format_version: '1.3'
#       jupytext_version: 1.19.6
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # 5. Encoders, decoders and scale
#
# The same measurements on every model `tl_connwalk.zoo` can load, side by side, on relative
# depth `l / (n_layers - 1)`:
#
# - claim 2 (deeper layers settle): layer drift against depth, with and without the sink;
# - claim 3 (scaled isometries): each defect divided by its random baseline (below 1 = more
#   isometric than random Gaussian transports of the same shapes, value-head sharing and norms);
# - claim 4 (both strengthen with scale): whether larger models do better on the two above;
# - reversibility (C2) and pairing, which only an encoder's bidirectional walk can satisfy.
#
# `gemma3-270m` takes about 90 s and 8 GB of memory just to load on a CPU, too slow for the
# default CI run: it is off by default (`INCLUDE_GEMMA = True` to add it; on a GPU add any
# other TransformerLens model to `MODELS`).

# %% tags=["parameters"]
MODELS = ["smollm2-135m", "minilm-l6"]
INCLUDE_GEMMA = False
DEVICE = "cpu"
BACKEND = "hooked"  # "bridge": TransformerBridge, the only backend on TransformerLens 4.x
N_TOKENS = 128
LAYERS_PER_MODEL = 6  # geometry is measured on this many evenly spaced layers
BASELINE_DRAWS = 3

# %%
import gc

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
import torch

import tl_connwalk
from tl_connwalk import zoo

torch.set_grad_enabled(False)
if INCLUDE_GEMMA and "gemma3-270m" not in MODELS:
    MODELS = [*MODELS, "gemma3-270m"]
text = zoo.default_text()


def is_encoder(model):
    return model.cfg.attention_dir == "bidirectional"  # BERT-style encoders


def tokens_for(model):
    if is_encoder(model):
        return model.tokenizer(
            text[: 20 * N_TOKENS], return_tensors="pt", truncation=True, max_length=N_TOKENS
        )["input_ids"].to(DEVICE)
    return model.to_tokens(text[: 20 * N_TOKENS])[:, :N_TOKENS]


results, drifts, info = [], {}, {}
for name in MODELS:
    model = zoo.load(name, backend=BACKEND, device=DEVICE)
    tl_connwalk.attach(model)
    _, cache = model.run_with_cache(tokens_for(model))
    n_layers = model.cfg.n_layers
    layers = sorted(
        set(
            np.linspace(0, n_layers - 1, min(LAYERS_PER_MODEL, n_layers))
            .round()
            .astype(int)
            .tolist()
        )
    )
    for sink in (False, True):
        t = tl_connwalk.geometry_table(
            cache, layers, exclude_sink=sink, baseline_draws=BASELINE_DRAWS, progress=False
        )
        t = t[t["head"] == "all"].assign(model=name, exclude_sink=sink)
        t["depth"] = t["layer"] / max(n_layers - 1, 1)
        results.append(t)
        drifts[name, sink] = tl_connwalk.layer_drift(cache, exclude_sink=sink).mean(0).cpu().numpy()
    info[name] = dict(
        kind="encoder" if is_encoder(model) else "decoder",
        params=sum(p.numel() for p in model.parameters()),
        layers=n_layers,
        heads=model.cfg.n_heads,
        d_model=model.cfg.d_model,
    )
    del model, cache
    gc.collect()
table = pd.concat(results, ignore_index=True)
print(pd.DataFrame(info).T.to_string())

# %% [markdown]
# ## Defects relative to their random baselines

# %%
measures = [
    ("head_defect", "head defect / baseline"),
    ("transport_defect", "effective transport defect / baseline"),
    ("field_defect", "field defect / baseline (sink excluded)"),
]
fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
for ax, (m, title) in zip(axes, measures, strict=True):
    sink = m == "field_defect"
    for k, name in enumerate(MODELS):
        t = table[(table["model"] == name) & (table["exclude_sink"] == sink)]
        ratio = t[m] / t[f"{m}_baseline"]
        rel_std = 2 * t[f"{m}_baseline_std"] / t[f"{m}_baseline"]
        ax.plot(t["depth"], ratio, f"C{k}-o", ms=4, label=f"{name} ({info[name]['kind']})")
        ax.fill_between(t["depth"], 1 - rel_std, 1 + rel_std, color=f"C{k}", alpha=0.15)
    ax.axhline(1, color="k", ls="--", lw=1, label="random baseline (bands: ± 2 std)")
    ax.set(
        title=title,
        xlabel="relative depth l / (n_layers - 1)",
        ylabel="measured / random mean (1 = random)",
    )
    ax.legend(fontsize=7)
fig.tight_layout()
plt.show()

# %% [markdown]
# ## Layer drift against relative depth

# %%
fig, ax = plt.subplots(figsize=(8, 4.2))
for k, name in enumerate(MODELS):
    for sink, style in ((False, "-o"), (True, ":s")):
        d = drifts[name, sink]
        ax.plot(
            np.arange(len(d)) / max(len(d) - 1, 1),
            d,
            f"C{k}{style}",
            ms=3,
            label=f"{name}" + (", sink excluded" if sink else ""),
        )
ax.set(
    xlabel="relative depth of the transition l -> l+1",
    ylabel="mean row TV distance (0-1)",
    title="layer drift",
    ylim=(0, 1),
)
ax.legend(fontsize=7)
fig.tight_layout()
plt.show()

# %% [markdown]
# ## Reversibility and pairing
#
# A decoder's causal walk cannot be reversible (only the attention sink carries its stationary
# distribution, and the library falls back to uniform `mu`), and it has no reverse edges to
# pair. An encoder's bidirectional walk can satisfy (C2) approximately; the pairing residual
# `||T_ji - T_ij^T|| / ||T_ij||` measures the transport half of (C3).

# %%
cols = ["reversibility", "mu_kind", "pairing", "scale"]
print(
    table[~table["exclude_sink"]]
    .groupby("model")[["reversibility", "pairing", "scale"]]
    .mean()
    .round(4)
    .to_string()
)
print(table[~table["exclude_sink"]][["model", "layer", *cols]].round(4).to_string(index=False))

# %% [markdown]
# ## The verdicts, computed
#
# Claim 2 holds for a model when its drift falls with depth (negative slope against relative
# depth and last third below first third). Claim 3 holds for a defect when most measured layers
# sit more than 2 baseline std below the baseline mean. Claim 4 asks whether the larger model
# does better; with the few, architecturally different models here that comparison confounds
# scale with architecture and training, and the printout says so.


# %%
def settles(d):
    slope = np.polyfit(np.arange(len(d)) / max(len(d) - 1, 1), d, 1)[0]
    third = max(len(d) // 3, 1)
    return slope, bool(slope < 0 and d[-third:].mean() < d[:third].mean())


rows = []
for name in MODELS:
    row = {"model": name, "params (M)": info[name]["params"] / 1e6}
    for sink in (False, True):
        slope, ok = settles(drifts[name, sink])
        row[f"drift slope{' (no sink)' if sink else ''}"] = slope
        row[f"claim 2{' (no sink)' if sink else ''}"] = ok
    t = table[(table["model"] == name) & (table["exclude_sink"])]
    for m, _ in measures:
        below = (t[m] < t[f"{m}_baseline"] - 2 * t[f"{m}_baseline_std"]).mean()
        row[f"{m} ratio"] = float(np.median(t[m] / t[f"{m}_baseline"]))
        row[f"claim 3: {m}"] = bool(below > 0.5)
    rows.append(row)
verdicts = pd.DataFrame(rows).set_index("model")
print(verdicts.round(3).T.to_string())

by_size = verdicts.sort_values("params (M)")
if len(by_size) >= 2:
    ratios = by_size[[f"{m} ratio" for m, _ in measures]].to_numpy()
    better = np.all(np.diff(ratios, axis=0) < 0, axis=0)
    print(
        "\nclaim 4 (defect ratio falls with parameter count):",
        {m: bool(b) for (m, _), b in zip(measures, better, strict=True)},
    )
    print(
        "caveat: these models differ in architecture (encoder vs decoder, attention variant) "
        "and training data as well as size, so this is not a controlled scaling test."
    )
