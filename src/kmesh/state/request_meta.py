"""The `kmesh` object a request carries: its family and its segments, as a caller writes them.

The same object is accepted by `kmesh serve` (top-level body field `kmesh`, both engines) and by
a plain vLLM server running KMeshConnector (`kv_transfer_params: {"kmesh": {...}}`), e.g.

    {"family": "f1", "branches": 8,
     "segments": [{"text": "...", "role": "shared", "id": "trunk"},
                  {"text": "...", "role": "private"}]}

The segments' concatenation is the prompt. The leading run of shared segments is the family's
trunk: its full blocks stay pinned in the store while the family is open. A family closes when a
request of it carrying `"close": true` finishes, or when `branches` requests of it have finished
on that engine (each engine counts its own), or when the engine stops.
"""

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from kmesh.errors import InvalidRequestError

KMESH_PARAMS_KEY = "kmesh"
MAX_NAME_CHARS = 200


class SegmentSpec(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    text: str = Field(min_length=1)
    role: Literal["shared", "private", "instruction"] = "private"
    id: str | None = Field(default=None, min_length=1, max_length=MAX_NAME_CHARS)


class RecoverySpec(BaseModel):
    """Recovery inside vLLM: KMeshConnector claims the prompt's full blocks after vLLM's local
    prefix hit and fills them itself. Only policy "full" exists there so far: every claimed token
    is recomputed by KMesh's executor on the model's weights (the plumbing, and the fallback of
    the approximate policies to come). The reference engine computes the whole prompt anyway:
    there it changes nothing."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    policy: Literal["full"] = "full"


class KMeshParams(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    family: str | None = Field(default=None, min_length=1, max_length=MAX_NAME_CHARS)
    branches: int | None = Field(default=None, ge=1)
    close: bool = False
    segments: list[SegmentSpec] | None = Field(default=None, min_length=1)
    recovery: RecoverySpec | None = None

    @model_validator(mode="after")
    def _family_fields_need_a_family(self) -> "KMeshParams":
        if self.family is None and (self.branches is not None or self.close):
            raise ValueError("'branches' and 'close' need a 'family'")
        return self

    @property
    def prompt_text(self) -> str | None:
        """The prompt the segments spell, or None without segments."""
        return None if self.segments is None else "".join(s.text for s in self.segments)

    @property
    def trunk_texts(self) -> list[str]:
        """Texts of the leading shared segments (the family's trunk)."""
        trunk = []
        for segment in self.segments or []:
            if segment.role != "shared":
                break
            trunk.append(segment.text)
        return trunk


def parse_kmesh_params(value: object) -> KMeshParams:
    """Validate a caller's `kmesh` object; InvalidRequestError says what is wrong."""
    try:
        return KMeshParams.model_validate(value)
    except ValidationError as error:
        problems = "; ".join(
            f"kmesh.{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" if e["loc"] else e["msg"]
            for e in error.errors()
        )
        raise InvalidRequestError(f"malformed kmesh field: {problems}") from None


def encode_segments(tokenizer: Any, params: KMeshParams) -> tuple[list[int], int]:
    """The prompt's token ids as the concatenation of each segment's own tokens (so segment
    boundaries fall on token boundaries, and every engine sees the same ids), and the number
    of trunk tokens (the leading shared segments)."""
    if params.segments is None:
        raise InvalidRequestError("kmesh.segments is missing: there is nothing to encode")
    ids: list[int] = list(tokenizer("", add_special_tokens=True)["input_ids"])
    trunk = len(ids) if params.trunk_texts else 0
    in_trunk = bool(params.trunk_texts)
    for segment in params.segments:
        ids.extend(tokenizer(segment.text, add_special_tokens=False)["input_ids"])
        in_trunk = in_trunk and segment.role == "shared"
        if in_trunk:
            trunk = len(ids)
    return ids, trunk
