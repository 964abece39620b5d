"""The benchmarks' chat workload (benchmarks/workload.py): a `Shape` read from the command line, and sessions
drawn within it, so a goodput run on another workload offers what it says."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

from workload import DEFAULT_SHAPE, Shape, Workload


def test_default_shape_reads_as_nothing_and_back() -> None:
    assert Shape.parse("") == DEFAULT_SHAPE
    assert DEFAULT_SHAPE.describe() == ""


def test_a_shape_reads_back_from_its_description() -> None:
    shape = Shape.parse("tenants=8, doc_tokens=100-6000,turns=2-8,answer_median=250,think_seconds=0.5")
    assert (shape.tenants, shape.doc_tokens, shape.turns, shape.answer_median, shape.think_seconds) == \
        (8, (100, 6000), (2, 8), 250, 0.5)
    assert shape.system_tokens == DEFAULT_SHAPE.system_tokens
    assert shape.mean_turns == 5.0
    assert Shape.parse(shape.describe()) == shape
    assert Shape.parse("turns=3").turns == (3, 3)


@pytest.mark.parametrize(("text", "named"), [
    ("tenant=8", "'tenant'"),
    ("turns=6-2", "turns='6-2'"),
    ("doc_tokens=a-b", "doc_tokens="),
    ("tenants=many", "tenants='many'"),
    ("think_seconds=-1", "think_seconds='-1'"),
    ("tenants=0", "tenants"),
    ("turns=0-3", "turns"),
])
def test_a_bad_key_or_value_is_named(text: str, named: str) -> None:
    with pytest.raises(ValueError) as caught:
        Shape.parse(text)
    assert named in str(caught.value)


def test_sessions_are_drawn_within_the_shape() -> None:
    shape = Shape.parse("tenants=3,system_tokens=50,doc_tokens=10-20,turns=2-4,question_tokens=5-7,"
                        "answer_median=40,answer_range=30-50,think_seconds=0")
    workload = Workload(seed=7, shape=shape)
    assert len(workload.systems) == 3
    sessions = [workload.session() for _ in range(200)]
    assert {s.system for s in sessions} == set(workload.systems)
    for s in sessions:
        assert 2 <= len(s.turns) <= 4
        assert 10 <= len(s.document.split()) <= 20
        assert all(5 <= len(t.question.split()) <= 7 and 30 <= t.max_tokens <= 50 for t in s.turns)
        assert s.think == [0.0] * len(s.turns)
    assert {len(s.turns) for s in sessions} == {2, 3, 4}


def test_prefix_free_sessions_share_nothing_whatever_the_shape() -> None:
    workload = Workload(seed=7, shared=False, shape=Shape.parse("tenants=2,turns=3-5,system_tokens=20"))
    sessions = [workload.session() for _ in range(50)]
    assert all(len(s.turns) == 1 for s in sessions)
    assert len({s.system for s in sessions}) == 50
