"""Data-parallel analyze(): two gloo processes on CPU give the single-process table."""

import pickle
from pathlib import Path

import pandas as pd
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import tl_connwalk
from tests.architectures import bridge_only
from tests.tolerances import rtol
from tl_connwalk.toy import random_bridge

WORLD = 2
# 5 sequences in batches of 2: batches of 2, 2 and 1 sequences; rank 0 takes batches 0 and 2,
# rank 1 batch 1, so the merge must weight the batches by their sizes.
TOKENS = torch.randint(0, 63, (5, 8), generator=torch.Generator().manual_seed(3))
OPTIONS = {"batch_size": 2, "baseline_draws": 2, "layers": [0, -1], "progress": False}

pytestmark = bridge_only  # every test here runs a Bridge, some in worker processes


def _worker(rank: int, init_file: str, out_dir: str) -> None:
    torch.set_num_threads(1)
    # built before the process group: transformers' save_pretrained writes on rank 0 only
    model = random_bridge("llama", n_layers=3)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD)
    try:
        tables = {
            "split": tl_connwalk.analyze(model, TOKENS, **OPTIONS),
            # one batch only: rank 1 has nothing to contribute
            "one_batch": tl_connwalk.analyze(model, TOKENS, max_batches=1, **OPTIONS),
            "ignored": tl_connwalk.analyze(model, TOKENS[:2], distributed=False, **OPTIONS),
        }
        Path(out_dir, f"rank{rank}.pkl").write_bytes(pickle.dumps(tables))
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def rank_tables(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, pd.DataFrame]]:
    tmp = tmp_path_factory.mktemp("dist")
    mp.spawn(_worker, args=(str(tmp / "init"), str(tmp)), nprocs=WORLD, join=True)
    return [pickle.loads((tmp / f"rank{r}.pkl").read_bytes()) for r in range(WORLD)]


def _assert_same_table(actual: pd.DataFrame, expected: pd.DataFrame) -> None:
    # Each batch is measured identically in either process; only the float64 merge order of
    # the running moments differs: float64 rounding over the merges
    assert list(actual.columns) == list(expected.columns)
    tol = rtol(torch.float64)
    pd.testing.assert_frame_equal(actual, expected, check_exact=False, rtol=tol, atol=tol)


@pytest.mark.slow
def test_two_processes_give_the_single_process_table(rank_tables):
    model = random_bridge("llama", n_layers=3)
    single = tl_connwalk.analyze(model, TOKENS, **OPTIONS)
    assert (single["n_sequences"] == 5).all()
    assert (single["transport_defect_batch_std"].dropna() > 0).all()  # spreads are exercised
    for tables in rank_tables:  # every rank returns rank 0's merged table
        _assert_same_table(tables["split"], single)


@pytest.mark.slow
def test_a_rank_without_batches_and_opting_out(rank_tables):
    model = random_bridge("llama", n_layers=3)
    one = tl_connwalk.analyze(model, TOKENS, max_batches=1, **OPTIONS)
    alone = tl_connwalk.analyze(model, TOKENS[:2], **OPTIONS)
    for tables in rank_tables:
        _assert_same_table(tables["one_batch"], one)
        _assert_same_table(tables["ignored"], alone)


def test_distributed_without_a_process_group_is_explained():
    with pytest.raises(tl_connwalk.ConnWalkError, match="torchrun --nproc-per-node=N"):
        tl_connwalk.analyze(random_bridge("llama"), TOKENS, distributed=True, progress=False)
