"""Field tables of pydantic models: JSON types, bounds, defaults, descriptions."""

import pytest
from pydantic import BaseModel, Field

from kmesh.reference_docs.fields import field_table, response_table


class _Inner(BaseModel):
    flag: bool = Field(default=False, description="A flag.")


def test_a_field_without_a_description_is_an_error():
    class Body(BaseModel):
        size: int = Field(default=1, ge=1)

    with pytest.raises(ValueError, match=r"Body\.size has no description"):
        field_table(Body, {})


def test_a_field_table_shows_type_bounds_default_and_description():
    class Body(BaseModel):
        name: str = Field(min_length=1, max_length=8, description="Its name.")
        share: float | None = Field(default=0.5, gt=0, le=1, description="A | share <x>.")
        items: list[int] | None = Field(default=None, min_length=1, description="`a<b>`.")

    rows = field_table(Body, {}).splitlines()
    assert rows[2] == "| `name` | string, 1 to 8 characters | required | Its name. |"
    assert rows[3] == "| `share` | number, in (0, 1] | `0.5` | A \\| share &lt;x>. |"
    assert rows[4] == "| `items` | array of integer, at least 1 item | — | `a<b>`. |"


def test_a_nested_model_links_to_its_own_table():
    class Body(BaseModel):
        inner: _Inner | None = Field(default=None, description="Inside.")

    assert "[object](#inner)" in response_table(Body, {_Inner: "#inner"})
    with pytest.raises(ValueError, match="no anchor for _Inner"):
        response_table(Body, {})
