"""The measured routes table (kernels/routes.py): each name one kernel, buckets from timings, the lookup, the
fallbacks where a named kernel cannot run, the load-time decision about humming's copies, the shipped file."""

import json
import warnings

import pytest

from qerl.kernels import humming_backend, mma_backend, routes, settings


@pytest.fixture
def card_tables(monkeypatch):
    """Install `obj` as the routes file for a device called "card"."""
    def install(obj, name="card"):
        monkeypatch.setattr(routes.torch.cuda, "get_device_name", lambda device=None: name)
        monkeypatch.setattr(routes, "_tables", lambda: routes.parse(obj))
        routes.table_for.cache_clear()
    yield install
    routes.table_for.cache_clear()


def test_buckets_take_the_fastest_kernel_at_each_measured_m_and_merge_neighbours():
    t = {1: {"mma": 70.0, "humming_ns": 85.0}, 16: {"mma": 82.0, "humming_ns": 88.0},
         32: {"mma": 114.0, "humming_ns": 94.0}, 64: {"mma": 150.0, "humming_ns": 108.0},
         256: {"mma": float("nan"), "humming_ns": 230.0}}
    assert routes.from_timings(t) == [[16, "mma"], [None, "humming_ns"]]
    # a kernel not measured (nan) never wins; a win in the middle makes its own bucket
    t2 = {1: {"mma": 1.0, "humming_ns": float("nan")}, 8: {"mma": 3.0, "humming_ns": 2.0}, 16: {"mma": 1.0, "humming_ns": 2.0}}
    assert routes.from_timings(t2) == [[1, "mma"], [8, "humming_ns"], [None, "mma"]]


def test_a_near_tie_keeps_the_bucket_its_kernel_holds():
    t = {1: {"wgmma": 10.0, "humming_ns": 20.0}, 8: {"wgmma": 30.0, "humming_ns": 29.9},
         16: {"wgmma": 40.0, "humming_ns": 35.0}, 32: {"wgmma": 50.5, "humming_ns": 50.0}}
    assert routes.from_timings(t) == [[8, "wgmma"], [None, "humming_ns"]]


def test_a_call_takes_the_first_bucket_whose_bound_holds_it():
    table = routes.parse({"card": {"nvfp4": [[16, "mma"], [128, "humming_ns"], [None, "dequant_cublas"]]}})["card"]
    assert [table.pick(m) for m in (1, 16, 17, 128, 129, 100000)] == \
        ["mma", "mma", "humming_ns", "humming_ns", "dequant_cublas", "dequant_cublas"]


@pytest.mark.parametrize("lists,match", [
    ({"nvfp4": [[None, "cutlass"]]}, "card 'x' list nvfp4.*cutlass"),
    ({"nvfp4": [[None, "own"]]}, "'own'"),  # the old umbrella name: no name may hide a second table
    ({"nvfp4": [[16, "mma"], [None, "humming_sk"]]}, "repeatable one but names.*humming_sk"),
    ({"nvfp4": [[None, "mma"]], "nvfp4_stored": [[None, "wgmma"]]}, "list nvfp4_stored.*wgmma"),
])
def test_a_table_naming_what_cannot_run_there_is_refused_by_card_and_list(lists, match):
    with pytest.raises(ValueError, match=match):
        routes.parse({"x": lists})


def test_the_shipped_table_names_kernels_and_every_list_ends_open():
    tables = routes.parse(json.loads(routes.TABLE_PATH.read_text()))
    assert tables
    for t in tables.values():
        assert t.source and t.names() <= set(routes.BACKENDS)
        for lists in (t.lists, *t.shapes.values()):
            for buckets in lists.values():
                assert buckets[-1].m_max is None
                bounds = [b.m_max for b in buckets[:-1]]
                assert bounds == sorted(bounds)


