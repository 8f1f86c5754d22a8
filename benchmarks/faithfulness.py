"""How faithful each attribution method is: every method scored on the same targets in one run.

    OMP_NUM_THREADS=1 PYTHONPATH=.extras .venv/bin/python benchmarks/faithfulness.py --out DIR
    ... benchmarks/faithfulness.py --quick --out DIR       # a CI-size check (a minute or two)

Models (`tl_connwalk.zoo`): ``smollm2-135m`` and ``gemma3-270m`` (HookedTransformer, their
usual processing: the unembedding is centred, so every logit is ``logit - mean(logits)``),
``minilm-l6`` (HookedEncoder). Texts: the bundled English text
(`tl_connwalk.zoo.default_text`) and Python code (the standard library's ``textwrap.py``, read
at run time), cut into windows of ``--tokens`` tokens at evenly spaced places.

Targets (each the centred logit of the true token):

- decoders: in each window, the next token at every position ``p >= MIN_POSITION`` (kind
  ``every``), the last position among them (kind ``last``);
- the encoder: each position ``p`` of the window masked in turn (one input each), the
  original token's logit at ``p`` (kind ``masked``).

Methods: every ``attribute`` method (`tl_connwalk.attribution.api.Method`, knockout aside),
and the peers' own packages where installed (``pip install tl_connwalk[bench]``): ``captum``
Integrated Gradients over the embeddings (zero baseline, ``IG_STEPS`` Gauss-Legendre steps,
its convergence delta reported) and ``lxt`` AttnLRP (its efficient mode, on the Hugging Face
model of the same weights, `tl_connwalk.zoo.hf_dir`; relevance = gradient x input at the
input embeddings of the centred logit).

Scores, per target, against knockout (`tl_connwalk.attribution.baselines.knockout`: the
target's drop when no other query may attend to a source):

- ``spearman``: Spearman's rank correlation with knockout over the sources the target can
  depend on through attention (earlier positions in a decoder, all in an encoder) and knockout
  can measure (not the target position itself: its own residual stream is never blocked);
- ``comprehensiveness`` (deletion, higher is better) and ``sufficiency`` (insertion, lower is
  better), AOPC-style on the curve targets (the ``last`` and one ``masked`` per window): the
  mean over ``FRACTIONS`` of ``y - y(top k% blocked)`` and of ``y - y(all but the top k%
  blocked)``, keys blocked as knockout blocks them (`baselines.block_keys`). A random ranking
  is the reference row;
- cost: seconds per target, and in forward-pass equivalents (seconds over those of one
  ``run_with_cache`` of the window, timed in the same run).

Means come with 95% bootstrap intervals that resample windows (targets of one window are not
independent). Decoders also get the freeze ladder: knockout recomputed with the normalisation
scales frozen, the MLP gains frozen, or both (as the connection method freezes them), and
its rank correlation with the connection scores; where freezing a kind of nonlinearity brings
knockout to the connection method, that linearisation is what separates them.

Writes ``DIR/faithfulness.csv`` (one row per target and method), ``DIR/ladder.csv``,
``DIR/problems.json`` (why a method did not run) and ``DIR/faithfulness.md`` (the tables), and
prints the tables. A long run can be split: ``--pick`` runs some windows of the ``--windows``
layout, and ``--merge DIR1 DIR2 ... --out DIR`` writes the tables of several runs' targets
together (each run's windows stay separate clusters of the bootstrap).
"""

import argparse
import contextlib
import csv
import dataclasses
import datetime
import importlib.metadata
import json
import math
import platform
import statistics
import sys
import textwrap
import time
import types
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, ClassVar, get_args

import numpy as np
import torch
from torch import Tensor, nn

import tl_connwalk
import tl_connwalk.zoo
from tl_connwalk.adapters.hooked_transformer import is_encoder
from tl_connwalk.attribution import api, baselines
from tl_connwalk.attribution.frozen import EMBEDDING_HOOKS, FrozenNetwork

#: the methods of `attribute` scored against knockout, the reference
OURS = tuple(method for method in get_args(api.Method) if method != "knockout")
MODELS = ("smollm2-135m", "gemma3-270m", "minilm-l6")
#: the shares of the sources blocked (deletion) or kept (insertion)
FRACTIONS = (0.1, 0.2, 0.3, 0.5)
#: a decoder's first target position: at least three earlier sources to rank
MIN_POSITION = 3
#: captum's Integrated Gradients: steps of its (default) Gauss-Legendre rule
IG_STEPS = 16
BOOTSTRAP = 1000


