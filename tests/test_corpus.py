"""analyze(): streaming a corpus gives the table of one run, with spreads over batches."""

import pandas as pd
import pytest
import torch

import tl_connwalk
from tests.tolerances import cancelling_atol, rtol
from tl_connwalk.corpus import token_windows
from tl_connwalk.toy import random_bridge

TEXT = " ".join(f"t{i % 37}" for i in range(400))


@pytest.fixture(scope="module")
def model():
    return random_bridge("llama", n_layers=3)


def test_one_batch_is_the_geometry_table(model):
    tokens = torch.randint(0, 63, (4, 10), generator=torch.Generator().manual_seed(0))
    streamed = tl_connwalk.analyze(model, tokens, batch_size=4, baseline_draws=2, progress=False)
    _, cache = model.run_with_cache(tokens)
    direct = tl_connwalk.geometry_table(cache, baseline_draws=2, progress=False)
    columns = [c for c in direct.columns if c not in ("mu_kind", "head")]
    pd.testing.assert_frame_equal(
        streamed[columns], direct[columns], check_exact=False, rtol=rtol(torch.float32)
    )
    assert (streamed["n_sequences"] == 4).all()
    assert (streamed["transport_defect_batch_std"].fillna(0) == 0).all()


def test_batches_average_to_the_whole(model):
    tokens = torch.randint(0, 63, (6, 10), generator=torch.Generator().manual_seed(1))
    whole = tl_connwalk.analyze(model, tokens, batch_size=6, baseline_draws=2, progress=False)
    streamed = tl_connwalk.analyze(model, tokens, batch_size=2, baseline_draws=2, progress=False)
    for column in ("stochasticity", "reversibility", "transport_defect", "scale", "field_defect"):
        torch.testing.assert_close(
            torch.tensor(streamed[column].to_numpy()), torch.tensor(whole[column].to_numpy()),
            # float32 per sequence, in batches of other shapes; defects near 0 are square
            # roots of cancelling differences
            rtol=rtol(torch.float32), atol=cancelling_atol(torch.float32), equal_nan=True,
        )  # fmt: skip
    assert (streamed[streamed["head"] == "all"]["transport_defect_batch_std"] > 0).any()


def test_texts_are_cut_into_windows(model):
    windows = list(token_windows(model, [TEXT[:600], TEXT[600:]], seq_len=16))
    assert all(w.shape == (16,) for w in windows) and len(windows) >= 10
    bos = model.tokenizer.bos_token_id
    assert all(int(w[0]) == bos for w in windows)
    table = tl_connwalk.analyze(
        model, [TEXT], seq_len=16, batch_size=4, layers=[-1], max_batches=2, baseline_draws=2,
        progress=False,
    )  # fmt: skip
    assert set(table["layer"]) == {2} and (table["n_sequences"] == 8).all()


def test_bad_data_is_explained(model):
    with pytest.raises(tl_connwalk.ConnWalkError, match="got no data"):
        tl_connwalk.analyze(model, [], progress=False)
    with pytest.raises(tl_connwalk.ConnWalkError, match="token tensors must be integer"):
        tl_connwalk.analyze(model, torch.zeros(2, 5), progress=False)
    with pytest.raises(tl_connwalk.ConnWalkError, match="shorter than seq_len"):
        tl_connwalk.analyze(model, ["t1 t2"], seq_len=64, progress=False)


@pytest.mark.parametrize(
    ("tokens", "message"),
    [
        (
            torch.zeros(2, 5),
            r"must be integer \[batch, pos\], got torch.float32 \(2, 5\).*tokens.long",
        ),
        (torch.ones(2, 5, dtype=torch.bool), r"must be integer \[batch, pos\], got torch.bool"),
        (
            torch.ones(5, dtype=torch.long),
            r"got torch.int64 \(5,\) \(one sequence: pass tokens\[None\]",
        ),
        (torch.ones(0, 5, dtype=torch.long), r"empty token tensor \(0, 5\)"),
        (torch.ones(3, 0, dtype=torch.long), r"empty token tensor \(3, 0\)"),
        (torch.ones(3, 1, dtype=torch.long), r"length 1 \(3, 1\).*at least 2 tokens"),
        (torch.full((2, 4), 64), r"range over \[64, 64\] but the model's vocabulary is 0..63"),
        (torch.full((2, 4), -1), r"range over \[-1, -1\]"),
    ],
)
def test_bad_tokens_are_explained(model, tokens, message):
    with pytest.raises(tl_connwalk.ConnWalkError, match=message):
        tl_connwalk.analyze(model, tokens, progress=False)
    with pytest.raises(tl_connwalk.ConnWalkError, match=message):  # inside an iterable too
        tl_connwalk.analyze(model, [tokens], progress=False)


def test_other_integer_dtypes_and_two_tokens_work(model):
    tokens = torch.randint(0, 63, (2, 2), generator=torch.Generator().manual_seed(2))
    wide = tl_connwalk.analyze(model, tokens, baseline_draws=2, layers=[0], progress=False)
    narrow = tl_connwalk.analyze(
        model, tokens.to(torch.int16), baseline_draws=2, layers=[0], progress=False
    )
    pd.testing.assert_frame_equal(narrow, wide)
    assert wide["stochasticity"].notna().all()


@pytest.mark.parametrize(
    ("option", "message"),
    [
        ({"batch_size": 0}, "batch_size must be an int >= 1, got 0"),
        ({"seq_len": 1}, "seq_len must be an int >= 2, got 1"),
        ({"max_batches": 0}, "max_batches must be None or an int >= 1, got 0"),
    ],
)
def test_bad_options_are_explained(model, option, message):
    with pytest.raises(tl_connwalk.ConnWalkError, match=message):
        tl_connwalk.analyze(model, [TEXT], progress=False, **option)


def test_mu_kind_lists_every_kind_seen(model, monkeypatch):
    import tl_connwalk.corpus as corpus

    kinds = iter(["uniform", "stationary"])

    def labelled(*args, **kwargs):
        table = tl_connwalk.geometry_table(*args, **kwargs)
        table["mu_kind"] = next(kinds)
        return table

    monkeypatch.setattr(corpus, "geometry_table", labelled)
    tokens = torch.randint(0, 63, (2, 6), generator=torch.Generator().manual_seed(4))
    table = tl_connwalk.analyze(model, tokens, batch_size=1, baseline_draws=2, progress=False)
    assert (table["mu_kind"] == "stationary,uniform").all()


def test_a_single_string_is_one_text(model):
    options = {"seq_len": 16, "batch_size": 2, "layers": [0], "max_batches": 1}
    one = tl_connwalk.analyze(model, TEXT, baseline_draws=2, progress=False, **options)
    listed = tl_connwalk.analyze(model, [TEXT], baseline_draws=2, progress=False, **options)
    pd.testing.assert_frame_equal(one, listed)


def test_layers_out_of_range_are_explained(model):
    with pytest.raises(
        tl_connwalk.ConnWalkError, match="layer 3 is out of range: this model has 3"
    ):
        tl_connwalk.analyze(model, [TEXT], layers=[0, 3], progress=False)
