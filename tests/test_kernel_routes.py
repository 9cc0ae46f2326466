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
    # humming without split is a third candidate (bit-repeatable, so it may serve the deterministic table)
    t3 = {1: {"own": 73.0, "humming": 221.0, "humming_nosplit": 150.0},
          64: {"own": 157.0, "humming": 239.0, "humming_nosplit": 120.0},
          256: {"own": 321.0, "humming": 462.0, "humming_nosplit": float("nan")}}
    assert routes.from_timings(t3) == [[1, "own"], [64, "humming_nosplit"], [None, "own"]]


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


def test_humming_stream_k_has_its_own_table_picked_by_the_setting(monkeypatch, tmp_path):
    from qerl.kernels import settings

    obj = {"card": {"nvfp4": [[None, "own"]], "nvfp4_streamk": [[16, "own"], [None, "humming"]], "source": "s"}}
    table = routes.parse(obj)["card"]
    assert [table.pick(m) for m in (1, 64)] == ["own", "own"]
    assert [table.pick(m, streamk=True) for m in (1, 16, 17, 2048)] == ["own", "own", "humming", "humming"]
    # a card whose stream-K table was not measured uses its one table in both modes
    plain = routes.parse({"c": {"nvfp4": [[8, "humming"], [None, "own"]]}})["c"]
    assert plain.pick(4, streamk=True) == "humming" and plain.pick(64, streamk=True) == "own"
    with pytest.raises(ValueError, match="card 'y'.*marlin"):
        routes.parse({"y": {"nvfp4": [[None, "own"]], "nvfp4_streamk": [[None, "marlin"]]}})
    # routes.pick follows KernelSettings.humming_deterministic
    monkeypatch.setattr(routes.torch.cuda, "get_device_name", lambda device=None: "card")
    monkeypatch.setattr(routes, "_tables", lambda: routes.parse(obj))
    routes.table_for.cache_clear()
    try:
        assert routes.pick(64, None) == "own"
        with settings.use(humming_deterministic=False):
            assert routes.pick(64, None) == "humming" and routes.pick(8, None) == "own"
    finally:
        routes.table_for.cache_clear()


def test_bench_kernels_writes_both_tables_from_one_run(tmp_path):
    from qerl.bench.kernels import write_routes

    path = tmp_path / "routes.json"
    path.write_text(json.dumps({"other": {"nvfp4": [[None, "humming"]], "source": "kept"}}))
    det = {1: {"own": 73.0, "humming": 221.0}, 64: {"own": 157.0, "humming": 239.0}}
    sk = {1: {"own": 73.0, "humming": 86.0}, 64: {"own": 157.0, "humming": 109.0}}
    write_routes(path, "card", det, lambda *_: None, sk)
    got = json.loads(path.read_text())
    assert got["other"]["source"] == "kept"
    assert got["card"]["nvfp4"] == [[None, "own"]] and got["card"]["nvfp4_streamk"] == [[1, "own"], [None, "humming"]]
    write_routes(path, "card2", det, lambda *_: None)
    assert "nvfp4_streamk" not in json.loads(path.read_text())["card2"]


def test_a_measured_shape_takes_its_own_buckets_and_others_the_cards(monkeypatch):
    from qerl.kernels import settings

    obj = {"card": {"nvfp4": [[None, "own"]], "nvfp4_streamk": [[16, "own"], [None, "humming"]], "source": "s",
                    "shapes": {"37888x3584": {"nvfp4": [[8, "own"], [None, "humming_nosplit"]]},
                               "3584x18944": {"nvfp4": [[None, "own"]], "nvfp4_streamk": [[None, "own"]]}}}}
    t = routes.parse(obj)["card"]
    assert [t.pick(m, shape=(37888, 3584)) for m in (1, 8, 64)] == ["own", "own", "humming_nosplit"]
    assert t.pick(64, shape=(4608, 3584)) == "own" and t.pick(64, True, (4608, 3584)) == "humming"
    assert t.pick(64, True, (3584, 18944)) == "own"
    # a shape without a stream-K list of its own takes the card's: the mode decides first, then the shape
    assert t.pick(64, True, (37888, 3584)) == "humming" and t.pick(8, True, (37888, 3584)) == "own"
    # a weight stored in humming's layout: the stored lists, else the mode's list with own read as humming
    assert t.pick(1, shape=(37888, 3584), stored=True) == "humming" and t.pick(64, shape=(37888, 3584), stored=True) \
        == "humming_nosplit"
    st = routes.parse({"c": {"nvfp4": [[None, "own"]], "nvfp4_stored": [[8, "humming_nosplit"], [None, "humming"]],
                             "shapes": {"1x2": {"nvfp4": [[None, "own"]], "nvfp4_stored_streamk": [[None, "humming_nosplit"]]}}}})["c"]
    assert [st.pick(m, stored=True) for m in (1, 8, 9)] == ["humming_nosplit", "humming_nosplit", "humming"]
    assert st.pick(1, False, (1, 2), stored=True) == "humming_nosplit"  # the card's stored list (the shape has none)
    assert st.pick(1, True, (1, 2), stored=True) == "humming_nosplit" and st.pick(1, True, (3, 4), stored=True) \
        == "humming_nosplit"  # stream-K: the shape's stored list; another shape: the card's stored list
    assert st.pick(64, True) == "own" and st.pick(64) == "own"
    with pytest.raises(ValueError, match="card 'card' shape 1x2.*marlin"):
        routes.parse({"card": {"nvfp4": [[None, "own"]], "shapes": {"1x2": {"nvfp4": [[None, "marlin"]]}}}})
    monkeypatch.setattr(routes.torch.cuda, "get_device_name", lambda device=None: "card")
    monkeypatch.setattr(routes, "_tables", lambda: routes.parse(obj))
    routes.table_for.cache_clear()
    try:
        assert routes.pick(64, None, (37888, 3584)) == "humming_nosplit" and routes.pick(64, None) == "own"
        with settings.use(humming_deterministic=False):
            assert routes.pick(64, None, (3584, 18944)) == "own" and routes.pick(64, None, (1, 1)) == "humming"
    finally:
        routes.table_for.cache_clear()


