"""Which TransformerLens model classes the installed version has.

TransformerLens 2.x has ``HookedTransformer`` and ``HookedEncoder`` only; 3.x adds
``TransformerBridge``; 4.x keeps only the Bridge. Every module that needs the Bridge class
asks here, so ``import tl_connwalk`` works on each of them.
"""

from importlib.metadata import PackageNotFoundError, version
from typing import TYPE_CHECKING, Any

from tl_connwalk.errors import ConnWalkError

if TYPE_CHECKING:
    from transformer_lens.model_bridge import TransformerBridge
else:
    try:
        from transformer_lens.model_bridge import TransformerBridge
    except ImportError:  # TransformerLens 2.x: no Bridge
        TransformerBridge = None

#: Whether the installed TransformerLens has ``TransformerBridge`` (3.x and later).
HAS_BRIDGE: bool = TransformerBridge is not None


def transformer_lens_version() -> str:
    """The installed TransformerLens version, as its distribution states it."""
    try:
        return version("transformer-lens")
    except PackageNotFoundError:  # a source checkout without metadata
        return "unknown"


def is_bridge(model: Any) -> bool:
    """Whether ``model`` is a ``TransformerBridge`` (always False where there is none)."""
    return HAS_BRIDGE and isinstance(model, TransformerBridge)


class BridgeUnavailableError(ConnWalkError):
    """Raised where a ``TransformerBridge`` is needed and this TransformerLens has none (2.x)."""


def require_bridge(what: str) -> Any:
    """The ``TransformerBridge`` class, or a BridgeUnavailableError saying ``what`` needs it."""
    if TransformerBridge is None:
        raise BridgeUnavailableError(
            f"{what} needs TransformerLens's TransformerBridge, which TransformerLens "
            f"{transformer_lens_version()} does not have (it came in 3.0). Upgrade with "
            f"`pip install 'transformer-lens>=3.0'`, or use a HookedTransformer model."
        )
    return TransformerBridge
