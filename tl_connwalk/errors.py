"""The one exception type tl_connwalk raises for bad input.

Every check on user input raises `ConnWalkError` (a ``ValueError``) with the context a
user needs to fix the call: the layer, the hook name and the shapes involved. Checks never use
``assert``, which vanishes under ``python -O``.
"""


class ConnWalkError(ValueError):
    """Bad input to tl_connwalk: the message says what was wrong and how to fix it."""
