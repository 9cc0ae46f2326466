"""Which kernel serves a dense 4-bit matmul of M tokens on this card: a table measured side by side.

`qerl bench kernels --write-routes` times every candidate kernel on the card (qerl's mma.sync, wgmma and
dequantize + cuBLAS, humming-kernels' modes) and writes, per card and weight shape, the fastest kernel for each
measured M (`routes.json` beside this file); a call of M tokens takes the first bucket whose bound is >= M. The one
owner of that choice: mma_backend and the stored humming layout ask `pick`, and run the kernel it names.
A card with no table of its own uses the nearest card's (by name), and says so once.
"""

from __future__ import annotations

import json
import warnings
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

import torch

from .m_thresholds import W4_WGMMA_MAX_M, W4_WGMMA_ROUTE_MIN_M

TABLE_PATH = Path(__file__).with_name("routes.json")
# Each name is one kernel, the one that runs (no second table of thresholds under any of them):
OWN = ("mma", "wgmma", "dequant_cublas")  # qerl's mma.sync (M <= 64), Hopper wgmma (M 9-256), dequantize + cuBLAS
# humming-kernels on its own copy of the weight (or the stored humming layout), one name a mode of its kernel:
# humming_bi: batch-invariant tiles (its use_batch_invariant); humming_ns: its default tiles, no split;
# humming_sk: its default stream-K (partial sums in arrival order: other bits each call, so only in the _streamk lists);
# humming_sk2: its stream-K on a grid that cuts no tile into more than two slices (one store, one add: repeatable,
# kernels/humming_sk2.py).
# (humming's stream-K made repeatable, TMA stores off and at most 3 slices a tile so that they add in lock order, ran
# 30-750x slower than its stream-K on the H100 at bc1ce0b, and TMA stores off alone cost 10-60 %: retired.)
HUMMING = ("humming_bi", "humming_ns", "humming_sk", "humming_sk2")
# humming_ksplitS: K cut into S slices run as one grouped GEMM and summed in a fixed order (kernels/humming_ksplit.py)
KSPLIT = {"humming_ksplit2": 2, "humming_ksplit4": 4}
BACKENDS = (*OWN, *HUMMING, *KSPLIT)
STORED = (*HUMMING, *KSPLIT)  # what a weight stored in humming's layout can run
NOT_REPEATABLE = ("humming_sk",)  # never in a repeatable list (nvfp4, nvfp4_stored)
# What serves M tokens where no card has a table (or humming is off/absent): each own kernel where it is fastest
# by the figures in m_thresholds (mma.sync to M 63, wgmma 64-256, dequantize + cuBLAS above); for a stored weight,
# humming's tiles without split (bit-repeatable; humming is the only reader of that layout).
DEFAULT = ((W4_WGMMA_ROUTE_MIN_M - 1, "mma"), (W4_WGMMA_MAX_M, "wgmma"), (None, "dequant_cublas"))
DEFAULT_STORED = ((None, "humming_ns"),)


@dataclass(frozen=True)
class Bucket:
    m_max: int | None  # None: every larger M
    backend: str


# The lists a card's table may hold, each [[m_max, backend], ...]: `nvfp4` for the deterministic mode, `_streamk`
# for humming's stream-K mode, `_stored` for NVFP4 stored in humming's layout (formats/nvfp4_humming.py), where
# qerl's own kernels cannot read the bytes and only humming's modes compete.
KINDS = ("nvfp4", "nvfp4_streamk", "nvfp4_stored", "nvfp4_stored_streamk")


def _order(streamk: bool, stored: bool) -> tuple[str, ...]:
    """Which lists answer, first found first: a mode's own list, else the deterministic one."""
    if stored:  # only humming reads that layout: only its lists answer (else DEFAULT_STORED)
        return ("nvfp4_stored_streamk", "nvfp4_stored") if streamk else ("nvfp4_stored",)
    return ("nvfp4_streamk", "nvfp4") if streamk else ("nvfp4",)


@dataclass(frozen=True)
class Table:
    card: str
    lists: dict[str, tuple[Bucket, ...]]  # KINDS -> buckets; "nvfp4" always present
    source: str  # command, commit and date of the measurement
    # per weight shape "NxK" measured on its own, the same lists. The down projection's long K wants a split that a
    # wide gate|up does not, so one winner per M for a whole layer set leaves time on the table.
    shapes: dict[str, dict[str, tuple[Bucket, ...]]] = field(default_factory=dict)

    def __post_init__(self):
        for where, lists in [("", self.lists), *((f" shape {k}", v) for k, v in self.shapes.items())]:
            if not lists.get("nvfp4"):
                raise ValueError(f"{TABLE_PATH.name}: card {self.card!r}{where} has no buckets")

    @property
    def buckets(self) -> tuple[Bucket, ...]:
        return self.lists["nvfp4"]

    def pick(self, m: int, streamk: bool = False, shape: tuple[int, int] | None = None, stored: bool = False) -> str:
        own = self.shapes.get(shape_key(shape), {}) if shape else {}
        buckets = next((src[k] for k in _order(streamk, stored) for src in (own, self.lists) if src.get(k)),
                       [Bucket(m_max, name) for m_max, name in DEFAULT_STORED])
        return first_bucket(buckets, m)

    def names(self, kinds=KINDS) -> set[str]:
        """Every kernel any of these lists names, the card's and its shapes'."""
        return {b.backend for lists in (self.lists, *self.shapes.values()) for k in kinds for b in lists.get(k, ())}


