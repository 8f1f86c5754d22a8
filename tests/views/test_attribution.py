"""`Attribution.to_html`: the page embeds the attribution's own numbers, and nothing unsafe."""

import functools
import types

import pytest
import torch

import tl_connwalk
from tests.architectures import bridge_only, cached_bridge, default_model, tokens
from tests.views.pages import RTOL, Page
from tl_connwalk import Attribution, ConnWalkError
from tl_connwalk.attribution.routes import Route
from tl_connwalk.attribution.view import attribution_data
from tl_connwalk.views.labels import decoded_target, target_label

HOSTILE = "</script><img src=x onerror=alert(1)>"


@functools.cache
def attribution(method: str = "connection") -> Attribution:
    return tl_connwalk.attribute(default_model(), tokens(), position=6, method=method)


def close(page_values, expected: torch.Tensor) -> None:
    """The page's numbers equal ``expected`` to the digits it keeps."""
    got = torch.tensor(page_values, dtype=torch.float64)
    torch.testing.assert_close(got, expected.detach().double(), rtol=RTOL, atol=0)


def single_routes(result: Attribution, count: int) -> list[Route]:
    """The ``count`` largest one-component routes: a component's direct path from a source."""
    parts, names = result.by_component(), result.component_names()
    _, n_comp, n_pos = parts.shape
    order = parts.abs().flatten().argsort(descending=True)[:count].tolist()
    return [
        Route(
            i // (n_comp * n_pos),
            i % n_pos,
            (names[i // n_pos % n_comp],),
            parts.flatten()[i].item(),
        )
        for i in order
    ]


def test_page_holds_the_scores_targets_and_components(tmp_path):
    result = attribution()
    page = Page(result.to_html(tmp_path / "a.html").read_text(encoding="utf-8"))
    data = page.data()
    assert page.external() == []
    parts = result.by_component()
    assert data["components"]["names"] == result.component_names()
    for b, seq in enumerate(data["sequences"]):
        close(seq["scores"], result.scores[b])
        close(seq["components"], parts[b])
        close(
            [seq["target_value"], seq["bias"]],
            torch.stack([result.target_value[b], result.bias[b]]),
        )
        assert seq["position"] == 6 and seq["target"] == result.targets[b]
        assert seq["tokens"] == [f"#{t}" for t in result.tokens[b].tolist()]
        assert seq["routes"] is None


def test_the_page_opens_on_the_largest_source():
    result = attribution()
    for b, seq in enumerate(attribution_data(result)["sequences"]):
        scores = result.scores[b].abs()
        assert scores[seq["selected"]] == scores.max()


def test_decoded_target_writes_each_logits_token():
    class Letters:
        def decode(self, ids: list[int]) -> str:
            return "".join(chr(ord("a") + i) for i in ids)

    label = "logit[11] - logit[7] @ 22"
    quoted = "logit[11 \u2018l\u2019] - logit[7 \u2018h\u2019] @ 22"
    assert decoded_target(label, Letters()) == quoted
    assert decoded_target("direction @ 4", Letters()) == "direction @ 4"
    model = types.SimpleNamespace(tokenizer=Letters())
    assert target_label(label, model) == decoded_target(label, Letters())
    assert target_label(label) == label  # without a model the ids stay


def test_grid_places_each_component_at_its_layer_and_head():
    result = attribution()
    data = attribution_data(result)
    layout = data["components"]
    n_heads, n_layers = data["n_heads"], data["n_layers"]
    assert (n_layers, n_heads) == (2, 4)
    cells = {
        (layer, col): name
        for name, layer, col in zip(layout["names"], layout["layer"], layout["column"], strict=True)
    }
    for layer in range(n_layers):
        for head in range(n_heads):
            assert cells[layer, head] == f"L{layer}H{head}"
        assert cells[layer, n_heads] == f"L{layer}MLP"
    assert cells[-1, -1] == "embed"  # off the grid, listed under it


@pytest.mark.parametrize("top", [1, 5, 100])
def test_edges_are_each_layers_strongest_edges_with_their_heads(top):
    result = attribution()
    data = attribution_data(result, top_edges=top)
    assert data["top_edges"] == top
    for b, seq in enumerate(data["sequences"]):
        assert len(seq["edges"]) == 2
        for layer, shown in enumerate(seq["edges"]):
            per_head = result.edges(layer)[b]
            total = per_head.sum(0)
            ranked = sorted(
                (
                    (q, k)
                    for q in range(total.shape[0])
                    for k in range(total.shape[1])
                    if total[q, k] != 0
                ),
                key=lambda edge: -abs(total[edge].item()),
            )[:top]
            assert [(e["query"], e["key"]) for e in shown] == ranked
            close([e["value"] for e in shown], torch.stack([total[edge] for edge in ranked]))
            close([e["heads"] for e in shown], torch.stack([per_head[:, q, k] for q, k in ranked]))
            close(seq["layer_totals"][layer], per_head.sum())


def test_routes_k_lists_each_sequences_largest_routes(tmp_path):
    result = attribution()
    data = Page(result.to_html(tmp_path / "a.html", routes=3).read_text(encoding="utf-8")).data()
    for b, seq in enumerate(data["sequences"]):
        mine = result.routes(3, batch=b)
        assert [(r["source"], tuple(r["components"])) for r in seq["routes"]] == [
            (r.source, r.components) for r in mine
        ]
        close(
            [r["contribution"] for r in seq["routes"]], torch.tensor([r.contribution for r in mine])
        )


def test_routes_are_listed_by_sequence_largest_first_and_checked():
    result = attribution()
    routes = single_routes(result, 12)
    data = attribution_data(result, routes=routes[::-1])
    for b, seq in enumerate(data["sequences"]):
        mine = [r for r in routes if r.batch == b]
        assert [(r["source"], r["components"]) for r in seq["routes"]] == [
            (r.source, list(r.components)) for r in mine
        ]
        close(
            [r["contribution"] for r in seq["routes"]], torch.tensor([r.contribution for r in mine])
        )
    assert data["notes"]["routes"] is None
    bad = [
        (Route(2, 0, ("L0H0",), 1.0), "outside this attribution's 2 sequence"),
        (Route(0, 9, ("L0H0",), 1.0), "source=9"),
        (Route(0, 0, ("L7H0",), 1.0), r"passes \['L7H0'\]"),
    ]
    for route, message in bad:
        with pytest.raises(ConnWalkError, match=message):
            attribution_data(result, routes=[route])


def test_hostile_tokens_stay_text(tmp_path):
    result = attribution()
    labels = [HOSTILE, "<!--", "\"'&", "a\nb", *map(str, range(5))]
    page = Page(result.to_html(tmp_path / "a.html", str_tokens=labels).read_text(encoding="utf-8"))
    assert page.named("img") == [] and len(page.scripts) == 2
    assert not any(name.startswith("on") for _, attrs in page.tags for name in attrs)
    assert all(seq["tokens"] == labels for seq in page.data()["sequences"])


def test_a_baseline_has_scores_only_and_says_why():
    data = attribution_data(attribution("rollout"))
    seq = data["sequences"][0]
    close(seq["scores"], attribution("rollout").scores[0])
    assert seq["components"] is None and seq["edges"] is None and data["components"] is None
    assert seq["routes"] is None and seq["layer_totals"] is None
    for part in ("components", "edges", "routes"):
        assert "method='connection'" in data["notes"][part]
    assert "method='rollout'" in data["notes"]["routes"]
    assert data["shares"] is False and attribution_data(attribution())["shares"] is True


def test_a_knockout_estimate_shows_its_edges_exact_sources_and_what_verify_measured():
    result = tl_connwalk.attribute(
        default_model(), tokens(), position=6, method="knockout_estimate"
    )
    data = attribution_data(result)
    seq = data["sequences"][1]
    close(seq["scores"], result.scores[1])
    assert seq["exact"] == result.exact[1].tolist() and seq["measured"] == [None] * 9
    assert seq["edges"] is not None and seq["components"] is None
    close(seq["layer_totals"], torch.stack([result.edges(layer)[1].sum() for layer in range(2)]))
    frame = result.verify(2)
    seq = attribution_data(result)["sequences"][1]
    measured = frame[frame["batch"] == 1].set_index("source")["knockout"]
    assert [s for s, v in enumerate(seq["measured"]) if v is not None] == sorted(measured.index)
    close(
        [seq["measured"][s] for s in sorted(measured.index)],
        torch.tensor(measured.sort_index().to_numpy()),
    )
    assert "knockout_estimate" in data["notes"]["components"]


def test_bad_arguments_are_refused():
    result = attribution()
    for top in (0, -1, True):
        with pytest.raises(ConnWalkError, match="top_edges must be a positive int"):
            attribution_data(result, top_edges=top)
    with pytest.raises(ConnWalkError, match="9 strings"):
        attribution_data(result, str_tokens=["a", "b"])
    with pytest.raises(ConnWalkError, match="not a str"):
        attribution_data(result, str_tokens="abcdefghi")
    with pytest.raises(ConnWalkError, match="no tokenizer"):
        attribution_data(result, model=object())


@bridge_only
def test_model_labels_are_its_tokenizers_strings():
    model = cached_bridge("gpt2", False)
    toks = torch.tensor([[3, 10, 11, 12, 13]])
    result = tl_connwalk.attribute(model, toks, target=7)
    data = attribution_data(result, model=model)
    assert data["sequences"][0]["tokens"] == [model.tokenizer.decode([t]) for t in toks[0].tolist()]
    assert (
        data["sequences"][0]["target"] == f"logit[7 \u2018{model.tokenizer.decode([7])}\u2019] @ 4"
    )
