"""Views: an `Attribution` or a `ConnectionWalk` as one self-contained, interactive HTML page.

`Attribution.show` and `ConnectionWalk.show` display it in a notebook; `to_html(path)` writes
it to a file that opens offline in any browser (inline style and script, the numbers as
JSON, nothing loaded from anywhere). `attribution_view` and `walk_view` return the `View`
itself; `attribution_data` and `walk_data` the numbers it draws.
"""

from tl_connwalk.views.attribution import attribution_data as attribution_data
from tl_connwalk.views.attribution import attribution_view as attribution_view
from tl_connwalk.views.page import View as View
from tl_connwalk.views.walk import walk_data as walk_data
from tl_connwalk.views.walk import walk_view as walk_view

__all__ = ["View", "attribution_data", "attribution_view", "walk_data", "walk_view"]
