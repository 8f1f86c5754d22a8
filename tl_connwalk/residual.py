"""Moved to `tl_connwalk.walk.residual`; this old path works for one more release and warns."""

import sys
import warnings

from tl_connwalk.walk import residual as _moved

warnings.warn(
    "tl_connwalk.residual moved to tl_connwalk.walk.residual; import it from there "
    "(the old path goes in the next release).",
    DeprecationWarning,
    stacklevel=2,
)
sys.modules[__name__] = _moved
