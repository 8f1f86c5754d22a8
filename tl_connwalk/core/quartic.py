"""Deprecated: the quartic forms' fast path is private now (``tl_connwalk.core._fast.quartic``).

Importing this module warns; every attribute is that of the new module. Its caches are listed
and emptied by `tl_connwalk.caches` and `tl_connwalk.clear_caches`. Removed in the next
release.
"""

from tl_connwalk.core._moved import alias

alias(
    __name__,
    "tl_connwalk.core._fast.quartic",
    "Use tl_connwalk.caches() and tl_connwalk.clear_caches() for its caches.",
)
