"""``Route``: one source -> component -> ... -> target path and its exact share (spec §6)."""

import dataclasses


@dataclasses.dataclass(frozen=True)
class Route:
    """One route from a source token to the target through the frozen network ``F``.

    ``F`` is linear in the embeddings once its gains are frozen, so the contribution of a
    source ``c_s`` expands exactly into a sum over routes: the embedding ``e_s`` read by a
    first component, whose output is read by a later component, and so on, the last output
    read by the target along the frozen gradient. Summed over every route of ``s`` (the
    empty one included: the embedding read directly by the target), the contributions are
    ``c_s``.

    Attributes:
        batch: the sequence.
        source: the source position ``s``.
        components: the components passed, in the order of the forward pass, named as
            `Attribution.component_names` names them (``"L3H2"``, ``"L5MLP"``); ``()`` is the
            direct path of the embedding.
        contribution: the route's exact share of the target.
    """

    batch: int
    source: int
    components: tuple[str, ...]
    contribution: float

    def __str__(self) -> str:
        path = " -> ".join((f"pos {self.source}", *self.components, "target"))
        return f"{path}: {self.contribution:+.4g}"
