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
# # 6. An induction circuit, found with attributions and checked by intervention
#
# On a sequence of random tokens repeated once, `[BOS] r_0 ... r_{n-1} r_0 ... r_{n-2}`, a
# language model predicts `r_{n-1}` at the last position by *induction*: a head at the last
# position attends to the token after the previous occurrence of the current token and
# copies it. This notebook finds that circuit on SmolLM2-135M with `tl_connwalk.attribute`
# alone (which source token, which heads, which edges), then checks each finding by
# intervention: against knockout (each source blocked from every other query) and against
# TransformerLens activation patching at `hook_z`. It ends with the faithfulness numbers of
# these examples for every method, and the limits of what the attributions say.
#
# Runs on one CPU core in about three minutes with the defaults.

# %% tags=["parameters"]
MODEL = "smollm2-135m"
DEVICE = "cpu"
N_RANDOM = 8  # random tokens before the repeat
N_SEQUENCES = 4
SEED = 0

# %%
from typing import get_args

import numpy as np
import pandas as pd
import torch

import tl_connwalk
from tl_connwalk import zoo
from tl_connwalk.attribution import api, baselines
from tl_connwalk.cache import connection_walk, required_hooks

model = zoo.load(MODEL, device=DEVICE, progress=False)
generator = torch.Generator().manual_seed(SEED)
# ordinary vocabulary ids (no special tokens), drawn without replacement per sequence
random = torch.stack(
    [1000 + torch.randperm(20000, generator=generator)[:N_RANDOM] for _ in range(N_SEQUENCES)]
)
bos = torch.full((N_SEQUENCES, 1), model.tokenizer.bos_token_id)
tokens = torch.cat([bos, random, random[:, :-1]], 1).to(DEVICE)
answer = random[:, -1].to(DEVICE)  # the induction prediction at the last position
first = N_RANDOM  # the position of the answer's first occurrence (BOS is position 0)
with torch.no_grad():
    logits = model(tokens)[:, -1]
rank = (logits > logits.gather(1, answer[:, None])).sum(1)
print("tokens per sequence:", tokens.shape[1])
print("rank of the induction answer among the model's predictions:", rank.tolist())

# %% [markdown]
# ## Which source tokens? `attribute`
#
# The target is the logit of the answer at the last position (TransformerLens centres the
# unembedding, so it is `logit - mean(logits)`). The connection method splits it exactly over
# the source tokens: the scores and the bias add up to the model's own logit.

# %%
result = tl_connwalk.attribute(model, tokens, target=answer, position=-1)
assert torch.allclose(result.scores.sum(-1) + result.bias, result.target_value, atol=1e-3)
labels = ["BOS"] + [f"r{i}" for i in range(N_RANDOM)] + [f"r{i}'" for i in range(N_RANDOM - 1)]
scores = pd.DataFrame(result.scores.detach().numpy(), columns=labels)
print(scores.round(2).to_string())
print("top source per sequence:", [labels[i] for i in result.scores.argmax(-1).tolist()])

# %% [markdown]
# The answer's first occurrence (`r7`, position 8) and the current token's copy (`r6'`, the
# last position) should stand out: the first is what an induction head copies, the second
# what its query matches against (through a previous-token head, the key side reads `r6`,
# position 7).
#
# ## Checked against knockout
#
# Knockout blocks one source at a time from every other query, in every layer, and measures
# the drop of the same logit: ground truth by intervention, one forward pass per source.
# It cannot see the last position itself (its own residual stream is never blocked), so the
# comparison leaves it out.


# %%
def spearman(a, b):
    ra, rb = (pd.Series(np.asarray(x, dtype=float)).rank().to_numpy() for x in (a, b))
    return float(np.corrcoef(ra, rb)[0, 1])