def test_the_mode_in_force_picks_its_list_and_humming_off_or_no_table_gives_the_default(card_tables):
    card_tables({"card": {"nvfp4": [[None, "humming_ns"]], "nvfp4_streamk": [[16, "mma"], [None, "humming_sk"]],
                          "source": "s"}})
    assert routes.pick(64, None) == "humming_ns"
    with settings.use(humming_deterministic=False):
        assert routes.pick(64, None) == "humming_sk" and routes.pick(8, None) == "mma"
    with settings.use(humming=False):  # qerl's own kernels by routes.DEFAULT
        assert [routes.pick(m, None) for m in (1, 63, 64, 256, 257)] == \
            ["mma", "mma", "wgmma", "wgmma", "dequant_cublas"]
        assert routes.pick(64, None, stored=True) == "humming_ns"  # stored bytes: only humming reads them
    card_tables({})
    assert routes.pick(300, None) == "dequant_cublas" and routes.pick(300, None, stored=True) == "humming_ns"


def test_a_card_without_a_table_takes_the_nearest_cards_and_says_so_once(card_tables):
    obj = {"NVIDIA A100-SXM4-80GB": {"nvfp4": [[None, "mma"]]}, "NVIDIA H100 80GB HBM3": {"nvfp4": [[None, "wgmma"]]}}
    card_tables(obj, name="NVIDIA H200")
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        assert routes.pick(64, None) == "wgmma" and routes.pick(8, None) == "wgmma"
    said = [str(x.message) for x in w if "no measured kernel routes" in str(x.message)]
    assert len(said) == 1 and "'NVIDIA H100 80GB HBM3'" in said[0]


def test_a_measured_shape_takes_its_own_buckets_and_others_the_cards():
    obj = {"card": {"nvfp4": [[63, "mma"], [None, "wgmma"]], "nvfp4_streamk": [[16, "mma"], [None, "humming_sk"]],
                    "shapes": {"37888x3584": {"nvfp4": [[8, "mma"], [None, "humming_ns"]]},
                               "3584x18944": {"nvfp4": [[None, "wgmma"]], "nvfp4_streamk": [[None, "wgmma"]],
                                              "nvfp4_stored": [[64, "humming_ns"], [None, "humming_bi"]]}}}}
    t = routes.parse(obj)["card"]
    assert [t.pick(m, shape=(37888, 3584)) for m in (1, 8, 64)] == ["mma", "mma", "humming_ns"]
    assert t.pick(64, shape=(4608, 3584)) == "wgmma" and t.pick(64, True, (4608, 3584)) == "humming_sk"
    assert t.pick(64, True, (3584, 18944)) == "wgmma"
    # a shape without a stream-K list of its own takes the card's: the mode decides first, then the shape
    assert t.pick(64, True, (37888, 3584)) == "humming_sk"
    # a stored weight: only the stored lists answer, else humming's tiles without split (DEFAULT_STORED)
    assert [t.pick(m, shape=(3584, 18944), stored=True) for m in (64, 65)] == ["humming_ns", "humming_bi"]
    assert t.pick(64, shape=(37888, 3584), stored=True) == "humming_ns"


def test_each_humming_name_calls_humming_with_its_own_configs(monkeypatch):
    monkeypatch.setattr(humming_backend, "nosplit_tuning", lambda cfg, dev: f"ns {cfg}")
    assert humming_backend.call_configs("humming_ns", "L", None) == (None, "ns L")
    assert humming_backend.call_configs("humming_bi", "L", None) == (humming_backend.COMPUTE, None)
    assert humming_backend.call_configs("humming_sk", "L", None) == (None, None)
    with pytest.raises(ValueError, match="'humming'"):
        humming_backend.call_configs("humming", "L", None)


