"""Old import paths of modules that moved, kept working for one release with a warning.

`alias` makes the old path the new module itself (``sys.modules``), so reading, setting or
patching an attribute through it (a constant such as ``CACHE_BYTES``) acts on the new module,
and importing the old path warns with a `DeprecationWarning` that names the replacement.
"""

import importlib
import sys
import warnings


def alias(old: str, new: str, instead: str) -> None:
    """Make module ``old`` (already importing) module ``new``, and warn.

    ``instead`` says what to use from now on; the warning points at the import that used
    the old path.
    """
    warnings.warn(
        f"{old} is deprecated and will be removed in the next release: it moved to the private "
        f"{new}. {instead}",
        DeprecationWarning,
        stacklevel=3,  # alias, the old module, its importer (import frames are skipped)
    )
    sys.modules[old] = importlib.import_module(new)
