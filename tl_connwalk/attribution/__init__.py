"""Attribution: which source tokens, heads and edges made an output (spec §6).

`attribute` freezes the model's nonlinear gains at the clean run (``frozen``), splits a
target exactly over the source tokens (``connection``) and returns an `Attribution`.
"""

from tl_connwalk.attribution.api import attribute as attribute
from tl_connwalk.attribution.record import Attribution as Attribution

__all__ = ["Attribution", "attribute"]