def test_bench_modes_map_to_kernels_and_stream_k_competes_only_in_its_list(tmp_path):
    from qerl.bench.kernels import candidates, write_routes

    r = {"bf16": 9.0, "nvfp4": 5.0, "mma": 5.0, "wgmma": None, "humming": 8.0, "humming_streamk": 4.0,
         "humming_nosplit": 7.0, "dequant": 6.0}
    c = candidates(r)
    assert (c["mma"], c["humming_bi"], c["humming_ns"], c["dequant_cublas"]) == (5.0, 8.0, 7.0, 6.0)
    assert "humming_sk" not in c and c["wgmma"] != c["wgmma"]  # not timed: nan, never wins
    assert candidates(r, streamk=True)["humming_sk"] == 4.0
    path = tmp_path / "routes.json"
    path.write_text(json.dumps({"other": {"nvfp4": [[None, "mma"]], "source": "kept"}}))
    det = {1: candidates({"mma": 73.0, "humming_nosplit": 85.0}), 64: candidates({"wgmma": 157.0, "humming_nosplit": 109.0})}
    sk = {1: candidates({"mma": 73.0, "humming_streamk": 80.0, "humming_nosplit": 85.0}, True),
          64: candidates({"wgmma": 157.0, "humming_streamk": 100.0, "humming_nosplit": 109.0}, True)}
    shapes = {"4608x3584": ({1: candidates({"mma": 5.0, "humming_nosplit": 6.0}),
                             64: candidates({"wgmma": 9.0, "humming_nosplit": 8.0})}, {})}
    write_routes(path, "card", det, lambda *_: None, sk, shapes)
    got = json.loads(path.read_text())
    assert got["other"]["source"] == "kept"
    card = got["card"]
    assert card["nvfp4"] == [[1, "mma"], [None, "humming_ns"]]
    assert card["nvfp4_streamk"] == [[1, "mma"], [None, "humming_sk"]]
    assert card["nvfp4_stored"] == [[None, "humming_ns"]] and card["nvfp4_stored_streamk"] == [[None, "humming_sk"]]
    assert card["shapes"]["4608x3584"] == {"nvfp4": [[1, "mma"], [None, "humming_ns"]],
                                           "nvfp4_stored": [[None, "humming_ns"]]}


def test_routes_from_a_saved_run_sum_each_shape_and_pick_per_shape(tmp_path):
    from qerl.bench.kernels import main, timings_from_results

    shapes = {}
    for g in ("qkv", "down"):
        for m, mma, wg, osk, sk in ((1, 8.5, None, 10.8, 10.0), (64, 18.8, 17.0, 13.5, 13.0), (256, None, 31.1, 24.3, 24.0)):
            if g == "down":
                osk = osk * 3
            shapes[f"qwen2.5-7b|{g}|{m}"] = {"bf16": 1.0, "nvfp4": mma or wg, "mma": mma, "wgmma": wg,
                                              "humming_nosplit": osk, "humming_streamk": sk}
    results = {"device": "card", "shapes": shapes}
    det, sk, per = timings_from_results(results)
    assert det[64]["humming_ns"] == pytest.approx(13.5 * 4) and det[64]["wgmma"] == 34.0
    assert set(per) == {"4608x3584", "3584x18944"} and sk[64]["humming_sk"] == 26.0
    (tmp_path / "run.json").write_text(json.dumps(results))
    main(["--routes-from", str(tmp_path / "run.json"), "--routes-path", str(tmp_path / "r.json"), "--command", "x"])
    got = routes.parse(json.loads((tmp_path / "r.json").read_text()))["card"]
    assert got.source.endswith("of x")
    assert got.pick(64, shape=(4608, 3584)) == "humming_ns" and got.pick(64, shape=(3584, 18944)) == "wgmma"
    assert got.pick(1, shape=(4608, 3584)) == "mma" and got.pick(256, True, (3584, 18944)) == "humming_sk"


@pytest.mark.parametrize("asked,m,wgmma_here,humming_here,served", [
    ("wgmma", 64, True, True, "wgmma"),
    ("wgmma", 64, False, True, "mma"),             # not an sm_90a card: mma.sync to M 64
    ("wgmma", 300, False, True, "dequant_cublas"),  # and dequantize + cuBLAS past it
    ("mma", 65, True, True, "dequant_cublas"),
    ("humming_ns", 64, True, False, "wgmma"),  # humming absent: routes.DEFAULT
    ("humming_bi", 8, True, False, "mma"),
    ("humming_ns", 64, True, True, "humming_ns"),
])
def test_a_named_kernel_that_cannot_run_here_falls_to_the_one_that_serves_it(monkeypatch, asked, m, wgmma_here,
                                                                             humming_here, served):
    monkeypatch.setattr(mma_backend.w4_wgmma, "available", lambda device: wgmma_here)
    monkeypatch.setattr(mma_backend.humming_backend, "available", lambda device=None: humming_here)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert mma_backend.runnable(asked, m, None) == served


