"""Moved to `tl_connwalk.hooks.bridge`; this old path works for one more release and warns."""

import sys
import warnings

from tl_connwalk.hooks import bridge as _moved

warnings.warn(
    "tl_connwalk.bridge_hooks moved to tl_connwalk.hooks.bridge; import it from there "
    "(the old path goes in the next release).",
    DeprecationWarning,
    stacklevel=2,
)
sys.modules[__name__] = _moved
