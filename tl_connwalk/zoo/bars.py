"""The progress bars of the libraries the zoo calls, shown or hidden on request.

Loading a model draws bars from ``transformers`` ("Loading weights", which also switches those
of ``huggingface_hub``) and, when a GGUF file is dequantised, a plain ``tqdm`` bar in
``transformers.modeling_gguf_pytorch_utils``. `progress_bars` hides them for the span of a
``with`` block and puts the previous settings back afterwards.
"""

import contextlib
import functools
import importlib
from collections.abc import Iterator
from unittest import mock

from tl_connwalk.core.checks import check_flag


@contextlib.contextmanager
def progress_bars(show: bool) -> Iterator[None]:
    """Inside the block, the loading and conversion bars are drawn only if ``show``.

    >>> with progress_bars(False):
    ...     pass
    """
    if check_flag(show, "progress"):
        yield
        return
    from transformers.utils import logging as hf_logging

    was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        with _gguf_bar_hidden():
            yield
    finally:
        if was_enabled:
            hf_logging.enable_progress_bar()


@contextlib.contextmanager
def _gguf_bar_hidden() -> Iterator[None]:
    # the GGUF dequantisation bar is a plain tqdm, outside transformers' switch: the module's
    # tqdm is swapped, for the block only, for one that is disabled
    try:
        gguf_utils = importlib.import_module("transformers.modeling_gguf_pytorch_utils")
    except ImportError:
        gguf_utils = None
    bar = getattr(gguf_utils, "tqdm", None)
    if bar is None:
        yield
        return
    with mock.patch.object(gguf_utils, "tqdm", functools.partial(bar, disable=True)):
        yield
