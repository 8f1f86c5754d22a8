"""analyze(): streaming a corpus gives the table of one run, with spreads over batches."""

import pandas as pd
import pytest
import torch

import tl_connwalk
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
    pd.testing.assert_frame_equal(streamed[columns], direct[columns], check_exact=False, rtol=1e-5)
    assert (streamed["n_sequences"] == 4).all()
    assert (streamed["transport_defect_batch_std"].fillna(0) == 0).all()


def test_batches_average_to_the_whole(model):
    tokens = torch.randint(0, 63, (6, 10), generator=torch.Generator().manual_seed(1))
    whole = tl_connwalk.analyze(model, tokens, batch_size=6, baseline_draws=2, progress=False)
    streamed = tl_connwalk.analyze(model, tokens, batch_size=2, baseline_draws=2, progress=False)
    for column in ("stochasticity", "reversibility", "transport_defect", "scale", "field_defect"):
        torch.testing.assert_close(
            torch.tensor(streamed[column].to_numpy()), torch.tensor(whole[column].to_numpy()),
            rtol=1e-5, atol=1e-6, equal_nan=True,
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
