"""Run TransformerLens's unit tests plain, with tl_connwalk attached, and attached then detached.

``attach`` must change nothing a user's code can see: this script runs a chosen set of
TransformerLens's tests three times, each in its own pytest process,

- ``plain``: as TransformerLens ships them;
- ``attach``: ``tl_connwalk.attach`` applied to every ``HookedTransformer``, ``HookedEncoder``
  and ``TransformerBridge`` the tests build (the outermost constructor of the model, subclasses
  included, calls it as it returns);
- ``detach``: ``attach`` then ``detach`` on every such model;

and compares the outcome (passed, failed, error, skipped, xfailed, xpassed) test by test (a
test file that fails to import is one ``error`` and the others still run). A model
that ``attach`` refuses with a ``ConnWalkError`` is left as built and counted; any other
exception from ``attach`` fails the test that built the model, and shows as a difference.

The TransformerLens test sources are not in its wheel: take them from the sdist of the installed
version (``pip download --no-binary :all: --no-deps transformer-lens==X.Y.Z``, then untar).
The installed ``tl_connwalk`` is shadowed by this checkout's (``--package``).

    python benchmarks/tl_suite_with_attach.py --tl-source /tmp/transformer_lens-3.9.0 \\
        --out /tmp/tl_suite tests/unit/test_activation_cache.py tests/unit/model_bridge

``--modes plain attach`` runs only the first two (two thirds of the time). Exit status 0 when
every test has the same outcome in the runs made. The same file is the
pytest plugin of the runs (``-p tl_suite_with_attach``, mode from ``TL_CONNWALK_SUITE_MODE``).
"""

import argparse
import collections
import contextlib
import functools
import json
import os
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

MODES = ("plain", "attach", "detach")
_MODE_VARIABLE = "TL_CONNWALK_SUITE_MODE"
_LOG_VARIABLE = "TL_CONNWALK_SUITE_LOG"


# --- the pytest plugin ---------------------------------------------------------------------


def _model_classes() -> list[type]:
    """The model classes whose instances the runs attach to (those this TransformerLens has)."""
    import importlib

    classes = []
    for module, name in (
        ("transformer_lens.model_bridge", "TransformerBridge"),
        ("transformer_lens", "HookedTransformer"),
        ("transformer_lens", "HookedEncoder"),
    ):
        with contextlib.suppress(ImportError, AttributeError):
            classes.append(getattr(importlib.import_module(module), name))
    return classes


_depth: dict[int, int] = {}


def _record(entry: dict[str, Any]) -> None:
    with open(os.environ[_LOG_VARIABLE], "a") as log:
        log.write(json.dumps(entry) + "\n")


def _after_build(model: Any, mode: str) -> None:
    import tl_connwalk

    kind = type(model).__name__
    try:
        tl_connwalk.attach(model)
    except tl_connwalk.ConnWalkError as error:
        _record({"class": kind, "attach": "refused", "reason": str(error)[:300]})
        return
    if mode == "detach":
        tl_connwalk.detach(model)
    _record({"class": kind, "attach": "done"})


def _wrap_init(cls: type, mode: str) -> None:
    """Make ``cls.__init__`` attach once the outermost constructor of the instance returns."""
    original = cls.__dict__.get("__init__")
    if original is None or getattr(original, "_tl_suite_wrapped", False):
        return

    @functools.wraps(original)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        key = id(self)
        _depth[key] = _depth.get(key, 0) + 1
        try:
            original(self, *args, **kwargs)
        finally:
            _depth[key] -= 1
            outermost = _depth[key] == 0
            if outermost:
                del _depth[key]
        if outermost:
            _after_build(self, mode)

    __init__._tl_suite_wrapped = True  # type: ignore[attr-defined]
    cls.__init__ = __init__  # type: ignore[misc]


def _patch(root: type, mode: str) -> None:
    """Wrap the constructors of ``root``, its subclasses, and subclasses defined later."""
    stack = [root]
    while stack:
        cls = stack.pop()
        _wrap_init(cls, mode)
        stack.extend(cls.__subclasses__())
    previous = root.__dict__.get("__init_subclass__")

    def __init_subclass__(cls: type, **kwargs: Any) -> None:
        if previous is not None:
            previous.__func__(cls, **kwargs)
        else:
            super(root, cls).__init_subclass__(**kwargs)  # type: ignore[misc]
        _wrap_init(cls, mode)

    root.__init_subclass__ = classmethod(__init_subclass__)  # type: ignore[assignment]


