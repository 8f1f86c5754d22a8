"""Progress bars of the libraries the zoo calls (tl_connwalk.zoo.bars), hidden on request."""

import re

from transformers.utils import logging as hf_logging

from tl_connwalk.zoo.bars import progress_bars

BAR = re.compile(r"\d+%\|")


def draw(bar_class):
    for _ in bar_class(range(3), desc="test bar", mininterval=0):
        pass


def test_hides_transformers_and_gguf_bars_then_restores_them(capfd):
    import transformers.modeling_gguf_pytorch_utils as gguf_utils

    original = gguf_utils.tqdm
    for bar_class in (hf_logging.tqdm, original):  # drawn outside the block
        draw(bar_class)
        assert BAR.search(capfd.readouterr().err)
    with progress_bars(False):
        assert not hf_logging.is_progress_bar_enabled()
        draw(hf_logging.tqdm)
        draw(gguf_utils.tqdm)  # what the GGUF dequantisation calls
    assert not BAR.search(capfd.readouterr().err)
    assert gguf_utils.tqdm is original
    assert hf_logging.is_progress_bar_enabled()
    with progress_bars(True):
        draw(gguf_utils.tqdm)
    assert BAR.search(capfd.readouterr().err)


def test_keeps_bars_off_when_they_were_off():
    hf_logging.disable_progress_bar()
    try:
        with progress_bars(False):
            pass
        assert not hf_logging.is_progress_bar_enabled()
    finally:
        hf_logging.enable_progress_bar()
