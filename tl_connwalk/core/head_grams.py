"""Deprecated: the store of head Grams is private now (``tl_connwalk.core._fast.head_grams``).

Importing this module warns; every attribute is that of the new module. A layer's head Grams
are `tl_connwalk.core.caches.head_grams`; the store is listed and emptied by
`tl_connwalk.caches` and `tl_connwalk.clear_caches`. Removed in the next release.
"""

from tl_connwalk.core._moved import alias

alias(
    __name__,
    "tl_connwalk.core._fast.head_grams",
    "Use tl_connwalk.core.caches.head_grams for a layer's head Grams, tl_connwalk.caches() "
    "and tl_connwalk.clear_caches() for the store.",
)
