"""The installed wheel, checked from outside the source tree (run by ``.ci/wheel-check``).

``python -I .ci/wheel_smoke.py WORK REPORT``: ``tl_connwalk`` must be imported from the
environment's site-packages, carry ``py.typed`` (PEP 561) and the version its metadata states;
``REPORT`` is the folder that ``tl-connwalk report`` wrote (every file present, the installed
version recorded); a walk view and an attribution view of a small random model are written
into ``WORK`` and must inline every bundled static file they use (``tl_connwalk/views/static``),
so that package data missing from the wheel fails here.
"""

import importlib.metadata
import json
import sys
from pathlib import Path

import torch

import tl_connwalk

REPORT_FILES = ("index.html", "report.json", "geometry.csv", "walks.png", "head_defects.png",
                "layer_drift.png", "residual.png", "scale.png")  # fmt: skip


def check(condition: bool, what: str, detail: str = "") -> None:
    """Print ``what`` if ``condition`` holds, else exit with it (and ``detail``) as the error."""
    if not condition:
        sys.exit(f"wheel smoke test failed: {what}" + (f" ({detail})" if detail else ""))
    print(f"ok: {what}")


def check_installed() -> Path:
    package = Path(tl_connwalk.__file__).resolve().parent
    check(
        package.is_relative_to(Path(sys.prefix).resolve()),
        f"tl_connwalk imported from the environment ({package})",
    )
    check((package / "py.typed").is_file(), "py.typed installed (PEP 561)")
    version = importlib.metadata.version("tl_connwalk")
    check(tl_connwalk.__version__ == version, f"__version__ is the metadata's ({version})")
    check(len(tl_connwalk.zoo.default_text()) > 1000, "the zoo's default text installed")
    return package


def check_report(report: Path) -> None:
    missing = [name for name in REPORT_FILES if not (report / name).is_file()]
    check(not missing, f"tl-connwalk report wrote {', '.join(REPORT_FILES)}", f"missing {missing}")
    recorded = json.loads((report / "report.json").read_text(encoding="utf-8"))
    version = recorded.get("tl_connwalk_version")
    check(
        version == tl_connwalk.__version__,
        "report.json records the installed version",
        str(version),
    )


def check_page(page: Path, static: Path, assets: tuple[str, ...]) -> None:
    html = page.read_text(encoding="utf-8") if page.is_file() else ""
    check(html.startswith("<!DOCTYPE html>"), f"{page.name} written")
    for name in assets:
        text = (static / name).read_text(encoding="utf-8").strip()
        check(bool(text) and text in html, f"{page.name} inlines the bundled static/{name}")


def main() -> None:
    work, report = Path(sys.argv[1]), Path(sys.argv[2])
    package = check_installed()
    check_report(report)
    static = package / "views" / "static"
    model = tl_connwalk.attach(tl_connwalk.toy.random_bridge("gpt2"))
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, tl_connwalk.toy.VOCAB, (1, 8), generator=generator)
    _, cache = model.run_with_cache(tokens)
    walk_page = cache.connection_walk(0).to_html(work / "walk.html")
    check_page(walk_page, static, ("view.css", "common.js", "walk.js"))
    attribution = tl_connwalk.attribute(model, tokens)
    attribution_page = attribution.to_html(work / "attribution.html")
    check_page(attribution_page, static, ("view.css", "common.js", "attribution.js"))
    tl_connwalk.detach(model)


if __name__ == "__main__":
    main()
