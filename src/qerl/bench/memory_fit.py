"""The step memory model checked out of sample: its allowances read off ONE measured step, the others predicted.

    qerl bench memory --fit-on 'qwen3-30b-a3b nvfp4 8x8 prompt256 new256 mu1 mb2 ckpt kv3.4 adamw_torch@ed5e22d' \
        [--fit-capped-on SELECTOR] [--predict SELECTOR ...] [--measured 'CASE=GiB' ...] [--record]

Records are `qerl bench step` rows of MoE shapes in benchmarks/results/step.jsonl with a peak figure; a
selector is a substring of a case, optionally `@commit`, that names one (case, commit). The step's settings
are read back from its case name (bench/step.py case_name). A prediction compares peak_reserved where the
record has it, else peak_allocated. --measured adds a figure that is in no record (e.g. one an issue
reports): it is printed, labelled so, and never recorded. --fit-capped-on reads the slack of runs under a memory
cap (a `capNGiB` case) off one capped step: a capped record is predicted with it, the others with --fit-on's.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, replace
from pathlib import Path

from .step_plan import (BF16, GIB, MOE_SHAPES, Allowances, MoEShape, StepSettings, expert_shapes, fit_allowances,
                        plan_step, with_capped_slack)

TOLERANCE_PCT = 5.0
# Records whose code differs from today's in a way the model does not price (printed beside their error)
OTHER_CODE = {"e65a2ba": "before 7d91729 the update's recompute ran on autograd's thread without the forward's "
                         "kernel settings, so on the MoE loop path, which holds every hit expert dequantized (bf16) "
                         "while a layer is recomputed: 1.13 GiB a layer for Qwen3-30B-A3B, 5.93 for gpt-oss-120b; "
                         "and no MoE decode graphs yet (ed5e22d)"}

_CASE = re.compile(r"^(?P<shape>\S+?)(?: (?P<layers>\d+)L)? (?P<quant>\S+) (?P<p>\d+)x(?P<g>\d+) prompt(?P<pl>\d+) "
                   r"new(?P<new>\d+) mu(?P<mu>\d+) (?P<levers>.*)$")


# Commits whose MoE steps ran with the grouped path's kept expert inputs (StepSettings.expert_inputs_kept), fixed
# after them in layers/quant_experts.py; "given" figures (--measured) are the issue's, from bc100bc.
KEPT_INPUTS = frozenset({"e65a2ba", "ed5e22d", "bc100bc", "given"})


def settings_of_case(case: str, commit: str | None = None) -> tuple[MoEShape, StepSettings]:
    """The shape and settings a `qerl bench step` case name says (its defaults where it says nothing: LoRA r32,
    logprob chunk 1024; no KV budget: a slot for every row), and of the code at `commit` (KEPT_INPUTS).
    ValueError for what the model does not cover."""
    m = _CASE.match(case.replace("adamw_torch (no bitsandbytes)", "adamw_torch"))
    if not m or m["shape"] not in MOE_SHAPES:
        raise ValueError(f"not an MoE step case: {case!r}")
    if m["quant"] != "nvfp4" or m["mu"] != "1":
        raise ValueError(f"{case!r}: the model covers nvfp4, mu1")
    shape = MOE_SHAPES[m["shape"]]
    if m["layers"]:
        shape = replace(shape, layers=int(m["layers"]))
    p, g = int(m["p"]), int(m["g"])
    kw = dict(rows=p * g, prompts=p, prompt_len=int(m["pl"]), new_tokens=int(m["new"]), kv_cache_gb=None,
              kv_rows=p * g, expert_inputs_kept=commit in KEPT_INPUTS)
    for tok in m["levers"].split():
        if tok.startswith("mb"):
            kw["micro_batch"] = int(tok[2:])
        elif tok.startswith("chunk"):
            kw["logprob_chunk"] = int(tok[5:])
        elif re.fullmatch(r"kv[\d.]+", tok):
            kw["kv_cache_gb"] = float(tok[2:])
        elif tok in ("adamw_torch", "adamw_8bit"):
            kw["optim"] = tok
        elif tok == "kv-fp8":
            kw["kv_bytes"] = 1
        elif tok == "no-humming":
            kw["humming"] = False
        elif tok == "humming-storage":
            kw["humming_storage"] = True
        elif tok == "embed4bit":
            kw["embed_4bit"] = True
        elif m_chunk := re.fullmatch(r"echunk(\d+)mib", tok):  # KernelSettings.moe_expert_chunk_mib, bf16 weights
            kw["expert_chunk"] = max(1, (int(m_chunk[1]) << 20) // (max(o * i for o, i in expert_shapes(shape)) * BF16))
        elif m_cap := re.fullmatch(r"cap([\d.]+)GiB", tok):  # moves no term: picks the allocator's slack
            kw["memory_cap_gb"] = float(m_cap[1])
        elif tok in ("ckpt", "steady", "route-counting", "route-argsort", "route-fused"):
            pass  # checkpointing is what the model assumes; the steady mean moves no term
        else:
            raise ValueError(f"{case!r}: {tok!r} is a setting the model does not cover")
    return shape, StepSettings(**kw)


@dataclass
class Step:
    """One measured step: its case, commit, and peaks in GiB (None where not recorded)."""
    case: str
    commit: str
    peak_allocated: float | None
    peak_reserved: float | None
    source: str = "benchmarks/results/step.jsonl"

    @property
    def name(self) -> str:
        return f"{self.case}@{self.commit}"


def load_steps(path: Path) -> list[Step]:
    """The MoE step records with a peak figure, one per (case, commit), in file order (latest row wins)."""
    out: dict[tuple, Step] = {}
    for line in Path(path).read_text().splitlines():
        if not line.strip():
            continue
        r = json.loads(line)
        if r.get("bench") != "step" or r["metric"] not in ("peak_allocated", "peak_reserved"):
            continue
        try:
            settings_of_case(r["case"])
        except ValueError:
            continue
        key = (r["case"], r["commit"])
        st = out.setdefault(key, Step(r["case"], r["commit"], None, None))
        setattr(st, r["metric"], r["value"])
    return list(out.values())


def select(steps: list[Step], selector: str) -> Step:
    """The one step a selector names: a substring of its case, with `@commit` to tell commits apart."""
    text, _, commit = selector.partition("@")
    hits = [s for s in steps if text in s.case and (not commit or s.commit.startswith(commit))]
    exact = [s for s in hits if s.case == text]
    hits = exact or hits
    if len(hits) != 1:
        names = "\n  ".join(s.name for s in hits) or "(none)"
        raise SystemExit(f"selector {selector!r} names {len(hits)} records, not one:\n  {names}")
    return hits[0]


def fit(step: Step) -> Allowances:
    if step.peak_allocated is None or step.peak_reserved is None:
        raise SystemExit(f"{step.name}: a fit needs its peak_allocated and peak_reserved")
    shape, st = settings_of_case(step.case, step.commit)
    return fit_allowances(shape, st, step.peak_allocated, step.peak_reserved, step.name)


def fit_capped(step: Step, allow: Allowances) -> Allowances:
    """`allow` with the capped slack read off `step`, a run under a memory cap (its case names capNGiB)."""
    if step.peak_allocated is None or step.peak_reserved is None:
        raise SystemExit(f"{step.name}: a fit needs its peak_allocated and peak_reserved")
    if settings_of_case(step.case, step.commit)[1].memory_cap_gb is None:
        raise SystemExit(f"--fit-capped-on {step.name}: its case names no memory cap (capNGiB), so its slack is not "
                         "a capped run's")
    return with_capped_slack(allow, step.peak_allocated, step.peak_reserved, step.name)


@dataclass
class Prediction:
    step: Step
    metric: str
    predicted: float
    measured: float

    @property
    def error_pct(self) -> float:
        return 100 * (self.predicted / self.measured - 1)

    @property
    def within(self) -> bool:
        return abs(self.error_pct) <= TOLERANCE_PCT


def predict(step: Step, allow: Allowances) -> Prediction:
    """The step's peak from its settings and `allow` alone: its own measured figure is only compared."""
    shape, st = settings_of_case(step.case, step.commit)
    p = plan_step(shape, st, allow)
    if step.peak_reserved is not None:
        return Prediction(step, "peak_reserved", p.peak_reserved / GIB, step.peak_reserved)
    return Prediction(step, "peak_allocated", p.peak_allocated / GIB, step.peak_allocated)