def first_bucket(buckets, m: int) -> str:
    return next((b.backend for b in buckets if b.m_max is None or m <= b.m_max), buckets[-1].backend)


def shape_key(shape: tuple[int, int]) -> str:
    return f"{shape[0]}x{shape[1]}"


def _buckets(card: str, where: str, kind: str, rows) -> tuple[Bucket, ...]:
    buckets = tuple(Bucket(m, name) for m, name in rows)
    allowed = STORED if "stored" in kind else BACKENDS
    bad = [b.backend for b in buckets if b.backend not in allowed]
    if bad:
        raise ValueError(f"{TABLE_PATH.name}: card {card!r}{where} list {kind}: kernels {bad} not in {allowed}")
    if "streamk" not in kind and any(b.backend in NOT_REPEATABLE for b in buckets):
        raise ValueError(f"{TABLE_PATH.name}: card {card!r}{where} list {kind} is the repeatable one but names "
                         f"{NOT_REPEATABLE}: move it to {kind}_streamk")
    return buckets


def _lists(card: str, where: str, t: dict) -> dict[str, tuple[Bucket, ...]]:
    lists = {k: _buckets(card, where, k, t[k]) for k in KINDS if k in t}
    if not lists.get("nvfp4"):
        raise ValueError(f"{TABLE_PATH.name}: card {card!r}{where} has no buckets")
    return lists


def parse(obj: dict) -> dict[str, Table]:
    return {card: Table(card, _lists(card, "", t), t.get("source", ""),
                        {key: _lists(card, f" shape {key}", st) for key, st in t.get("shapes", {}).items()})
            for card, t in obj.items()}


@lru_cache(maxsize=None)
def _tables() -> dict[str, Table]:
    return parse(json.loads(TABLE_PATH.read_text())) if TABLE_PATH.exists() else {}


def nearest(card: str, cards) -> str | None:
    """The measured card most like `card`: the longest shared name prefix ("NVIDIA H200" takes "NVIDIA H100 80GB
    HBM3"'s table), the first measured on a tie."""
    def shared(other: str) -> int:
        return next((i for i, (a, b) in enumerate(zip(card, other)) if a != b), min(len(card), len(other)))
    return max(cards, key=shared, default=None)


@lru_cache(maxsize=None)
def table_for(card: str) -> Table | None:
    tables = _tables()
    if card in tables:
        return tables[card]
    near = nearest(card, list(tables))
    if near is None:
        return None
    warnings.warn(f"qerl: no measured kernel routes for {card!r}; using {near!r}'s "
                  "(run `qerl bench kernels --write-routes` on this card)", stacklevel=2)
    return tables[near]


def pick(m: int, device: torch.device, shape: tuple[int, int] | None = None, stored: bool = False) -> str:
    """The kernel for M tokens of an [N, K] weight on `device`: that shape's own buckets where it was measured,
    else the card's, from the list of the mode in force (KernelSettings.humming_deterministic: the repeatable
    list, else the stream-K one) and of the weight's layout; DEFAULT where no card has a table, and where humming
    is off (KernelSettings.humming) for a weight in qerl's layout."""
    from . import settings

    cur = settings.current()
    t = table_for(torch.cuda.get_device_name(device))
    if t is None or not (cur.humming or stored):
        return first_bucket([Bucket(m_max, name) for m_max, name in (DEFAULT_STORED if stored else DEFAULT)], m)
    return splittable(t.pick(m, streamk=not cur.humming_deterministic, shape=shape, stored=stored), shape)


def splittable(name: str, shape: tuple[int, int] | None) -> str:
    """A split-K name where K splits into its slices of 128, else humming without split (repeatable too): a
    table's card-wide lists also reach shapes too short to split (K 256 into 4 slices)."""
    if name in KSPLIT and shape is not None and shape[1] % (KSPLIT[name] * 128):
        return "humming_ns"
    return name


def copied_shapes(shapes: list[tuple[int, int]], device: torch.device) -> list[tuple[int, int]]:
    """The weight shapes (with repeats) the list in force sends to a humming copy at some M on `device`."""
    from . import settings

    cur = settings.current()
    t = table_for(torch.cuda.get_device_name(device))
    if t is None or not cur.humming:
        return []
    kinds = _order(not cur.humming_deterministic, False)

    def sent(shape) -> bool:
        own = t.shapes.get(shape_key(shape), {})
        buckets = next((src[k] for k in kinds for src in (own, t.lists) if src.get(k)), ())
        return any(b.backend in STORED for b in buckets)
    return [s for s in shapes if sent(s)]


TIE = 0.02  # a backend within 2 % of the fastest at an M keeps the bucket it already holds: one run's noise


def from_timings(timings: dict[int, dict[str, float]]) -> list[list]:
    """Buckets [[m_max, backend], ...] from {M: {backend: µs}}: the fastest backend at each measured M (the
    previous bucket's backend where it is within TIE of it: fewer kernels to compile and capture for no measurable
    loss), neighbours with the same winner merged, the last bucket open-ended."""
    out: list[list] = []
    for m in sorted(timings):
        timed = [(us, name) for name, us in timings[m].items() if us == us and name in BACKENDS]
        if not timed:  # nothing ran at this M (humming absent, or refused the shape): the neighbours decide
            continue
        us_best, best = min(timed)
        held = timings[m].get(out[-1][1], float("nan")) if out else float("nan")
        if held <= us_best * (1 + TIE):
            best = out[-1][1]
        if out and out[-1][1] == best:
            out[-1][0] = m
        else:
            out.append([m, best])
    if out:
        out[-1][0] = None
    return out
