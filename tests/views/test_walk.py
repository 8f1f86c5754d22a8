"""`ConnectionWalk.to_html`: the page embeds the walk, its gates and the contributions given."""

import pytest
import torch

import tl_connwalk
from tests.architectures import default_model, tokens
from tests.views.pages import RTOL, Page
from tl_connwalk import ConnectionWalk, ConnWalkError
from tl_connwalk.views import walk_data


def close(page_values, expected: torch.Tensor) -> None:
    got = torch.tensor(page_values, dtype=torch.float64)
    torch.testing.assert_close(got, expected.detach().double(), rtol=RTOL, atol=0)


def padded_walk() -> ConnectionWalk:
    """A causal walk of 2 sequences of 6 positions, the second with its last 2 padding."""
    generator = torch.Generator().manual_seed(0)
    scores = torch.randn(2, 3, 6, 6, generator=generator)
    pattern = scores.masked_fill(torch.ones(6, 6).triu(1).bool(), -torch.inf).softmax(-1)
    mask = torch.tensor([[1] * 6, [1] * 4 + [0] * 2])
    return ConnectionWalk.from_pattern(
        pattern,
        torch.randn(2, 6, 8, generator=generator),
        torch.randn(3, 8, 4, generator=generator),
        torch.randn(3, 4, 8, generator=generator),
        layer=2,
        attention_mask=mask,
    )


def test_page_holds_the_walk_gates_and_padding(tmp_path):
    walk = padded_walk()
    page = Page(walk.to_html(tmp_path / "w.html").read_text(encoding="utf-8"))
    assert page.external() == []
    data = page.data()
    assert (data["layer"], data["n_heads"], data["value_heads"]) == (2, 3, None)
    for b, seq in enumerate(data["sequences"]):
        close(seq["walk"], walk.walk[b])
        close(seq["gates"], walk.gates[b])
        assert seq["real"] == walk.attention_mask[b].tolist()
        assert seq["tokens"] == [f"pos {i}" for i in range(6)]
    assert data["sequences"][1]["real"] == [True] * 4 + [False] * 2


def test_edge_contributions_are_drawn_by_default_and_named_norms(tmp_path):
    walk = padded_walk()
    contributions = walk.edge_contributions()
    data = Page(walk.to_html(tmp_path / "w.html").read_text(encoding="utf-8")).data()
    assert data["norms"] is True
    for b, seq in enumerate(data["sequences"]):
        close(seq["edge"], contributions.edge[b])
        close(seq["head"], contributions.head[b])
    edge = torch.rand(2, 6, 6)
    given = Page(walk.to_html(tmp_path / "g.html", edge_contributions=edge).read_text("utf-8"))
    assert given.data()["norms"] is False  # numbers of the caller's own: not called norms


def test_colours_are_log_scaled_by_default():
    walk = padded_walk()
    assert walk_data(walk)["colour_scale"] == "log"
    assert walk_data(walk, colour_scale="linear")["colour_scale"] == "linear"
    with pytest.raises(ConnWalkError, match="colour_scale must be 'log' or 'linear'"):
        walk_data(walk, colour_scale="sqrt")


def test_the_page_opens_on_the_last_real_querys_heaviest_edge():
    walk = padded_walk()
    for b, seq in enumerate(walk_data(walk)["sequences"]):
        query = int(walk.attention_mask[b].nonzero().max())
        assert query == (5, 3)[b]
        assert seq["selected"] == [query, int(walk.walk[b, query].argmax())]


def test_contributions_given_are_embedded_per_edge_and_per_head():
    walk = padded_walk()
    edge = torch.rand(2, 6, 6, generator=torch.Generator().manual_seed(1))
    head = torch.randn(2, 3, 6, 6, generator=torch.Generator().manual_seed(2))
    data = walk_data(walk, edge_contributions=edge, head_contributions=head)
    for b, seq in enumerate(data["sequences"]):
        close(seq["edge"], edge[b])
        close(seq["head"], head[b])


def test_a_models_walk_with_its_token_strings():
    model = default_model()
    toks = tokens(batch=2, pos=7)
    tl_connwalk.attach(model)
    try:
        _, cache = model.run_with_cache(toks)
        walk = cache.connection_walk(1)
    finally:
        tl_connwalk.detach(model)
    labels = [[f"<{t}>" for t in row] for row in toks.tolist()]
    data = walk_data(walk, str_tokens=labels)
    assert data["layer"] == 1
    for b, seq in enumerate(data["sequences"]):
        assert seq["tokens"] == labels[b] and seq["real"] == [True] * 7
        close(seq["walk"], walk.walk[b])


def test_contributions_of_the_wrong_shape_are_refused():
    walk = padded_walk()
    with pytest.raises(ConnWalkError, match=r"edge_contributions has shape \(2, 6\).*\(2, 6, 6\)"):
        walk_data(walk, edge_contributions=torch.zeros(2, 6))
    with pytest.raises(ConnWalkError, match=r"head_contributions .*\(2, 3, 6, 6\) \(\[batch, head"):
        walk_data(walk, head_contributions=torch.zeros(2, 6, 6))
    with pytest.raises(ConnWalkError, match="6 strings"):
        walk_data(walk, str_tokens=[["a"] * 6, ["b"] * 5])