def given(text: str) -> Step:
    """--measured 'CASE=GiB': a peak reserved figure that is in no record."""
    case, _, value = text.rpartition("=")
    settings_of_case(case)
    return Step(case, "given", None, float(value), source="given on the command line (in no record)")


def run(fit_on: str, predict_sel: list[str], measured: list[str], path: Path, log=print,
        fit_capped_on: str | None = None) -> tuple[Allowances, list]:
    steps = load_steps(path)
    base = select(steps, fit_on)
    allow = fit(base)
    capped = select(steps, fit_capped_on) if fit_capped_on else None
    if capped is not None:
        allow = fit_capped(capped, allow)
    fits = [base, capped]  # neither fit record is predicted: both are in sample
    targets = [select(steps, s) for s in predict_sel] if predict_sel else [s for s in steps if s not in fits]
    targets += [given(m) for m in measured]
    log(f"fit on {base.name}: peak allocated {base.peak_allocated:.2f}, reserved {base.peak_reserved:.2f} GiB -> "
        f"residual {allow.residual / GIB:.3f} GiB, allocator slack {allow.slack / GIB:.3f} GiB")
    if capped is not None:
        log(f"capped fit on {capped.name}: peak allocated {capped.peak_allocated:.2f}, reserved "
            f"{capped.peak_reserved:.2f} GiB -> capped allocator slack {allow.capped_slack / GIB:.3f} GiB "
            "(records with a cap)")
    preds = [predict(s, allow) for s in targets if s not in fits]
    log(f"{'predicted step':<78} {'metric':<15} {'pred':>7} {'meas':>7} {'err %':>7}  <=5%")
    for p in preds:
        src = "" if p.step.commit != "given" else "   (given: in no record)"
        log(f"{p.step.name:<78} {p.metric:<15} {p.predicted:7.2f} {p.measured:7.2f} {p.error_pct:+7.2f}  "
            f"{'yes' if p.within else 'NO'}{src}")
    return allow, preds


def record_rows(allow: Allowances, preds: list, command: str) -> None:
    """One row per recorded step predicted (given figures are not recorded): |error| against the 5 % target."""
    from .record import record

    fits = allow.fit_on + (f" capped {allow.capped_fit_on}" if allow.capped_fit_on else "")
    for p in preds:
        if p.step.commit == "given":
            continue
        record("memory", f"fit {fits} predict {p.step.name}", f"{p.metric}_error_pct", abs(p.error_pct), "%",
               target=f"<={TOLERANCE_PCT:g}", command=command, mode="out-of-sample check",
               note=f"predicted {p.predicted:.3f} GiB, measured {p.measured:.3f} GiB (signed {p.error_pct:+.2f} %)")