def test_humming_copies_are_decided_at_load_from_the_model_and_the_card_not_free_memory(monkeypatch):
    gib = 2**30

    class Props:
        total_memory = 80 * gib
    monkeypatch.setattr(humming_backend.torch.cuda, "get_device_properties", lambda idx: Props())
    monkeypatch.setattr(humming_backend.torch.cuda, "mem_get_info", lambda *a: pytest.fail("free memory was read"))
    monkeypatch.setattr(humming_backend, "_COPIES", {})
    dev = humming_backend.torch.device("cuda", 0)
    assert humming_backend.copy_fits((4608, 3584), dev)  # no model planned on it: copies allowed
    shapes = [(4608, 3584), (37888, 3584)] * 28  # a 7B's q|k|v and gate|up: 2.23 GiB of copies
    monkeypatch.setattr(humming_backend.torch.cuda, "memory_allocated", lambda idx: 6 * gib)
    assert humming_backend.plan_copies(shapes, dev) and humming_backend.copy_fits((4608, 3584), dev)
    monkeypatch.setattr(humming_backend.torch.cuda, "memory_allocated", lambda idx: 47 * gib)  # a 72B's weights
    with pytest.warns(UserWarning, match=r"copies of 56 weights \(2\.2 GiB\) do not fit"):
        assert not humming_backend.plan_copies(shapes, dev)
    assert not humming_backend.copy_fits((4608, 3584), dev)


def test_only_shapes_the_list_in_force_sends_to_humming_need_copies(card_tables):
    card_tables({"card": {"nvfp4": [[None, "mma"]], "nvfp4_streamk": [[None, "humming_sk"]],
                          "shapes": {"37888x3584": {"nvfp4": [[8, "mma"], [None, "humming_ns"]]}}}})
    shapes = [(4608, 3584), (37888, 3584), (37888, 3584)]
    assert routes.copied_shapes(shapes, None) == [(37888, 3584), (37888, 3584)]
    with settings.use(humming_deterministic=False):
        assert routes.copied_shapes(shapes, None) == [(4608, 3584), (37888, 3584), (37888, 3584)]
    with settings.use(humming=False):
        assert routes.copied_shapes(shapes, None) == []


def test_nosplit_entries_turn_stream_k_off_and_keep_every_interval_and_tile():
    from qerl.kernels.humming_backend import nosplit_entries

    entries = [[1, 8, {"block_shape": [16, 128, 256], "use_stream_k": True, "num_sms": 132}],
               [9, 64, {"block_shape": [64, 128, 128], "use_stream_k": False, "num_sms": 100}]]
    out = nosplit_entries(entries)
    assert [e[:2] for e in out] == [[1, 8], [9, 64]]
    assert all(e[2]["use_stream_k"] is False for e in out)
    assert entries[0][2]["use_stream_k"] is True  # the heuristics' own (cached) list is not changed


def test_a_split_k_route_on_a_k_too_short_to_split_runs_humming_without_split(card_tables):
    """The stored list's humming_ksplit4 met a 512x256 weight on the H100 (K 256 has no 4 slices of 128): the
    stored path raised. Both the stored path and the copies now take humming_ns there."""
    card_tables({"card": {"nvfp4": [[None, "wgmma"]], "nvfp4_stored": [[None, "humming_ksplit4"]], "source": "s"}})
    assert routes.pick(64, None, (512, 256), stored=True) == "humming_ns"
    assert routes.pick(64, None, (512, 512), stored=True) == "humming_ksplit4"
    assert routes.pick(64, None, (512, 1024), stored=True) == "humming_ksplit4"
    assert routes.splittable("humming_ksplit2", (64, 384)) == "humming_ns"
    assert routes.splittable("wgmma", (64, 100)) == "wgmma"
