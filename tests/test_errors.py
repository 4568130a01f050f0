"""``errors.first_problem``: the one place a pydantic error becomes the pieces of a one-line message."""

from __future__ import annotations

import pytest
from pydantic import BaseModel, ValidationError, field_validator

from toposched.errors import first_problem


class _Inner(BaseModel):
    size: int


class _Outer(BaseModel):
    name: str
    items: list[_Inner]

    @field_validator("name")
    @classmethod
    def _short(cls, value: str) -> str:
        if len(value) > 3:
            raise ValueError(f"name {value!r} is\n  too long")
        return value


def test_the_first_problem_names_its_path_field_and_input() -> None:
    with pytest.raises(ValidationError) as caught:
        _Outer.model_validate({"name": "ok", "items": [{"size": 1}, {"size": "many"}]})
    problem = first_problem(caught.value)
    assert problem.loc == ("items", 1, "size") and problem.path == "items.1.size" and problem.field == "items"
    assert problem.input == "many" and "integer" in problem.msg


def test_a_validators_own_message_reads_without_pydantics_prefix_on_one_line() -> None:
    with pytest.raises(ValidationError) as caught:
        _Outer.model_validate({"name": "toolong", "items": []})
    problem = first_problem(caught.value)
    assert problem.msg.startswith("Value error, ")
    assert problem.reason == "name 'toolong' is too long"