knock = tl_connwalk.attribute(model, tokens, target=answer, position=-1, method="knockout")
earlier = slice(0, tokens.shape[1] - 1)
for b in range(N_SEQUENCES):
    c, k = result.scores[b, earlier].detach(), knock.scores[b, earlier]
    print(
        f"sequence {b}: top source by connection {labels[int(c.argmax())]:>4}, "
        f"by knockout {labels[int(k.argmax())]:>4}; Spearman {spearman(c, k):+.2f}"
    )

# %% [markdown]
# The two methods answer different questions: the connection method what each source *sent*
# along the paths the model used, knockout what would *change* without it, the attention
# re-forming around the gap. `method="knockout_estimate"` predicts knockout from one forward
# and one backward pass (the renormalised attention of a blocked key, edge by edge, read along
# the model's gradient), with the first position and the one nearest the target knocked out
# for real. `verify(k)` measures knockout on the `k` largest predictions beside them.

# %%
estimate = tl_connwalk.attribute(
    model, tokens, target=answer, position=-1, method="knockout_estimate"
)
for b in range(N_SEQUENCES):
    p, k = estimate.scores[b, earlier], knock.scores[b, earlier]
    print(
        f"sequence {b}: top source predicted {labels[int(p.argmax())]:>4}, "
        f"by knockout {labels[int(k.argmax())]:>4}; Spearman {spearman(p, k):+.2f}"
    )
checked = estimate.verify(3)
checked["source"] = [labels[s] for s in checked["source"]]
print(checked.round(3).to_string())

# %% [markdown]
# `edges(layer)` of the estimate is the predicted effect of blocking one edge (one layer, one
# head, one query, one key): the edges whose loss would hurt the induction most. Each is then
# blocked for real at `hook_attn_scores`, alone, to compare.

# %%
predicted = torch.stack([estimate.edges(layer).mean(0) for layer in range(model.cfg.n_layers)])
top_edges = predicted.flatten().topk(5).indices
rows = []
for index in top_edges.tolist():
    layer, head, query, key = np.unravel_index(index, predicted.shape)

    def block(scores, hook, head=head, query=query, key=key):
        scores = scores.clone()
        scores[:, head, query, key] = float("-inf")
        return scores

    with torch.no_grad():
        out = model.run_with_hooks(
            tokens, fwd_hooks=[(f"blocks.{layer}.attn.hook_attn_scores", block)]
        )[:, -1]
    blocked_logit = out.gather(1, answer[:, None])[:, 0]
    rows.append(
        {
            "edge": f"L{layer}H{head}: {labels[key]} -> {labels[query]}",
            "predicted drop": float(predicted[layer, head, query, key]),
            "measured drop": float((estimate.target_value - blocked_logit).mean()),
        }
    )
print(pd.DataFrame(rows).round(3).to_string(index=False))

# %% [markdown]
# ## Which heads? `by_component`
#
# `by_component()` splits each source's score over the components that write to the residual
# stream at the last position (their direct paths). Summed over the sequences, the heads that
# move most of the answer token's score (source `r7`) are the induction candidates.

# %%
parts = result.by_component().detach()  # [batch, component, source]
names = result.component_names()
from_answer = pd.Series(parts[:, :, first].mean(0).numpy(), index=names)
heads = from_answer[[n.startswith("L") and "H" in n for n in names]]
candidates = heads.sort_values(ascending=False).head(5)
print("mean direct share of the answer token r7, by head (top 5):")
print(candidates.round(3).to_string())
print(f"all heads together: {heads.sum():.3f}; the score of r7: {scores['r7'].mean():.3f}")

# %% [markdown]
# The same attribution, to look at: the source tokens coloured by score (the target position
# marked), the layer-by-head grid of each component's direct path, and each layer's strongest
# edges as arcs. Click a token (`r7`) to see which heads carry it; the grid shows the
# candidates above lighting up. `result.to_html(path)` writes the same page to a file that
# any browser opens offline.

# %%
result.show(str_tokens=labels)

