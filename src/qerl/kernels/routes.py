"""Which path serves a dense 4-bit matmul of M tokens on this card: a table measured side by side.

`qerl bench kernels --write-routes` times every candidate on the card (qerl's own routed path, humming-kernels,
...) and writes, per card, the fastest path for each measured M (`routes.json` beside this file); a call of M
tokens takes the first bucket whose bound is >= M. The one owner of that choice: mma_backend asks `pick`.
A card with no table of its own uses the first table in the file, and says so once.
"""

from __future__ import annotations

import json
import warnings
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

import torch

TABLE_PATH = Path(__file__).with_name("routes.json")
# own: qerl's mma.sync / wgmma / dequantize + cuBLAS, by mma_backend's thresholds; humming: humming-kernels in the
# mode KernelSettings.humming_deterministic names (batch-invariant tiles, or its stream-K default); humming_nosplit:
# its default tiles with stream-K off (bit-repeatable per M; humming_backend.nosplit_tuning)
# humming_ksplitS: K cut into S slices run as one grouped GEMM and summed in a fixed order (kernels/humming_ksplit.py:
# bit-repeatable; a copy of an MMA-layout weight, or the stored humming layout's own rows viewed as slices)
KSPLIT = {"humming_ksplit2": 2, "humming_ksplit4": 4}
BACKENDS = ("own", "humming", "humming_nosplit", *KSPLIT)
HUMMING = ("humming", "humming_nosplit")  # the dense humming layout's modes
STORED = (*HUMMING, *KSPLIT)  # what a weight stored in humming's layout can run


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
    if stored:
        return ("nvfp4_stored_streamk", "nvfp4_streamk", "nvfp4_stored", "nvfp4") if streamk else ("nvfp4_stored", "nvfp4")
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
        buckets = next(src[k] for k in _order(streamk, stored) for src in (own, self.lists) if src.get(k))
        name = next((b.backend for b in buckets if b.m_max is None or m <= b.m_max), buckets[-1].backend)
        # a stored weight has no copy in qerl's layout: a list that names own falls to humming in the mode in force
        # (split-K reads the stored bytes themselves: humming_ksplit.stored_product)
        return "humming" if stored and name not in STORED else name


def shape_key(shape: tuple[int, int]) -> str:
    return f"{shape[0]}x{shape[1]}"


def _buckets(card: str, where: str, rows) -> tuple[Bucket, ...]:
    buckets = tuple(Bucket(m, name) for m, name in rows)
    bad = [b.backend for b in buckets if b.backend not in BACKENDS]
    if bad:
        raise ValueError(f"{TABLE_PATH.name}: card {card!r}{where}: backends {bad} not in {BACKENDS}")
    return buckets


def _lists(card: str, where: str, t: dict) -> dict[str, tuple[Bucket, ...]]:
    lists = {k: _buckets(card, where, t[k]) for k in KINDS if k in t}
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


@lru_cache(maxsize=None)
def table_for(card: str) -> Table | None:
    tables = _tables()
    if card in tables:
        return tables[card]
    if not tables:
        return None
    first = next(iter(tables.values()))
    warnings.warn(f"qerl: no measured kernel routes for {card!r}; using {first.card!r}'s "
                  "(run `qerl bench kernels --write-routes` on this card)", stacklevel=2)
    return first


def pick(m: int, device: torch.device, shape: tuple[int, int] | None = None, stored: bool = False) -> str:
    """The backend for M tokens of an [N, K] weight on `device` ("own" where nothing was measured; "humming" for
    a stored weight): that shape's own buckets where it was measured, else the card's, from the list of humming's
    mode in force (KernelSettings.humming_deterministic) and of the weight's layout."""
    from . import settings

    t = table_for(torch.cuda.get_device_name(device))
    if t is None:
        return "humming" if stored else "own"
    return t.pick(m, streamk=not settings.current().humming_deterministic, shape=shape, stored=stored)


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