def pytest_configure(config: Any) -> None:
    mode = os.environ.get(_MODE_VARIABLE, "plain")
    if mode == "plain":
        return
    for cls in _model_classes():
        _patch(cls, mode)


# --- the runner ----------------------------------------------------------------------------


def _outcomes(junit: Path) -> dict[str, str]:
    """``test id -> outcome`` from a JUnit XML report."""
    outcomes = {}
    for case in ET.parse(junit).iter("testcase"):
        name = f"{case.get('classname')}::{case.get('name')}"
        outcome = "passed"
        for child in case:
            if child.tag in ("failure", "error"):
                outcome = child.tag
            elif child.tag == "skipped":
                outcome = "xfailed" if child.get("type") == "pytest.xfail" else "skipped"
        outcomes[name] = outcome
    return outcomes


def _run(mode: str, args: argparse.Namespace, shadow: Path) -> dict[str, str]:
    junit, log = args.out / f"{mode}.xml", args.out / f"{mode}-attach.jsonl"
    log.unlink(missing_ok=True)
    env = dict(os.environ)
    env[_MODE_VARIABLE], env[_LOG_VARIABLE] = mode, str(log)
    env["PYTHONPATH"] = os.pathsep.join(
        [str(shadow), str(Path(__file__).parent), env.get("PYTHONPATH", "")]
    )
    command = [
        args.python, "-m", "pytest", "-p", "tl_suite_with_attach", "-p", "no:cacheprovider",
        "-o", "addopts=", "-q", "--no-header", "--continue-on-collection-errors",
        f"--junitxml={junit}",
        *(["-x"] if args.exitfirst else []), *args.paths,
    ]  # fmt: skip
    print(f"[{mode}] {' '.join(command)}", flush=True)
    with open(args.out / f"{mode}.log", "w") as output:
        subprocess.run(command, cwd=args.tl_source, env=env, stdout=output, stderr=output)
    return _outcomes(junit)


def _attach_summary(log: Path) -> str:
    if not log.exists():
        return "no model built"
    counts: collections.Counter[str] = collections.Counter()
    for line in log.read_text().splitlines():
        entry = json.loads(line)
        counts[f"{entry['attach']} {entry['class']}"] += 1
    return ", ".join(f"{n} {what}" for what, n in sorted(counts.items()))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("paths", nargs="+", help="test files or folders, relative to --tl-source")
    parser.add_argument("--tl-source", type=Path, required=True, help="untarred TL sdist")
    parser.add_argument("--out", type=Path, default=Path(tempfile.gettempdir()) / "tl_suite")
    parser.add_argument("--python", default=sys.executable, help="the Python with TL installed")
    parser.add_argument(
        "--package", type=Path, default=Path(__file__).resolve().parents[1] / "tl_connwalk"
    )
    parser.add_argument("--exitfirst", action="store_true")
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    args = parser.parse_args()
    if len(set(args.modes)) < 2:
        parser.error("--modes: name at least two runs to compare (plain and attach, say)")
    args.out.mkdir(parents=True, exist_ok=True)
    shadow = args.out / "shadow"
    shadow.mkdir(exist_ok=True)
    link = shadow / "tl_connwalk"
    link.unlink(missing_ok=True)
    link.symlink_to(args.package.resolve())
    runs = {mode: _run(mode, args, shadow) for mode in args.modes}
    for mode, outcomes in runs.items():
        counts = collections.Counter(outcomes.values())
        print(f"{mode:7s} {len(outcomes)} tests: {dict(sorted(counts.items()))}")
        if mode != "plain":
            print(f"        models: {_attach_summary(args.out / f'{mode}-attach.jsonl')}")
    names = sorted(set().union(*runs.values()))
    differing = [n for n in names if len({runs[m].get(n, "absent") for m in runs}) > 1]
    for name in differing:
        print("DIFFERS", name, {m: runs[m].get(name, "absent") for m in runs})
    print(f"{len(differing)} of {len(names)} tests differ")
    return 1 if differing else 0


if __name__ == "__main__":
    sys.exit(main())
