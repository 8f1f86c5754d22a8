"""``tl-connwalk report``: a model's connection-walk geometry as a folder of files.

>>> from tl_connwalk.report import ReportConfig, run_report
>>> run_report(ReportConfig(model="toy-gpt2", out=Path("toy-report")))  # doctest: +SKIP

See `tl_connwalk.report.run` for what the folder holds. Modules: ``inputs`` (model and
tokens), ``measure`` (per-layer measurements), ``findings`` (headline numbers), ``figures``
(PNG), ``html`` (``index.html``), ``terminal`` (the rich summary), ``run`` (the job).
"""

from tl_connwalk.report.run import ReportConfig as ReportConfig
from tl_connwalk.report.run import run_report as run_report

__all__ = ["ReportConfig", "run_report"]