@dataclasses.dataclass
class Target:
    """One scalar to explain, and what each method said about it."""

    model: str
    domain: str
    window: int
    kind: str  # "every" (decoders; "last" marks the window's last position), "masked"
    position: int
    token: int
    tokens: Tensor  # [pos] the input
    eligible: Tensor  # [pos] bool: the sources scored
    curve: bool  # whether it gets deletion and insertion curves
    value: float = math.nan  # the clean target (TransformerLens, centred logit)
    scores: dict[str, Tensor] = dataclasses.field(default_factory=dict)
    seconds: dict[str, float] = dataclasses.field(default_factory=dict)
    notes: dict[str, float] = dataclasses.field(default_factory=dict)
    metrics: dict[str, dict[str, float]] = dataclasses.field(default_factory=dict)


# ----------------------------------------------------------------------------- inputs


def texts() -> dict[str, str]:
    """The two domains: English prose and Python source."""
    return {"english": tl_connwalk.zoo.default_text(), "code": Path(textwrap.__file__).read_text()}


def windows(model: nn.Module, text: str, n_tokens: int, count: int) -> list[list[int]]:
    """``count`` windows of ``n_tokens`` body tokens (+1 for the next token), evenly spaced."""
    ids = model.tokenizer(text, add_special_tokens=False)["input_ids"]  # type: ignore[operator]
    span = n_tokens + 1
    starts = np.linspace(0, len(ids) - span, count).astype(int)
    return [ids[start : start + span] for start in starts]


