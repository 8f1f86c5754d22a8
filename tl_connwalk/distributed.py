"""Data parallelism for ``analyze`` under ``torchrun``: which batches a rank takes, and the reduce.

With ``torch.distributed`` initialised (one process per device, any backend), rank ``r`` of
``W`` takes batches ``r, r + W, r + 2W, ...`` of the stream; each rank summarises its batches
(`tl_connwalk.core.moments.Moments`), rank 0 gathers the summaries, merges them in
rank order (Chan's parallel algorithm: exact up to float rounding) and broadcasts the merged
result, so that every rank returns the same table. Object collectives are used; under NCCL call
``torch.cuda.set_device(local_rank)`` first, as ``torchrun`` scripts do. A script run with
``torchrun --nproc-per-node=4 analyze_corpus.py``:

```python
import os
import torch
import torch.distributed as dist
import tl_connwalk

local_rank = int(os.environ["LOCAL_RANK"])
torch.cuda.set_device(local_rank)
dist.init_process_group("nccl")
model = load_model().to(f"cuda:{local_rank}")  # any supported model
table = tl_connwalk.analyze(model, texts, batch_size=8)  # the same table on every rank
if dist.get_rank() == 0:
    table.to_csv("geometry.csv")
dist.destroy_process_group()
```

Tested on CPU with the gloo backend and two processes (``tests/test_distributed.py``).
"""

from collections.abc import Callable
from typing import TypeVar

import torch.distributed as dist

from tl_connwalk.errors import ConnWalkError

T = TypeVar("T")


def rank_and_world(distributed: bool | None) -> tuple[int, int]:
    """``(rank, world_size)``; ``(0, 1)`` for a single process.

    ``distributed=None`` uses the process group when one is initialised; ``True`` requires
    one; ``False`` ignores it (every rank then analyses everything by itself).
    """
    active = dist.is_available() and dist.is_initialized()
    if distributed is None:
        distributed = active
    if not distributed:
        return 0, 1
    if not active:
        raise ConnWalkError(
            "analyze(distributed=True) needs an initialised torch.distributed process group: "
            "launch with `torchrun --nproc-per-node=N script.py` and call "
            "torch.distributed.init_process_group() (backend 'nccl' for GPUs, 'gloo' for CPU) "
            "before analyze()."
        )
    return dist.get_rank(), dist.get_world_size()


def reduce_to_rank0(part: T | None, merge: Callable[[list[T]], T | None], world: int) -> T | None:
    """Gather every rank's ``part`` on rank 0, ``merge`` them in rank order, broadcast the result.

    ``part`` is None on a rank that got no batch; ``merge`` receives the others.
    """
    if world == 1:
        return None if part is None else merge([part])
    gathered: list[T | None] | None = [None] * world if dist.get_rank() == 0 else None
    dist.gather_object(part, gathered, dst=0)
    result: list[T | None] = [None]
    if gathered is not None:
        present = [p for p in gathered if p is not None]
        result[0] = merge(present) if present else None
    dist.broadcast_object_list(result, src=0)
    return result[0]
