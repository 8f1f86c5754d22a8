"""The number of operations `geometry_table` and the forward pass dispatch may not creep up.

On a GPU each dispatched operation is a kernel launch, so their number is the measurements'
cost there (`tl_connwalk.debug`). The counts are deterministic for a given torch and
TransformerLens, so they are compared with a record: a count more than `GROWTH` above its
record fails. The record is kept per torch and TransformerLens version (the forward pass is
TransformerLens's code); on versions without one the test skips. After a change that lowers a
count, or to record new versions, regenerate it from the repository root:

    OMP_NUM_THREADS=1 .venv/bin/python -m tests.test_op_count
"""

import json
import sys
from importlib.metadata import version
from pathlib import Path
from typing import Any

import pytest
import torch

import tl_connwalk
from tests.architectures import bridge_only, bridge_tokens
from tl_connwalk.debug import operations_of
from tl_connwalk.toy import random_bridge

RECORD = Path(__file__).with_name("op_counts.json")
#: the growth over the record that fails (10%)
GROWTH = 1.10
#: the fixed models: toy architecture -> random_bridge options
MODELS = {"gpt2": {}, "llama": {}}


def versions() -> str:
    """The record's key: the versions the counts depend on."""
    return f"torch {torch.__version__}, transformer_lens {version('transformer_lens')}"


def counts(arch: str) -> dict[str, int]:
    """Operations of ``run_with_cache`` and of a warm ``geometry_table`` on a fixed model."""
    model = tl_connwalk.attach(random_bridge(arch, **MODELS[arch]))
    try:
        tokens = bridge_tokens(batch=2, pos=12)
        with torch.no_grad():
            _, cache = model.run_with_cache(tokens)

            def table() -> Any:
                return tl_connwalk.geometry_table(cache, progress=False)

            table()  # warm: the head Grams are computed once per set of weights
            return {
                "run_with_cache": operations_of(lambda: model.run_with_cache(tokens)).total,
                "geometry_table": operations_of(table).total,
            }
    finally:
        tl_connwalk.detach(model)


@bridge_only
@pytest.mark.parametrize("arch", sorted(MODELS))
def test_operation_counts_stay_within_the_record(arch):
    recorded = json.loads(RECORD.read_text()).get(versions(), {}).get(arch)
    if recorded is None:
        pytest.skip(f"no operation counts recorded for {versions()}: see this module's docstring")
    measured = counts(arch)
    for what, n in measured.items():
        assert n <= GROWTH * recorded[what], (
            f"{what} on the {arch} toy dispatches {n} operations, more than {GROWTH} times the "
            f"{recorded[what]} recorded: batch the new work, or regenerate the record if the "
            "growth is intended (this module's docstring)"
        )


def _record() -> None:
    record = json.loads(RECORD.read_text()) if RECORD.exists() else {}
    record[versions()] = {arch: counts(arch) for arch in sorted(MODELS)}
    RECORD.write_text(json.dumps(record, indent=2, sort_keys=True) + "\n")
    json.dump(record[versions()], sys.stdout)


if __name__ == "__main__":
    _record()