def test_bench_kernels_writes_each_shapes_buckets_from_its_own_timings(tmp_path):
    from qerl.bench.kernels import candidates, write_routes

    # one measurement's µs by bench mode -> the table's candidates (humming_streamk stands in for humming there)
    r = {"bf16": 9.0, "nvfp4": 5.0, "humming": 8.0, "humming_streamk": 4.0, "humming_nosplit": None}
    c = candidates(r)
    assert (c["own"], c["humming"]) == (5.0, 8.0) and c["humming_nosplit"] != c["humming_nosplit"]  # nan: never wins
    assert candidates(r, streamk=True)["humming"] == 4.0
    path = tmp_path / "routes.json"
    det = {1: {"own": 73.0, "humming": 221.0}, 64: {"own": 157.0, "humming": 239.0}}
    shapes = {"3584x18944": ({1: {"own": 20.0, "humming_nosplit": 30.0}, 64: {"own": 50.0, "humming_nosplit": 40.0}},
                             {}),
              "4608x3584": ({1: {"own": 5.0, "humming": 6.0}, 64: {"own": 9.0, "humming": 8.0}},
                            {1: {"own": 5.0, "humming": 4.0}, 64: {"own": 9.0, "humming": 3.0}})}
    write_routes(path, "card", det, lambda *_: None, None, shapes)
    got = json.loads(path.read_text())["card"]["shapes"]
    # each list from its own timings; the stored lists leave qerl's own path out (it cannot read humming's layout)
    assert got == {"3584x18944": {"nvfp4": [[1, "own"], [None, "humming_nosplit"]],
                                  "nvfp4_stored": [[None, "humming_nosplit"]]},
                   "4608x3584": {"nvfp4": [[1, "own"], [None, "humming"]], "nvfp4_stored": [[None, "humming"]],
                                 "nvfp4_streamk": [[None, "humming"]], "nvfp4_stored_streamk": [[None, "humming"]]}}


def test_a_near_tie_keeps_the_bucket_its_backend_holds():
    t = {1: {"own": 10.0, "humming_nosplit": 20.0}, 8: {"own": 30.0, "humming_nosplit": 29.9},
         16: {"own": 40.0, "humming_nosplit": 35.0}, 32: {"own": 50.5, "humming_nosplit": 50.0}}
    # M 8: own within 2 % keeps its bucket; M 16: a clear win moves it; M 32: own within 2 % but no longer holding
    assert routes.from_timings(t) == [[8, "own"], [None, "humming_nosplit"]]


