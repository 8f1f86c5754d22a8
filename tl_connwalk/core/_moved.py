"""Old import paths of modules that moved, kept working for one release with a warning.

`alias` turns the module that calls it into a stand-in for its new home: reading an attribute
reads the new module's, and setting one (a constant such as ``CACHE_BYTES``) sets the new
module's, so code written against the old path behaves as before. Importing the old path
warns with a `DeprecationWarning` that names the replacement.
"""

import importlib
import sys
import types
import warnings


class _Alias(types.ModuleType):
    """A module whose attributes are those of ``_target`` (read and written through)."""

    _target: types.ModuleType

    def __getattr__(self, name: str) -> object:
        return getattr(self._target, name)

    def __setattr__(self, name: str, value: object) -> None:
        setattr(self._target, name, value)

    def __dir__(self) -> list[str]:
        return dir(self._target)


def alias(old: str, new: str, instead: str) -> None:
    """Make module ``old`` (already importing) a stand-in for module ``new`` and warn.

    ``instead`` says what to use from now on; the warning points at the import that used
    the old path.
    """
    warnings.warn(
        f"{old} is deprecated and will be removed in the next release: it moved to the private "
        f"{new}. {instead}",
        DeprecationWarning,
        stacklevel=3,  # alias, the old module, its importer (import frames are skipped)
    )
    module = sys.modules[old]
    target = importlib.import_module(new)
    module.__class__ = _Alias
    object.__setattr__(module, "_target", target)
