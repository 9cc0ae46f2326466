"""The measured routes table (kernels/routes.py): buckets from timings, the lookup, the shipped file."""

import json

import pytest

from qerl.kernels import routes


def test_buckets_take_the_fastest_backend_at_each_measured_m_and_merge_neighbours():
    t = {1: {"own": 70.0, "humming": 85.0}, 16: {"own": 82.0, "humming": 88.0},
         32: {"own": 114.0, "humming": 94.0}, 256: {"own": 320.0, "humming": 230.0}, 64: {"own": 150.0, "humming": 108.0}}
    assert routes.from_timings(t) == [[16, "own"], [None, "humming"]]
    # a backend that was not measured (nan) never wins; a win in the middle makes its own bucket
    t2 = {1: {"own": 1.0, "humming": float("nan")}, 8: {"own": 3.0, "humming": 2.0}, 16: {"own": 1.0, "humming": 2.0}}
    assert routes.from_timings(t2) == [[1, "own"], [8, "humming"], [None, "own"]]


def test_a_call_takes_the_first_bucket_whose_bound_holds_it():
    table = routes.parse({"card": {"nvfp4": [[16, "own"], [128, "humming"], [None, "own"]]}})["card"]
    assert [table.pick(m) for m in (1, 16, 17, 128, 129, 100000)] == ["own", "own", "humming", "humming", "own", "own"]


def test_a_table_naming_an_unknown_backend_is_refused_by_card():
    with pytest.raises(ValueError, match="card 'x'.*cutlass"):
        routes.parse({"x": {"nvfp4": [[None, "cutlass"]]}})


def test_the_shipped_table_parses_and_every_card_ends_open():
    tables = routes.parse(json.loads(routes.TABLE_PATH.read_text()))
    assert tables
    for t in tables.values():
        assert t.buckets[-1].m_max is None and t.source
        bounds = [b.m_max for b in t.buckets[:-1]]
        assert bounds == sorted(bounds)