# %% [markdown]
# ## Which edges? `edges(layer)`
#
# `edges(layer)` gives the share of the target each edge `j -> i` of a layer carries. An
# induction head's edge goes from the last query to the answer's first occurrence (key
# position 8).

# %%
for name in candidates.index[:3]:
    layer, head = (int(x) for x in name[1:].split("H"))
    e = result.edges(layer).detach()[:, head]  # [batch, query, key]
    at_last = e[:, -1]  # the last query's edges
    share = (at_last[:, first] / at_last.abs().sum(-1)).mean()
    print(
        f"{name}: edge last -> r7 carries {at_last[:, first].mean():+.3f} "
        f"({share:.0%} of that query's absolute edge total)"
    )

# %% [markdown]
# The top head need not be the induction head itself: a late head can move what an earlier
# induction head already wrote to the last position. The induction layer is the one whose
# edges from the last query to `r7` carry the most of the target. Here it is as a connection
# walk, each edge numbered by its share of the target (`edges(layer)`, summed over heads and
# per head): the walk `W` as a heatmap, the gates and per-head patterns of the edge under the
# pointer, and a query's incoming edges as arcs. Click the last query to see its edge to `r7`.

# %%
to_answer = torch.stack(
    [result.edges(layer)[:, :, -1, first].sum(-1).mean() for layer in range(model.cfg.n_layers)]
).detach()
induction_layer = int(to_answer.argmax())
print(f"layer {induction_layer}: its edges last -> r7 carry {to_answer[induction_layer]:+.3f}")
with torch.no_grad():
    _, layer_cache = model.run_with_cache(
        tokens, names_filter=required_hooks(model, [induction_layer])
    )
walk = connection_walk(layer_cache, induction_layer, model)
shares = result.edges(induction_layer).detach()  # [batch, head, query, key]
walk.show(str_tokens=labels, edge_contributions=shares.sum(1), head_contributions=shares)

# %% [markdown]
# ## Checked against `hook_z` patching
#
# Activation patching, the usual intervention for heads: run a corrupted input (the same
# repeat structure broken: a fresh first half, so the last token has no earlier occurrence),
# and put one head's `hook_z` at the last position from the corrupted run into the clean
# run. The drop of the answer's logit is the head's total effect (direct and through later
# layers); the attribution above is its direct path only, so the two should agree on which
# heads matter, not on every value.

# %%
fresh = torch.stack(
    [1000 + torch.randperm(20000, generator=generator)[:N_RANDOM] for _ in range(N_SEQUENCES)]
)
corrupt = torch.cat([bos, fresh.to(DEVICE), random[:, :-1].to(DEVICE)], 1)
with torch.no_grad():
    _, corrupt_cache = model.run_with_cache(corrupt, names_filter=lambda n: n.endswith("hook_z"))
    clean_logit = model(tokens)[:, -1].gather(1, answer[:, None])[:, 0]


def patched_drop(layer: int) -> torch.Tensor:
    """[head] the mean drop of the answer's logit with each head of `layer` patched (one
    batched pass: one copy of the batch per head)."""
    n_heads = model.cfg.n_heads
    rows = torch.arange(n_heads).repeat_interleave(N_SEQUENCES)

    def patch(z, hook):
        z = z.clone()
        source = corrupt_cache[hook.name].repeat(n_heads, 1, 1, 1)
        z[torch.arange(len(rows)), -1, rows] = source[torch.arange(len(rows)), -1, rows]
        return z

    with torch.no_grad():
        out = model.run_with_hooks(
            tokens.repeat(n_heads, 1), fwd_hooks=[(f"blocks.{layer}.attn.hook_z", patch)]
        )[:, -1]
    logit = out.gather(1, answer.repeat(n_heads)[:, None])[:, 0].reshape(n_heads, N_SEQUENCES)
    return (clean_logit[None] - logit).mean(1)


