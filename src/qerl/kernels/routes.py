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
BACKENDS = ("own", "humming", "humming_nosplit")
HUMMING = ("humming", "humming_nosplit")


@dataclass(frozen=True)
class Bucket:
    m_max: int | None  # None: every larger M
    backend: str


@dataclass(frozen=True)
class Table:
    card: str
    buckets: tuple[Bucket, ...]
    source: str  # command, commit and date of the measurement
    # the same card's buckets with humming in its stream-K default (KernelSettings.humming_deterministic off);
    # empty where that was not measured (then `buckets` serve both)
    streamk_buckets: tuple[Bucket, ...] = ()
    # per weight shape "NxK" measured on its own: (buckets, streamk_buckets). The down projection's long K wants a
    # split that a wide gate|up does not, so one winner per M for a whole layer set leaves time on the table.
    shapes: dict[str, tuple[tuple[Bucket, ...], tuple[Bucket, ...]]] = field(default_factory=dict)

    def pick(self, m: int, streamk: bool = False, shape: tuple[int, int] | None = None) -> str:
        own, own_sk = self.shapes.get(shape_key(shape), (self.buckets, self.streamk_buckets)) if shape else \
            (self.buckets, self.streamk_buckets)
        buckets = own_sk if streamk and own_sk else own
        for b in buckets:
            if b.m_max is None or m <= b.m_max:
                return b.backend
        return buckets[-1].backend


def shape_key(shape: tuple[int, int]) -> str:
    return f"{shape[0]}x{shape[1]}"


def _buckets(card: str, where: str, rows) -> tuple[Bucket, ...]:
    buckets = tuple(Bucket(m, name) for m, name in rows)
    bad = [b.backend for b in buckets if b.backend not in BACKENDS]
    if bad:
        raise ValueError(f"{TABLE_PATH.name}: card {card!r}{where}: backends {bad} not in {BACKENDS}")
    return buckets


def parse(obj: dict) -> dict[str, Table]:
    tables = {}
    for card, t in obj.items():
        buckets = _buckets(card, "", t["nvfp4"])
        if not buckets:
            raise ValueError(f"{TABLE_PATH.name}: card {card!r} has no buckets")
        shapes = {}
        for key, st in t.get("shapes", {}).items():
            sb = _buckets(card, f" shape {key}", st["nvfp4"])
            if not sb:
                raise ValueError(f"{TABLE_PATH.name}: card {card!r} shape {key} has no buckets")
            shapes[key] = (sb, _buckets(card, f" shape {key}", st.get("nvfp4_streamk", ())))
        tables[card] = Table(card, buckets, t.get("source", ""), _buckets(card, "", t.get("nvfp4_streamk", ())), shapes)
    return tables


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


def pick(m: int, device: torch.device, shape: tuple[int, int] | None = None) -> str:
    """The backend for M tokens of an [N, K] weight on `device` ("own" where nothing was measured): that shape's
    own buckets where it was measured, else the card's, from the table of humming's mode in force
    (KernelSettings.humming_deterministic)."""
    from . import settings

    t = table_for(torch.cuda.get_device_name(device))
    return "own" if t is None else t.pick(m, streamk=not settings.current().humming_deterministic, shape=shape)


def from_timings(timings: dict[int, dict[str, float]]) -> list[list]:
    """Buckets [[m_max, backend], ...] from {M: {backend: µs}}: the fastest backend at each measured M,
    neighbours with the same winner merged, the last bucket open-ended."""
    out: list[list] = []
    for m in sorted(timings):
        best = min((us, name) for name, us in timings[m].items() if us == us and name in BACKENDS)[1]
        if out and out[-1][1] == best:
            out[-1][0] = m
        else:
            out.append([m, best])
    if out:
        out[-1][0] = None
    return out
