"""The ``tl-connwalk`` command line.

``tl-connwalk demo`` (the default) builds a small randomly initialised GPT-2-style
``TransformerBridge`` offline (TransformerLens 3.x and 4.x), checks the paper's first theorem on
every layer (the connection walk rebuilds the attention output ``attn.o.hook_out``) and prints
one layer's walk, gates and one edge's transport.
"""

import argparse
import sys
from collections.abc import Sequence

import torch

from tl_connwalk.cache import connection_walk
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


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tl-connwalk", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command")
    demo_parser = commands.add_parser("demo", help="identity check and walk of a small model")
    demo_parser.add_argument("--seed", type=int, default=0)
    demo_parser.add_argument("--positions", type=int, default=8)
    args = parser.parse_args(argv)
    if args.command in (None, "demo"):
        return demo(getattr(args, "seed", 0), getattr(args, "positions", 8))
    parser.error(f"unknown command {args.command}")
    return 2


if __name__ == "__main__":
    sys.exit(main())