direct = pd.Series(parts.sum(-1).mean(0).numpy(), index=names)  # every source, by component
layers = sorted({int(n[1:].split("H")[0]) for n in candidates.index})
rows = []
for layer in layers:
    drops = patched_drop(layer)
    for head, drop in enumerate(drops.tolist()):
        rows.append(
            {
                "head": f"L{layer}H{head}",
                "hook_z patch drop": drop,
                "direct": direct[f"L{layer}H{head}"],
            }
        )
table = pd.DataFrame(rows).set_index("head").sort_values("hook_z patch drop", ascending=False)
print(table.round(3).to_string())
print(
    f"rank agreement over these heads: Spearman "
    f"{spearman(table['hook_z patch drop'], table['direct']):+.2f}"
)

# %% [markdown]
# ## Faithfulness of every method on these examples
#
# Each method of `attribute` against knockout on the same four targets: Spearman's rank
# correlation over the earlier sources, and comprehensiveness (the drop when the method's
# top two sources are blocked, as knockout blocks them: higher is better). The benchmark
# `benchmarks/faithfulness.py` does the same at scale, with the peers' packages beside
# these methods; its results are on the [faithfulness page](../faithfulness.md).

# %%
methods = [m for m in get_args(api.Method) if m != "knockout"]
summary = {}
for method in methods:
    r = (
        result
        if method == "connection"
        else tl_connwalk.attribute(model, tokens, target=answer, position=-1, method=method)
    )
    top = r.scores[:, earlier].detach().topk(2, dim=-1).indices
    keys = torch.zeros(1, *tokens.shape, dtype=torch.bool)
    keys[0, torch.arange(N_SEQUENCES)[:, None], top] = True
    blocked = baselines.block_keys(
        model, tokens, keys, lambda logits, final: logits[:, -1].gather(1, answer[:, None])[:, 0]
    )[0]
    summary[method] = {
        "Spearman vs knockout": np.mean(
            [
                spearman(r.scores[b, earlier].detach(), knock.scores[b, earlier])
                for b in range(N_SEQUENCES)
            ]
        ),
        "drop, top 2 blocked": float((clean_logit - blocked).mean()),
    }
top_knock = knock.scores[:, earlier].topk(2, dim=-1).indices
keys = torch.zeros(1, *tokens.shape, dtype=torch.bool)
keys[0, torch.arange(N_SEQUENCES)[:, None], top_knock] = True
blocked = baselines.block_keys(
    model, tokens, keys, lambda logits, final: logits[:, -1].gather(1, answer[:, None])[:, 0]
)[0]
summary["knockout (its own top 2)"] = {
    "Spearman vs knockout": 1.0,
    "drop, top 2 blocked": float((clean_logit - blocked).mean()),
}
print(pd.DataFrame(summary).T.round(2).to_string())

# %% [markdown]
# ## Limits
#
# - The connection scores are exact for the **frozen** network: attention patterns,
#   normalisation scales and MLP gains fixed at the clean run. Knockout changes the patterns
#   (a blocked key's weight goes to the other keys) and the norms; where those changes
#   matter the two disagree, and neither is wrong: they answer different questions ("what
#   did `e_s` send along the paths the model used" against "what happens if nobody may read
#   position `s`"). The freeze ladder on the faithfulness page measures which of these
#   linearisations separates them; `method="knockout_estimate"` answers knockout's question,
#   to first order beyond the sources it knocks out for real, and `verify` shows its error.
# - Knockout cannot score the target position itself, so the comparisons leave it out; the
#   connection method gives it its (often large) share.
# - `by_component` is the direct path of each head; patching `hook_z` measures the total
#   effect, through later layers as well. A head that matters only through others (a
#   previous-token head, which feeds the induction head's keys) has a small direct share and
#   a large patching effect: look for it in `edges` of the earlier layers, or attribute to a
#   target inside the network.
# - Four sequences of random tokens are a small sample; the numbers above are for these
#   examples, the benchmark gives intervals over hundreds of targets.
