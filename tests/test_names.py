"""toposched.names: the one rule for each kind of name that reaches scripts, files and YAML."""

from __future__ import annotations

import pytest

from toposched.errors import InputError
from toposched.names import (
    check_id,
    check_node_name,
    id_problem,
    label_problem,
    label_value_problem,
    node_name_problem,
    placement_id_problem,
    word_problem,
)

HOSTILE = ["a\nb", "$(id)", "`id`", "a;b", "a b", "'a'", '"a"', "../x", "", "-x", "a\x00", "é", "a\u2028b"]


@pytest.mark.parametrize("value", HOSTILE)
def test_hostile_values_fail_every_rule(value: str) -> None:
    for problem in (node_name_problem, id_problem, label_problem, word_problem, placement_id_problem):
        assert problem(value) is not None, (problem.__name__, value)


@pytest.mark.parametrize("value", ["gpu-node-01", "h100-00.rack-1.example.com", "DGX-A100-01", "a"])
def test_hostnames_are_node_names(value: str) -> None:
    assert node_name_problem(value) is None


@pytest.mark.parametrize("value", ["a:b", "a_b", "a." + "b" * 64, "x" * 254, "-a", "a-", "a..b"])
def test_node_names_follow_rfc_1123(value: str) -> None:
    assert node_name_problem(value) is not None


def test_ids_and_placement_ids() -> None:
    for path_like in ("a/../b", "a/b"):  # one path component at most (labels, never file names, may hold '/')
        assert id_problem(path_like) and placement_id_problem(path_like) and node_name_problem(path_like)
    assert id_problem("llama-70b_prod.v2") is None and id_problem("x" * 121) is not None
    assert placement_id_problem("req-1") is None and placement_id_problem("req-12345") is None
    assert placement_id_problem("x" * 120 + "-3") is None  # a 120-character request id and its replica suffix
    assert placement_id_problem("x" * 121) is not None


def test_label_values_may_be_empty_but_labels_may_not() -> None:
    assert label_value_problem("") is None and label_problem("") is not None
    assert label_problem("topology.kubernetes.io/zone") is None


def test_check_functions_raise_input_errors_naming_the_source() -> None:
    with pytest.raises(InputError, match=r"^plan.json: node name 'a\\nb' is not a hostname"):
        check_node_name("a\nb", source="plan.json")
    with pytest.raises(InputError, match="request id"):
        check_id("../x", what="request id")
    assert check_node_name("gpu-0") == "gpu-0"