def test_routes_from_a_saved_run_sum_each_shape_and_pick_per_shape(tmp_path):
    """bench kernels --routes-from a run's bench_kernels.json: the layer set's timings are the shapes' sums, each
    shape gets its own lists, and a mode timed nowhere leaves its lists out. (On the H100 run of 1758d4c it
    rebuilt the lists that run's --write-routes had written, before the tie rule existed.)"""
    from qerl.bench.kernels import main, timings_from_results

    shapes = {}
    for g, (n, k) in (("qkv", (4608, 3584)), ("down", (3584, 18944))):
        for m, own, bi, ns, sk in ((1, 8.5, 24.7, 24.7, 10.8), (64, 18.8, 26.8, 26.7, 13.5), (256, 31.1, 47.2, 40.0, 24.3)):
            if g == "down":
                own, ns = own * 2.5, ns * 0.5
            shapes[f"qwen2.5-7b|{g}|{m}"] = {"bf16": 1.0, "nvfp4": own, "humming": bi, "humming_nosplit": ns,
                                              "humming_streamk": sk, "nvfp4_lora32": None}
    results = {"device": "card", "shapes": shapes}
    det, sk, per = timings_from_results(results)
    assert {k: det[64][k] for k in ("own", "humming", "humming_nosplit")} == \
        {"own": 18.8 + 47.0, "humming": 26.8 * 2, "humming_nosplit": 26.7 + 13.35}
    assert det[64]["humming_ksplit4"] != det[64]["humming_ksplit4"]  # not timed: nan, never wins
    assert sk[64]["humming"] == 27.0 and set(per) == {"4608x3584", "3584x18944"}
    (tmp_path / "run.json").write_text(json.dumps(results))
    main(["--routes-from", str(tmp_path / "run.json"), "--routes-path", str(tmp_path / "r.json"), "--command", "x"])
    got = routes.parse(json.loads((tmp_path / "r.json").read_text()))["card"]
    assert got.source.endswith("of x") and got.pick(64, shape=(3584, 18944)) == "humming_nosplit"
    assert got.pick(64, shape=(4608, 3584)) == "own" and got.pick(256, True, (4608, 3584)) == "humming"
    assert got.pick(256, shape=(4608, 3584), stored=True) == "humming_nosplit"
    # a run without humming: own everywhere, no stored lists, nothing refused
    bare = {"device": "card", "shapes": {k: {"bf16": 1.0, "nvfp4": v["nvfp4"]} for k, v in shapes.items()}}
    (tmp_path / "bare.json").write_text(json.dumps(bare))
    main(["--routes-from", str(tmp_path / "bare.json"), "--routes-path", str(tmp_path / "b.json")])
    written = json.loads((tmp_path / "b.json").read_text())["card"]
    assert written["nvfp4"] == [[None, "own"]] and "nvfp4_stored" not in written
    assert routes.parse({"card": written})["card"].pick(64, shape=(3584, 18944), stored=True) == "humming"


def test_a_table_built_without_its_deterministic_list_is_refused():
    with pytest.raises(ValueError, match="card 'c' shape 1x2 has no buckets"):
        routes.Table("c", {"nvfp4": (routes.Bucket(None, "own"),)}, "s", {"1x2": {"nvfp4_streamk": ()}})


def test_nosplit_entries_turn_stream_k_off_and_keep_every_interval_and_tile():
    from qerl.kernels.humming_backend import nosplit_entries

    entries = [[1, 8, {"block_shape": [16, 128, 256], "use_stream_k": True, "num_sms": 132}],
               [9, 64, {"block_shape": [64, 128, 128], "use_stream_k": False, "num_sms": 100}]]
    out = nosplit_entries(entries)
    assert [e[:2] for e in out] == [[1, 8], [9, 64]]
    assert all(e[2]["use_stream_k"] is False for e in out)
    assert [e[2]["block_shape"] for e in out] == [[16, 128, 256], [64, 128, 128]]
    assert entries[0][2]["use_stream_k"] is True  # the heuristics' own (cached) list is not changed


def test_each_routed_humming_mode_calls_humming_with_its_own_configs(monkeypatch):
    from qerl.kernels import humming_backend, settings

    monkeypatch.setattr(humming_backend, "nosplit_tuning", lambda cfg, dev: [[1, 8, {"cfg": cfg}]])
    assert humming_backend.call_configs("humming_nosplit", "L", None) == (None, [[1, 8, {"cfg": "L"}]])
    assert humming_backend.call_configs("humming", "L", None) == (humming_backend.COMPUTE, None)
    with settings.use(humming_deterministic=False):
        assert humming_backend.call_configs("humming", "L", None) == (None, None)
        assert humming_backend.call_configs("humming_nosplit", "L", None)[1] is not None


def test_split_k_is_a_backend_for_both_layouts_and_own_never_for_stored_weights(tmp_path):
    from qerl.bench.kernels import candidates, write_routes

    r = {"nvfp4": 40.0, "humming": 120.0, "humming_nosplit": 110.0, "humming_ksplit4": 20.0, "humming_ksplit2": 30.0}
    assert candidates(r)["humming_ksplit4"] == 20.0 and candidates(r, True)["humming_ksplit2"] == 30.0
    path = tmp_path / "routes.json"
    det = {1: {"own": 10.0, "humming_ksplit4": 15.0, "humming_nosplit": 60.0},
           64: {"own": 40.0, "humming_ksplit4": 20.0, "humming_nosplit": 110.0}}
    write_routes(path, "card", det, lambda *_: None)
    got = json.loads(path.read_text())["card"]
    assert got["nvfp4"] == [[1, "own"], [None, "humming_ksplit4"]]
    # the stored layout's lists: own left out, split-K kept (it reads the stored rows as slices)
    assert got["nvfp4_stored"] == [[None, "humming_ksplit4"]]
    t = routes.parse({"card": got})["card"]
    assert t.pick(64) == "humming_ksplit4" and t.pick(64, stored=True) == "humming_ksplit4"
    assert routes.parse({"c": {"nvfp4": [[None, "humming_ksplit2"]]}})["c"].pick(8, stored=True) == "humming_ksplit2"
    assert routes.parse({"c": {"nvfp4": [[None, "own"]]}})["c"].pick(8, stored=True) == "humming"
