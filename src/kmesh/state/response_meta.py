"""The `kmesh` object a finished request reports: how its prompt was served.

kmesh serve puts it at the top level of every response (a stream: on its last content chunk);
KMeshConnector inside a plain vLLM server puts it in the request's output as
`kv_transfer_params["kmesh"]`. The engines build it as a plain dict (the reference engine:
serve/reference_backend.py; KMeshConnector: vllm/scheduler_side.py::request_finished; kmesh
serve adds `family`, `engine` and `branches`: serve/app.py::_totals). These models describe
that dict, field by field, for the reference pages (kmesh/reference_docs) and for clients
that want to validate it; tests/state/test_response_meta.py checks them against the names the
engines use.
"""

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class _Stats(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class RecoveryStats(_Stats):
    """What recovering the request cost (recovery/jobs.py::RecoveryReport), or why it was refused
    (then `refused` is the only field)."""

    refused: str | None = Field(
        default=None,
        description="Why recovery was refused: the request was computed exactly instead (an "
        "approximate recovery without an approximate `cache_salt`, a LoRA request, or an engine "
        "that cannot recover).",
    )
    computed_tokens: float | None = Field(
        default=None,
        description="What KMesh's executor computed for this request, in token-equivalents (a "
        "token run through some of the layers counts that share of a token).",
    )
    shared_computed_tokens: float | None = Field(
        default=None,
        description="A round's master, paid by the sibling that built it (token-equivalents).",
    )
    master_bytes: int | None = Field(
        default=None, description="The size of the round master this request built, else 0."
    )
    mirror_bytes: int | None = Field(
        default=None,
        description="The size of this request's mirrors of the round's master (indices and "
        "the sparse difference from the master).",
    )
    reused_tokens: int | None = Field(
        default=None,
        description="Claimed tokens whose KV came from stored segment KV (re-rotated).",
    )
    deviation: float | None = Field(
        default=None,
        description="Mean relative key deviation at the check layer, when it was computed.",
    )
    fell_back: bool | None = Field(
        default=None,
        description="The gate sent the claimed tokens back to the engine's own prefill.",
    )
    tail_tokens: int | None = Field(
        default=None,
        description="Claimed rows taken as they were from a kept tail continuing the prefix.",
    )
    restored_tokens: int | None = Field(
        default=None,
        description="Claimed rows restored from the store: a transcript another request published.",
    )
    restored_bytes: int | None = Field(
        default=None, description="The bytes read from the store for `restored_tokens`."
    )


class QualityStats(_Stats):
    """What served a request's quality target (recovery/quality.py)."""

    target: str = Field(description="The target the request named (`recovery.quality`).")
    served: str = Field(
        description="`exact`, or the calibrated setting that served it (e.g. `per_request "
        "recompute_ratio=0.3`)."
    )
    reason: str | None = Field(
        default=None,
        description="Why a target other than `exact` was served exactly: no calibrated "
        "setting for this model and kind of request meets it.",
    )


class ActivationStats(_Stats):
    """How KMeshConnector served a request under an activated LoRA adapter
    (vllm/activated.py::Activation)."""

    start: int | None = Field(
        description="The token the adapter applied from (rows before it are the base model's); "
        "null: vLLM applied it to every token, as a plain LoRA."
    )
    note: str | None = Field(
        default=None, description="What differs from what the request asked, if anything."
    )


class KMeshStats(_Stats):
    """The response's `kmesh` object. The five token counts are always there; the other fields
    only where they apply."""

    prompt_tokens: int = Field(
        description="The prompt's tokens (a forked branch: its parent's and its own)."
    )
    computed_tokens: int = Field(
        description="Prompt tokens the engine ran through the model itself (the reference "
        "engine counts a preempted request's again)."
    )
    reused_tokens: int = Field(
        description="Prompt tokens whose KV came from the engine's local prefix cache (a "
        "forked branch: from its parent; inside vLLM also `page_tail_tokens`)."
    )
    restored_tokens: int = Field(
        description="Prompt tokens whose KV was restored from the store (`kmesh store serve`)."
    )
    recovered_tokens: int = Field(
        description="Prompt tokens whose KV recovery filled (their cost is in `recovery`)."
    )
    page_tail_tokens: int | None = Field(
        default=None,
        description="Inside vLLM, when there are any: rows of `reused_tokens` copied from a "
        "partly used page an earlier request of the engine left (`page_tails`).",
    )
    kept_output_tokens: int | None = Field(
        default=None,
        description="When the request kept its output (`keep_output`): the generated tokens "
        "whose KV was kept.",
    )
    recovery: RecoveryStats | None = Field(
        default=None, description="When the request asked for recovery."
    )
    quality: QualityStats | None = Field(
        default=None, description="When the request named a quality target."
    )
    activation: ActivationStats | None = Field(
        default=None, description="Inside vLLM, under an activated LoRA adapter."
    )
    family: str | None = Field(default=None, description="The request's `kmesh.family`.")
    engine: Literal["reference", "vllm"] | None = Field(
        default=None, description="kmesh serve only: the engine that served the request."
    )
    branches: int | None = Field(
        default=None,
        description="kmesh serve only, with `n` > 1: the number of choices (the counts above "
        "are then summed over them).",
    )
