"""The connection-walk hook points (spec §1.2), installed by `tl_connwalk.attach`.

- `tl_connwalk.hooks.hooked_transformer`: on ``HookedTransformer`` and ``HookedEncoder``;
- `tl_connwalk.hooks.bridge`: on ``TransformerBridge`` (3.x and 4.x).

Both give every attention layer ``blocks.{l}.attn.hook_conn_walk``, ``hook_conn_gates`` and
``hook_conn_messages``, named by `hook_name`.
"""

from tl_connwalk.hooks.hooked_transformer import HOOK_NAMES as HOOK_NAMES
from tl_connwalk.hooks.hooked_transformer import Point as Point
from tl_connwalk.hooks.hooked_transformer import hook_name as hook_name
from tl_connwalk.hooks.hooked_transformer import install as install
from tl_connwalk.hooks.hooked_transformer import uninstall as uninstall

__all__ = ["HOOK_NAMES", "Point", "hook_name", "install", "uninstall"]
