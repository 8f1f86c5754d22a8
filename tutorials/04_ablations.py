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
# # 4. Ablations: which layers rely on turning, which only on averaging
#
# `tl_connwalk.ablations` patches the transports through the hook points (no weight changes)
# and measures the next-token loss:
#
# | ablation | what the layer keeps |
# | --- | --- |
# | `zero` | nothing (TransformerLens zero-ablation at `hook_z` is the reference) |
# | `mean` | only the average message (mean ablation) |
# | `isometric` | `T^h -> s U V^T`: the head's rotation and overall scale, not its anisotropy |
# | `scalar` | `T^h -> s U U^T`: no turning at all, only scaled averaging of what it reads |
# | `uniform_gates` | the walk, with every head carrying `1/H` of every edge (no gating) |
#
# If a layer's transports were scaled isometries (claim 3), `isometric` would cost nothing.
# If a layer only averages, `scalar` costs little; if it relies on turning, `scalar` costs
# much more than `isometric`. Defaults: every 5th layer, 128 tokens, a few minutes on 2
# CPU cores.

# %% tags=["parameters"]
MODEL = "smollm2-135m"
DEVICE = "cpu"
BACKEND = "hooked"  # "bridge": TransformerBridge, the only backend on TransformerLens 4.x
N_TOKENS = 128
STRIDE = 5

# %%
import matplotlib.pyplot as plt
import numpy as np
import torch

import tl_connwalk
from tl_connwalk import ablations, zoo

torch.set_grad_enabled(False)
model = zoo.load(MODEL, backend=BACKEND, device=DEVICE)
tl_connwalk.attach(model)
tokens = model.to_tokens(zoo.default_text())[:, :N_TOKENS]
layers = list(range(0, model.cfg.n_layers, STRIDE))
sweep = ablations.ablation_sweep(model, tokens, layers=layers, heads=["all"], progress=False)
pivot = sweep.pivot(index="layer", columns="ablation", values="delta_loss")
pivot["tl_zero (hook_z)"] = sweep.groupby("layer")["delta_loss_tl_zero"].first()
print(f"clean loss {sweep['loss_clean'].iloc[0]:.4f} nats/token")
print(pivot.round(4).to_string())

# %% [markdown]
# `zero` and the TransformerLens `hook_z` ablation should agree exactly wherever `b_V = 0`
# (`fold_value_biases`); the next line checks it.

# %%
gap = (pivot["zero"] - pivot["tl_zero (hook_z)"]).abs().max()
print(f"max |zero - hook_z| over layers: {gap:.2e} nats")

# %%
fig, ax = plt.subplots(figsize=(10, 4.8))
for k, name in enumerate(["zero", "mean", "isometric", "scalar", "uniform_gates"]):
    ax.plot(pivot.index, pivot[name], f"C{k}-o", ms=4, label=name)
ax.plot(pivot.index, pivot["tl_zero (hook_z)"], "kx", ms=8, label="TransformerLens zero at hook_z")
ax.axhline(0, color="0.5", lw=1, ls="--", label="clean model (Δ loss = 0)")
# symlog: linear within ±0.01 nats (the TOL used below), logarithmic beyond, so the small
# costs of deep layers and the large ones of layer 0 are both readable
ax.set_yscale("symlog", linthresh=0.01, linscale=0.5)
low = -(10 ** np.ceil(np.log10(max(-pivot.min().min(), 0.01))))  # a decade tick below the data
high = 10 ** np.ceil(np.log10(max(pivot.max().max(), 0.01)))  # and one above
ticks = [t for t in (-10, -1, -0.1, -0.01, 0, 0.01, 0.1, 1, 10, 100) if low <= t <= high]
ax.set_yticks(ticks, labels=[f"{t:g}" for t in ticks])
ax.grid(axis="y", color="0.9")
ax.set_xticks(pivot.index)
ax.set(
    xlabel="layer (all heads of the layer patched)",
    ylabel="Δ loss (nats/token, ablated - clean)",
    title=f"next-token loss change per ablation, {MODEL}, {tokens.shape[-1]} tokens",
)
ax.legend(fontsize=9, loc="upper left", bbox_to_anchor=(1.01, 1.0))
fig.tight_layout()
plt.show()

# %% [markdown]
# ## Turning or averaging, per layer, computed
#
# A layer *relies on turning* when replacing its transports by scalars costs clearly more than
# replacing them by the nearest scaled isometries (`scalar - isometric` above a tolerance of
# `TOL` nats); it *only averages* when `scalar` costs less than `TOL`. The isometric cost says
# how far the layer is from claim 3 in terms of function rather than geometry.

# %%
TOL = 0.01
turning = pivot["scalar"] - pivot["isometric"]
for layer in pivot.index:
    kind = (
        "relies on turning"
        if turning[layer] > TOL
        else "only averages"
        if pivot.loc[layer, "scalar"] < TOL
        else "mixed"
    )
    print(
        f"layer {layer:>2}: isometric {pivot.loc[layer, 'isometric']:+.4f}, scalar "
        f"{pivot.loc[layer, 'scalar']:+.4f}, uniform gates {pivot.loc[layer, 'uniform_gates']:+.4f} -> {kind}"
    )
costly_iso = pivot["isometric"] > TOL
print(
    f"\nlayers where the nearest scaled isometry changes the loss by more than {TOL} nats: "
    f"{int(costly_iso.sum())} of {len(pivot)}; median isometric / zero cost ratio "
    f"{np.median(pivot['isometric'] / pivot['zero'].where(pivot['zero'].abs() > 1e-6)):.3f}"
)

# %% [markdown]
# ## A study at chosen positions: induction loss
#
# `ablation_sweep` reads any metric at any positions. On a random sequence repeated twice, the
# loss on the second copy (each position there predicts a token seen before) is induction loss;
# `positions=` restricts the default next-token loss to those positions (`metric=` takes your
# own function of the logits, or of the logits and the tokens they predict). `uniform_gates`
# with `heads=` shares the gates of chosen heads only; here the whole layer is ablated.

# %%
N_REPEAT = 20
generator = torch.Generator().manual_seed(0)
random_tokens = torch.randint(100, model.cfg.d_vocab, (1, N_REPEAT), generator=generator)
repeated = torch.cat([tokens[:, :1], random_tokens, random_tokens], dim=1).to(DEVICE)  # BOS first
second_copy = list(range(N_REPEAT + 1, 2 * N_REPEAT))  # logits that predict a repeated token
induction = ablations.ablation_sweep(
    model, repeated, ablations=("zero", "scalar", "uniform_gates"), layers=layers,
    heads=["all"], positions=second_copy, progress=False,
)  # fmt: skip
print(f"clean induction loss {induction['loss_clean'].iloc[0]:.4f} nats/token")
print(induction.pivot(index="layer", columns="ablation", values="delta_loss").round(4).to_string())
