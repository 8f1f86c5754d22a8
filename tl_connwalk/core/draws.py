"""Deprecated: the random baselines' shared draws are private now
(``tl_connwalk.core._fast.draws``).

Importing this module warns; every attribute is that of the new module. A layer's draws are
`tl_connwalk.core.caches.layer_draws`; the caches are listed and emptied by
`tl_connwalk.caches` and `tl_connwalk.clear_caches`. Removed in the next release.
"""

from tl_connwalk.core._moved import alias

alias(
    __name__,
    "tl_connwalk.core._fast.draws",
    "Use tl_connwalk.core.caches.layer_draws for a layer's draws, tl_connwalk.caches() and "
    "tl_connwalk.clear_caches() for the caches.",
)