def targets_of(model: nn.Module, name: str, domain: str, w: int, ids: list[int]) -> list[Target]:
    tokenizer: Any = model.tokenizer
    if is_encoder(model):
        body = [tokenizer.cls_token_id, *ids[:-3], tokenizer.sep_token_id]
        n = len(body)
        out = []
        for p in range(1, n - 1):
            masked = torch.tensor(body)
            masked[p] = tokenizer.mask_token_id
            eligible = torch.ones(n, dtype=torch.bool)
            eligible[p] = False
            out.append(Target(name, domain, w, "masked", p, body[p], masked, eligible, p == n // 2))
        return out
    bos = [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []
    full = [*bos, *ids]
    tokens = torch.tensor(full[:-1])
    n = len(tokens)
    return [
        Target(name, domain, w, "every", p, full[p + 1], tokens, torch.arange(n) < p, p == n - 1)
        for p in range(MIN_POSITION, n)
    ]


# ----------------------------------------------------------------------------- methods


def timed(run: Callable[[], Any]) -> tuple[Any, float]:
    start = time.perf_counter()
    out = run()
    return out, time.perf_counter() - start


def batch_of(group: list[Target]) -> tuple[Tensor, Tensor, Tensor]:
    tokens = torch.stack([t.tokens for t in group])
    position = torch.tensor([t.position for t in group])
    token = torch.tensor([t.token for t in group])
    return tokens, position, token


def run_ours(
    model: nn.Module,
    group: list[Target],
    problems: dict[str, str],
    methods: tuple[str, ...],
    exact: tuple[int, ...] = (),
) -> None:
    """Every `attribute` method on the group; a method the model's architecture does not
    admit (a ConnWalkError) is recorded in ``problems`` with its reason. ``exact``: further
    rows of ``knockout_estimate``, one per number of sources knocked out for real."""
    tokens, position, token = batch_of(group)
    runs = [(method, method, {}) for method in methods]
    if "knockout_estimate" in methods:
        runs += [
            (f"knockout_estimate (exact={k})", "knockout_estimate", {"exact": k}) for k in exact
        ]
    for label, method, options in runs:
        if label in problems:
            continue
        try:
            result, seconds = timed(
                lambda method=method, options=options: tl_connwalk.attribute(
                    model, tokens, target=token, position=position, method=method, **options
                )
            )
        except tl_connwalk.ConnWalkError as error:
            problems[label] = str(error).split(" Use ")[0]
            continue
        for b, t in enumerate(group):
            t.scores[label] = result.scores[b].detach().double()
            t.seconds[label] = seconds / len(group)
            if method == "connection":
                t.value = float(result.target_value[b])


def run_knockout(model: nn.Module, group: list[Target]) -> None:
    """Knockout of every source; a decoder window's targets share its runs (each run reads all
    positions), an encoder's masked inputs are one batch of `attribute` calls."""
    tokens, position, token = batch_of(group)
    if is_encoder(model):
        result, seconds = timed(
            lambda: tl_connwalk.attribute(
                model, tokens, target=token, position=position, method="knockout"
            )
        )
        scores = result.scores
    else:
        n = tokens.shape[1]
        one_each = torch.eye(n, dtype=torch.bool)[:, None]

        def read(logits: Tensor, final: Tensor) -> Tensor:
            return logits[:, position, token]

        def knock() -> Tensor:
            with torch.no_grad():
                clean = model(tokens[:1])[0, position, token]  # type: ignore[operator]
            return (clean - baselines.block_keys(model, tokens[:1], one_each, read)[:, 0]).T

        scores, seconds = timed(knock)
    for b, t in enumerate(group):
        t.scores["knockout"] = scores[b].detach().double()
        t.seconds["knockout"] = seconds / len(group)


def embeddings(model: nn.Module, tokens: Tensor) -> dict[str, Tensor]:
    with torch.no_grad():
        _, cache = model.run_with_cache(  # type: ignore[operator]
            tokens, names_filter=lambda name: name in EMBEDDING_HOOKS
        )
    return {name: cache[name] for name in EMBEDDING_HOOKS if name in cache}


def run_captum(model: nn.Module, group: list[Target]) -> None:
    """Integrated Gradients (captum) of the same centred logit, over the embedding hooks."""
    from captum.attr import IntegratedGradients

    tokens, position, token = batch_of(group)
    clean = embeddings(model, tokens)
    names = list(clean)

    def forward(*embeds: Tensor) -> Tensor:
        repeats = embeds[0].shape[0] // len(group)
        hooks = [(name, lambda x, hook, e=e: e) for name, e in zip(names, embeds, strict=True)]
        rows = torch.arange(embeds[0].shape[0])
        at, ids = position.repeat(repeats), token.repeat(repeats)
        run: Any = model.run_with_hooks
        if is_encoder(model):
            return run(tokens.repeat(repeats, 1), fwd_hooks=hooks)[rows, at, ids]
        # a decoder's logits at the target positions only: the unembedding of every position
        # would dominate the cost (262,144 tokens in Gemma 3's vocabulary)
        n_layers = model.cfg.n_layers  # type: ignore[union-attr]
        resid = run(tokens.repeat(repeats, 1), fwd_hooks=hooks, stop_at_layer=n_layers)
        logits = model.unembed(model.ln_final(resid[rows, at][:, None]))[:, 0]  # type: ignore[operator]
        return logits[rows, ids]

    def integrate() -> tuple[Tensor, Tensor]:
        inputs = tuple(clean[name] for name in names)
        attributions, delta = IntegratedGradients(forward).attribute(
            inputs,
            baselines=tuple(torch.zeros_like(x) for x in inputs),
            n_steps=IG_STEPS,
            internal_batch_size=4 * len(group),
            return_convergence_delta=True,
        )
        return sum(a.sum(-1) for a in attributions), delta  # type: ignore[return-value]

    (scores, delta), seconds = timed(integrate)
    with torch.no_grad():
        value = forward(*(clean[name] for name in names))
    for b, t in enumerate(group):
        t.scores["captum_ig"] = scores[b].detach().double()
        t.seconds["captum_ig"] = seconds / len(group)
        t.notes["captum_ig_delta"] = float(delta[b])
        t.notes["captum_ig_value_diff"] = float(value[b]) - t.value


class LXT:
    """AttnLRP in lxt's efficient mode on the Hugging Face model of a zoo model's weights.

    lxt 2.1 and transformers 5 need two shims, applied here: ``lxt.efficient`` imports its
    BERT rules, which import ``transformers.modeling_attn_mask_utils`` (gone in transformers
    5), and its ViT rules, which need torchvision: both are stubbed (unused for these models).
    Its attention patch replaces the model module's ``ALL_ATTENTION_FUNCTIONS`` (in
    transformers 5 an ``AttentionInterface`` with ``get_interface``) by a plain dict, which
    the attention layers cannot call: the interface is put back and the model loaded with
    ``attn_implementation="eager"``, whose function (``eager_attention_forward``) lxt patched.
    """

    MODULES: ClassVar[dict[str, str]] = {"smollm2-135m": "llama", "gemma3-270m": "gemma3"}

    def __init__(self, name: str) -> None:
        import importlib

        from transformers import AutoModelForCausalLM

        for stub_name in ("bert", "vit_torch"):
            stub = types.ModuleType(f"lxt.efficient.models.{stub_name}")
            stub.modeling_bert = stub.vision_transformer = stub  # type: ignore[attr-defined]
            stub.attnLRP = stub.cp_LRP = {}  # type: ignore[attr-defined]
            sys.modules.setdefault(stub.__name__, stub)
        from lxt.efficient import monkey_patch

        module = importlib.import_module(
            f"transformers.models.{self.MODULES[name]}.modeling_{self.MODULES[name]}"
        )
        interface = module.ALL_ATTENTION_FUNCTIONS
        monkey_patch(module)
        module.ALL_ATTENTION_FUNCTIONS = interface
        self.model = AutoModelForCausalLM.from_pretrained(
            tl_connwalk.zoo.hf_dir(name, progress=False),
            dtype=torch.float32,
            attn_implementation="eager",
        ).eval()
        for parameter in self.model.parameters():
            parameter.requires_grad_(False)

    def __call__(self, group: list[Target]) -> None:
        tokens, position, token = batch_of(group)

        def relevance() -> tuple[Tensor, Tensor]:
            embeds = self.model.get_input_embeddings()(tokens).requires_grad_(True)
            hidden = self.model.model(inputs_embeds=embeds).last_hidden_state
            logits = self.model.lm_head(hidden[torch.arange(len(group)), position])
            y = logits.gather(1, token[:, None])[:, 0] - logits.mean(-1)  # the centred logit
            y.sum().backward()
            return (embeds * embeds.grad).sum(-1), y  # type: ignore[operator]

        (scores, value), seconds = timed(relevance)
        for b, t in enumerate(group):
            t.scores["lxt_attnlrp"] = scores[b].detach().double()
            t.seconds["lxt_attnlrp"] = seconds / len(group)
            t.notes["lxt_attnlrp_value_diff"] = float(value[b]) - t.value


# ----------------------------------------------------------------------------- edges

#: the edge check: layers (first, middle, last), largest and random edges per layer
EDGE_LARGEST = 50
EDGE_RANDOM = 50


def edge_check(model: nn.Module, name: str, domain: str, w: int, t: Target) -> list[dict[str, Any]]:
    """``knockout_estimate``'s edges against really blocking each edge alone: in three layers,
    the `EDGE_LARGEST` largest predicted edges (layer, head, query, key; ``key < query <=
    position``) and `EDGE_RANDOM` random others, each blocked in its own run (its score at
    ``hook_attn_scores`` set to ``-inf``); the Spearman correlation per layer."""
    tokens = t.tokens[None]
    result = tl_connwalk.attribute(
        model, tokens, target=t.token, position=t.position, method="knockout_estimate", exact=0
    )
    n_layers = int(model.cfg.n_layers)
    rows = []
    generator = torch.Generator().manual_seed(w)
    for layer in sorted({0, n_layers // 2, n_layers - 1}):
        edges = result.edges(layer)[0]  # [head, query, key]
        n = edges.shape[-1]
        query, key = torch.tril_indices(n, n, -1)
        keep = query <= t.position
        query, key = query[keep], key[keep]
        heads = torch.arange(edges.shape[0]).repeat_interleave(len(query))
        query, key = query.repeat(edges.shape[0]), key.repeat(edges.shape[0])
        predicted = edges[heads, query, key]
        order = predicted.abs().argsort(descending=True)
        largest = order[:EDGE_LARGEST]
        rest = order[EDGE_LARGEST:]
        chosen = torch.cat(
            [largest, rest[torch.randperm(len(rest), generator=generator)[:EDGE_RANDOM]]]
        )
        actual = []
        for start in range(0, len(chosen), baselines.KNOCKOUT_CHUNK):
            part = chosen[start : start + baselines.KNOCKOUT_CHUNK]
            where = (torch.arange(len(part)), heads[part], query[part], key[part])

            def block(scores: Tensor, hook: Any, where: tuple[Tensor, ...] = where) -> Tensor:
                scores = scores.clone()
                scores[where] = float("-inf")
                return scores

            with torch.no_grad():
                logits = model.run_with_hooks(  # type: ignore[operator]
                    tokens.expand(len(part), -1),
                    fwd_hooks=[(f"blocks.{layer}.attn.hook_attn_scores", block)],
                )
            actual.append(result.target_value[0] - logits[:, t.position, t.token])
        measured = torch.cat(actual).double()
        guess = predicted[chosen].double()
        top = slice(0, len(largest))
        others = slice(len(largest), None)
        rows.append(
            {
                "model": name,
                "domain": domain,
                "window": w,
                "layer": layer,
                "edges": len(chosen),
                "spearman": spearman(guess, measured),
                "spearman_largest": spearman(guess[top], measured[top]),
                "spearman_random": spearman(guess[others], measured[others]),
            }
        )
    return rows


# ----------------------------------------------------------------------------- curves


def curve_keys(t: Target, rankings: dict[str, Tensor]) -> tuple[Tensor, list[tuple[str, str]]]:
    """``[run, pos]`` the keys each curve run blocks, and each run's (ranking, label)."""
    eligible = t.eligible.nonzero()[:, 0]
    keys = [t.eligible.clone()]  # everything blocked: the floor of the insertion curve
    labels = [("all", "blocked")]
    for name, scores in rankings.items():
        order = eligible[torch.argsort(scores[eligible], descending=True, stable=True)]
        for fraction in FRACTIONS:
            k = max(1, math.ceil(fraction * len(eligible)))
            deleted = torch.zeros_like(t.eligible)
            deleted[order[:k]] = True
            keys += [deleted, t.eligible & ~deleted]
            labels += [(name, f"delete {fraction}"), (name, f"insert {fraction}")]
    return torch.stack(keys), labels


def run_curves(model: nn.Module, t: Target, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    rankings = dict(t.scores)
    rankings["random"] = torch.rand(len(t.tokens), generator=generator, dtype=torch.float64)
    keys, labels = curve_keys(t, rankings)

    def read(logits: Tensor, final: Tensor) -> Tensor:
        return logits[:, t.position, t.token]

    values = baselines.block_keys(model, t.tokens[None], keys[:, None], read)[:, 0].double()
    for name in rankings:
        for what in ("delete", "insert"):
            drops = [
                t.value - float(values[labels.index((name, f"{what} {fraction}"))])
                for fraction in FRACTIONS
            ]
            metric = "comprehensiveness" if what == "delete" else "sufficiency"
            t.metrics.setdefault(name, {})[metric] = statistics.fmean(drops)
    t.notes["all_blocked_drop"] = t.value - float(values[0])


# ----------------------------------------------------------------------------- scores


def ranks(x: np.ndarray) -> np.ndarray:
    """Ranks 0.. with ties given their mean rank."""
    order = np.argsort(x, kind="stable")
    r = np.empty(len(x))
    r[order] = np.arange(len(x))
    _, inverse, counts = np.unique(x, return_inverse=True, return_counts=True)
    return (np.bincount(inverse, weights=r) / counts)[inverse]


def spearman(a: Tensor, b: Tensor) -> float:
    ra, rb = ranks(a.numpy()), ranks(b.numpy())
    if ra.std() == 0 or rb.std() == 0:
        return math.nan
    return float(np.corrcoef(ra, rb)[0, 1])


def score(t: Target) -> None:
    reference = t.scores["knockout"][t.eligible]
    for name, scores in t.scores.items():
        if name != "knockout":
            t.metrics.setdefault(name, {})["spearman"] = spearman(scores[t.eligible], reference)


def bootstrap(values: list[float], clusters: list[Any], seed: int = 0) -> tuple[float, ...]:
    """Mean and 95% percentile interval, resampling whole clusters (windows)."""
    pairs = [(v, c) for v, c in zip(values, clusters, strict=True) if not math.isnan(v)]
    if not pairs:
        return (math.nan, math.nan, math.nan)
    by_cluster: dict[Any, list[float]] = {}
    for v, c in pairs:
        by_cluster.setdefault(c, []).append(v)
    groups = list(by_cluster.values())
    rng = np.random.default_rng(seed)
    means = []
    for _ in range(BOOTSTRAP):
        picked = rng.integers(0, len(groups), len(groups))
        sample = [v for i in picked for v in groups[i]]
        means.append(statistics.fmean(sample))
    low, high = np.percentile(means, [2.5, 97.5])
    return statistics.fmean(v for v, _ in pairs), float(low), float(high)


# ----------------------------------------------------------------------------- ladder


def repeated(inner: Callable[..., Any]) -> Callable[..., Any]:
    """``inner`` with a one-sequence frozen value tiled over a batch of blocked runs (also
    where the activation is flattened, batch first, as in a query/key norm)."""

    def tiled(activation: Tensor, hook: Any) -> Any:
        out = inner(activation, hook=hook)
        if isinstance(out, Tensor) and out.shape[0] != activation.shape[0]:
            out = out.repeat(activation.shape[0] // out.shape[0], *[1] * (out.ndim - 1))
        return out

    return tiled


def ladder(model: nn.Module, group: list[Target]) -> list[dict[str, Any]]:
    """Knockout of one decoder window with kinds of nonlinearity frozen as the connection
    method freezes them; rank correlations with connection and with the full knockout."""
    tokens, position, token = batch_of(group)
    frozen = FrozenNetwork.from_clean_run(model, tokens[:1])
    hooks = frozen.hooks({}, {})
    kinds: dict[str, Callable[[str], bool]] = {
        "norm scales": lambda name: name.endswith("hook_scale"),
        "MLP gains": lambda name: ".mlp." in name,
        "norm scales + MLP gains": lambda name: name.endswith("hook_scale") or ".mlp." in name,
    }
    n = tokens.shape[1]
    one_each = torch.eye(n, dtype=torch.bool)[:, None]

    def read(logits: Tensor, final: Tensor) -> Tensor:
        return logits[:, position, token]

    rows = []
    for label, chosen in kinds.items():
        extra = [(name, repeated(hook)) for name, hook in hooks if chosen(name)]
        with torch.no_grad():
            blocked = baselines.block_keys(model, tokens[:1], one_each, read, extra)[:, 0].T
        for b, t in enumerate(group):
            knocked = (torch.tensor(t.value) - blocked[b].double())[t.eligible]
            rows.append(
                {
                    "model": t.model,
                    "domain": t.domain,
                    "window": t.window,
                    "position": t.position,
                    "frozen": label,
                    "spearman_connection": spearman(t.scores["connection"][t.eligible], knocked),
                    "spearman_knockout": spearman(t.scores["knockout"][t.eligible], knocked),
                }
            )
    return rows


# ----------------------------------------------------------------------------- driver


def baseline_seconds(model: nn.Module, tokens: Tensor) -> float:
    """Median of three ``run_with_cache`` calls on one sequence."""
    times = []
    for _ in range(3):
        with torch.no_grad():
            times.append(timed(lambda: model.run_with_cache(tokens[None]))[1])  # type: ignore[operator]
    return statistics.median(times)


def peers_available() -> dict[str, str]:
    found = {}
    for package in ("captum", "lxt"):
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            found[package] = importlib.metadata.version(package)
    return found


def run_model(
    name: str, args: argparse.Namespace, peers: dict[str, str], log: Callable[[str], None]
) -> tuple[list[Target], list[dict[str, Any]], dict[str, str], list[dict[str, Any]]]:
    model = tl_connwalk.zoo.load(name, progress=False)
    problems: dict[str, str] = {}
    lxt = None
    if "lxt" in peers:
        if name in LXT.MODULES:
            lxt = LXT(name)
        else:
            problems["lxt_attnlrp"] = (
                "lxt 2.1's BERT rules import transformers.modeling_attn_mask_utils, which "
                "transformers 5 removed"
            )
    all_targets: list[Target] = []
    ladder_rows: list[dict[str, Any]] = []
    edge_rows: list[dict[str, Any]] = []
    for domain, text in texts().items():
        for w, ids in enumerate(windows(model, text, args.tokens, args.windows)):
            if args.pick is not None and w not in args.pick:
                continue
            group = targets_of(model, name, domain, w, ids)
            base = baseline_seconds(model, group[0].tokens)
            run_ours(model, group, problems, args.methods, tuple(args.exact))
            run_knockout(model, group)
            if "captum" in peers:
                run_captum(model, group)
            if lxt is not None:
                lxt(group)
            for i, t in enumerate(group):
                t.notes["run_with_cache_s"] = base
                score(t)
                if t.curve:
                    run_curves(model, t, seed=1000 * w + i)
            if not is_encoder(model) and w < args.ladder:
                ladder_rows += ladder(model, group)
            if not is_encoder(model) and w < args.edge_check:
                edge_rows.extend(edge_check(model, name, domain, w, group[-1]))
            all_targets += group
            log(f"{name} {domain} window {w}: {len(group)} targets")
    return all_targets, ladder_rows, problems, edge_rows


def rows_of(targets: list[Target]) -> Iterator[dict[str, Any]]:
    for t in targets:
        for method, metrics in t.metrics.items():
            seconds = t.seconds.get(method, math.nan)
            yield {
                "model": t.model,
                "domain": t.domain,
                "window": t.window,
                "kind": "last" if t.curve and t.kind == "every" else t.kind,
                "position": t.position,
                "target_value": t.value,
                "method": method,
                "spearman": metrics.get("spearman", math.nan),
                "comprehensiveness": metrics.get("comprehensiveness", math.nan),
                "sufficiency": metrics.get("sufficiency", math.nan),
                "seconds": seconds,
                "forward_equivalents": seconds / t.notes["run_with_cache_s"],
                "captum_delta": t.notes.get("captum_ig_delta", math.nan)
                if method == "captum_ig"
                else math.nan,
                "value_diff": t.notes.get(f"{method}_value_diff", math.nan),
            }


def fmt(stats: tuple[float, ...], digits: int = 2) -> str:
    mean, low, high = stats
    if math.isnan(mean):
        return "n/a"
    return f"{mean:.{digits}f} [{low:.{digits}f}, {high:.{digits}f}]"


def summary(rows: list[dict[str, Any]], problems: dict[str, dict[str, str]]) -> str:
    methods = list(dict.fromkeys(row["method"] for row in rows))
    lines = []
    for model in dict.fromkeys(row["model"] for row in rows):
        mine = [row for row in rows if row["model"] == model]
        n_targets = len({(r["domain"], r["window"], r["position"]) for r in mine})
        lines += [
            f"**{model}**: {n_targets} targets in "
            f"{len({(r['domain'], r['window']) for r in mine})} windows",
            "",
            "| method | Spearman vs knockout (all) | Spearman (last / masked curve targets) "
            "| comprehensiveness (higher is better) | sufficiency (lower is better) "
            "| seconds / target | forward passes / target |",
            "| --- | --- | --- | --- | --- | --- | --- |",
        ]
        for method in methods:
            these = [r for r in mine if r["method"] == method]
            if not these:
                if method in problems.get(model, {}):
                    lines.append(f"| {method} | not run: {problems[model][method]} | | | | | |")
                continue
            windows = [(r["domain"], r["window"]) for r in these]
            curve = [r for r in these if not math.isnan(r["comprehensiveness"])]
            curve_windows = [(r["domain"], r["window"]) for r in curve]
            seconds = [r["seconds"] for r in these if not math.isnan(r["seconds"])]
            equivalents = [r["forward_equivalents"] for r in these if not math.isnan(r["seconds"])]
            lines.append(
                f"| {method} | {fmt(bootstrap([r['spearman'] for r in these], windows))} "
                f"| {fmt(bootstrap([r['spearman'] for r in curve], curve_windows))} "
                f"| {fmt(bootstrap([r['comprehensiveness'] for r in curve], curve_windows))} "
                f"| {fmt(bootstrap([r['sufficiency'] for r in curve], curve_windows))} "
                f"| {statistics.median(seconds):.3f} | {statistics.median(equivalents):.1f} |"
                if seconds
                else f"| {method} | n/a | n/a "
                f"| {fmt(bootstrap([r['comprehensiveness'] for r in curve], curve_windows))} "
                f"| {fmt(bootstrap([r['sufficiency'] for r in curve], curve_windows))} | | |"
            )
        deltas = [abs(r["captum_delta"]) for r in mine if not math.isnan(r["captum_delta"])]
        diffs = {
            method: max(abs(r["value_diff"]) for r in mine if r["method"] == method)
            for method in ("captum_ig", "lxt_attnlrp")
            if any(r["method"] == method and not math.isnan(r["value_diff"]) for r in mine)
        }
        notes = []
        if deltas:
            notes.append(f"captum IG convergence delta |d|: median {statistics.median(deltas):.3g}")
        notes += [f"{m}: largest |y - y_TransformerLens| {d:.2g}" for m, d in diffs.items()]
        lines += ["", "; ".join(notes) + "." if notes else "", ""]
    return "\n".join(lines)


def edge_table(rows: list[dict[str, Any]]) -> str:
    """The edge check: Spearman of each layer's predicted edges with single edges blocked."""
    if not rows:
        return ""
    lines = [
        "**Edges** (`knockout_estimate`'s `edges(layer)` against blocking that one edge: "
        f"{EDGE_LARGEST} largest predicted and {EDGE_RANDOM} random edges per layer, each "
        "window's last target)",
        "",
        "| model | layer | Spearman with the edge blocked | among the largest | among the random "
        "| windows |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for model in dict.fromkeys(row["model"] for row in rows):
        for layer in dict.fromkeys(row["layer"] for row in rows if row["model"] == model):
            these = [r for r in rows if r["model"] == model and r["layer"] == layer]
            windows = [(r["domain"], r["window"]) for r in these]
            cells = [
                fmt(bootstrap([float(r[key]) for r in these], windows))
                for key in ("spearman", "spearman_largest", "spearman_random")
            ]
            lines.append(f"| {model} | {layer} | {' | '.join(cells)} | {len(these)} |")
    return "\n".join(lines) + "\n"


def ladder_table(rows: list[dict[str, Any]]) -> str:
    if not rows:
        return ""
    lines = [
        "| model | frozen in knockout | Spearman with connection | Spearman with full knockout "
        "| targets |",
        "| --- | --- | --- | --- | --- |",
    ]
    for model in dict.fromkeys(row["model"] for row in rows):
        for label in dict.fromkeys(row["frozen"] for row in rows):
            these = [r for r in rows if r["model"] == model and r["frozen"] == label]
            windows = [(r["domain"], r["window"]) for r in these]
            lines.append(
                f"| {model} | {label} "
                f"| {fmt(bootstrap([r['spearman_connection'] for r in these], windows))} "
                f"| {fmt(bootstrap([r['spearman_knockout'] for r in these], windows))} "
                f"| {len(these)} |"
            )
    return "\n".join(lines)


def write_tables(
    out: Path,
    rows: list[dict[str, Any]],
    ladder_rows: list[dict[str, Any]],
    problems: dict[str, dict[str, str]],
) -> None:
    out.mkdir(parents=True, exist_ok=True)
    for path, table in (("faithfulness.csv", rows), ("ladder.csv", ladder_rows)):
        if table:
            with (out / path).open("w", newline="") as handle:
                writer = csv.DictWriter(handle, fieldnames=list(table[0]))
                writer.writeheader()
                writer.writerows(table)
    (out / "problems.json").write_text(json.dumps(problems, indent=1) + "\n")


def read_rows(path: Path, run: int) -> list[dict[str, Any]]:
    """The rows of a run's CSV, numbers parsed, windows renamed ``run.window``."""
    if not path.exists():
        return []
    with path.open(newline="") as handle:
        rows = list(csv.DictReader(handle))
    for row in rows:
        for key, value in row.items():
            with contextlib.suppress(ValueError):
                row[key] = float(value)
        row["window"] = f"{run}.{int(row['window'])}"
        if "position" in row:
            row["position"] = int(row["position"])
    return rows


def merged(runs: list[Path], out: Path) -> str:
    """The tables of several runs' targets together; returns the text of ``faithfulness.md``."""
    rows: list[dict[str, Any]] = []
    ladder_rows: list[dict[str, Any]] = []
    problems: dict[str, dict[str, str]] = {}
    header = []
    for run, folder in enumerate(runs):
        rows += read_rows(folder / "faithfulness.csv", run)
        ladder_rows += read_rows(folder / "ladder.csv", run)
        if (folder / "problems.json").exists():
            for model, found in json.loads((folder / "problems.json").read_text()).items():
                problems.setdefault(model, {}).update(found)
        table = folder / "faithfulness.md"
        first = table.read_text().splitlines()[:2] if table.exists() else [str(folder), ""]
        header += [f"Run {run}: {first[0]}", f"{first[1]}", ""]
    write_tables(out, rows, ladder_rows, problems)
    text = "\n".join(header) + summary(rows, problems) + "\n" + ladder_table(ladder_rows)
    (out / "faithfulness.md").write_text(text + "\n")
    return text


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("faithfulness-results"))
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=MODELS)
    parser.add_argument("--tokens", type=int, default=16, help="tokens per window")
    parser.add_argument("--windows", type=int, default=8, help="windows per domain and model")
    parser.add_argument("--ladder", type=int, default=1, help="decoder windows in the ladder")
    parser.add_argument("--quick", action="store_true", help="one model, 8 tokens, 1 window")
    parser.add_argument(
        "--pick", type=int, nargs="+", help="run only these windows (0-based) of the layout"
    )
    parser.add_argument(
        "--merge", type=Path, nargs="+", help="write the tables of these runs' --out folders"
    )
    parser.add_argument(
        "--methods",
        nargs="+",
        choices=[*OURS, "captum_ig", "lxt_attnlrp"],
        help="score only these methods (default: every method and installed peer)",
    )
    parser.add_argument(
        "--edge-check", type=int, default=0, help="decoder windows in the edge check"
    )
    parser.add_argument(
        "--exact",
        type=int,
        nargs="*",
        default=[],
        help="also score knockout_estimate with these numbers of sources knocked out for real",
    )
    args = parser.parse_args(argv)
    if args.pick is not None and not all(0 <= w < args.windows for w in args.pick):
        parser.error(f"--pick: windows are 0 to {args.windows - 1} of --windows {args.windows}")
    if args.merge:
        text = merged(args.merge, args.out)
        print(text)
        return
    if args.quick:
        args.models, args.tokens, args.windows, args.ladder = ["smollm2-135m"], 8, 1, 1
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    peers = peers_available()
    if args.methods is not None:
        named = {"captum": "captum_ig", "lxt": "lxt_attnlrp"}
        peers = {k: v for k, v in peers.items() if named.get(k, "") in args.methods}
    args.methods = tuple(m for m in OURS if args.methods is None or m in args.methods)
    args.out.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()

    def log(message: str) -> None:
        print(f"[{time.perf_counter() - start:6.0f} s] {message}", file=sys.stderr, flush=True)

    rows: list[dict[str, Any]] = []
    ladder_rows: list[dict[str, Any]] = []
    edge_rows: list[dict[str, Any]] = []
    problems: dict[str, dict[str, str]] = {}
    versions = {
        "tl_connwalk": getattr(tl_connwalk, "__version__", "checkout"),
        "transformer-lens": importlib.metadata.version("transformer-lens"),
        "transformers": importlib.metadata.version("transformers"),
        "torch": torch.__version__,
        **peers,
    }
    for name in args.models:  # the files are rewritten after each model
        targets, ladders, problems[name], edges = run_model(name, args, peers, log)
        rows += rows_of(targets)
        ladder_rows += ladders
        edge_rows += edges
        write_tables(args.out, rows, ladder_rows, problems)
        if edge_rows:
            with (args.out / "edges.csv").open("w", newline="") as handle:
                writer = csv.DictWriter(handle, fieldnames=list(edge_rows[0]))
                writer.writeheader()
                writer.writerows(edge_rows)
        header = [
            f"`{' '.join(['python', 'benchmarks/faithfulness.py', *(argv or sys.argv[1:])])}`, "
            f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, "
            f"{platform.machine()} {platform.system()}, one thread, "
            f"{time.perf_counter() - start:.0f} s; "
            + ", ".join(f"{k} {v}" for k, v in versions.items()),
            f"Windows of {args.tokens} tokens, {args.windows} per domain"
            + (f" (windows {args.pick} of them)" if args.pick is not None else "")
            + "; fractions "
            f"{FRACTIONS}; captum IG: zero baseline, {IG_STEPS} steps.",
            "",
        ]
        text = "\n".join(header) + summary(rows, problems) + "\n" + ladder_table(ladder_rows)
        text += "\n\n" + edge_table(edge_rows)
        (args.out / "faithfulness.md").write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
