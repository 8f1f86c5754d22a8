"""Views: an `Attribution` or a `ConnectionWalk` as one self-contained, interactive HTML page.

`Attribution.show` and `ConnectionWalk.show` display it in a notebook; `to_html(path)` writes
it to a file that opens offline in any browser (inline style and script, the numbers as
JSON, nothing loaded from anywhere). `walk_view` and
`tl_connwalk.attribution.view.attribution_view` return the `View` itself; `walk_data` and
`tl_connwalk.attribution.view.attribution_data` the numbers it draws. This package renders;
it imports nothing above the math core, so walks and attributions can use it.
"""

from tl_connwalk.views.page import View as View
from tl_connwalk.views.walk import walk_data as walk_data
from tl_connwalk.views.walk import walk_view as walk_view

__all__ = ["View", "walk_data", "walk_view"]
