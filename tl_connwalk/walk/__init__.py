"""The objects a user holds for one attention layer, built from tensors (spec §1-§3).

- `ConnectionWalk` (`tl_connwalk.walk.connection`): the walk, gates, field and head weights of
  a layer, with its operators and views;
- `LaplacianResidual` (`tl_connwalk.walk.residual`): every condition of spec §2 measured on
  that layer, each beside its random baseline.
"""

from tl_connwalk.walk.connection import ConnectionWalk as ConnectionWalk
from tl_connwalk.walk.residual import LaplacianResidual as LaplacianResidual
from tl_connwalk.walk.residual import isometry_defects as isometry_defects
from tl_connwalk.walk.residual import laplacian_residual as laplacian_residual

__all__ = ["ConnectionWalk", "LaplacianResidual", "isometry_defects", "laplacian_residual"]
