"""Held-out evaluation on the rollout engine: pass@1 averaged over k samples, with its standard error.

pass@1 = mean over problems of (correct samples / k); its standard error is the spread of the
per-problem rates over the problems (std / sqrt(n)), which covers both problem and sampling noise.
A sample counts as correct when the task's accuracy function gives it the full score (1).
"""

from __future__ import annotations

import json
import math
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from tqdm.auto import tqdm

from ..rollout import SamplingParams
from ..tasks.prompts import encode_prompt
from ..tasks.rows import check_rows
from .rewards import score


@dataclass
class EvalReport:
    dataset: str
    problems: int
    samples: int
    pass_at_1: float
    stderr: float
    mean_score: float
    format_rate: float | None
    completion_length_mean: float
    truncated_fraction: float
    reward_errors: int
    seconds: float
    tokens_per_s: float
    tool_call_rate: float | None = None  # tool-use evaluations: completions with at least one tool turn
    params: dict = field(default_factory=dict)
    per_problem: list[dict] = field(default_factory=list)

    def summary(self) -> str:
        return (f"{self.dataset}: pass@1 {100 * self.pass_at_1:.1f} ± {100 * self.stderr:.1f} % "
                f"({self.problems} problems × {self.samples} samples, {self.seconds:.0f} s)")

    def write(self, path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        if path.is_dir():
            raise IsADirectoryError(f"{path}: is a folder; the report is a file (e.g. {path / 'report.json'})")
        tmp = path.with_name(path.name + ".tmp")
        try:
            tmp.write_text(json.dumps(asdict(self), indent=1))
            tmp.replace(path)
        finally:
            tmp.unlink(missing_ok=True)
        return path


def evaluate(engine, tok, rows: list[dict], accuracy_func, *, samples: int = 1, temperature: float = 0.6,
             top_p: float = 0.95, max_new_tokens: int = 256, greedy: bool = False, seed: int = 0,
             system_prompt: str | None = None, prompt_suffix: bool = False, max_prompt_length: int | None = None,
             format_func=None, dataset: str = "", chunk: int | None = None, keep_text: bool = True,
             progress: bool = True, turns_for=None) -> EvalReport:
    """turns_for: rows -> a multi-turn handler (rollout/turns.py) for a tool-use evaluation; the report
    then counts the completions that called a tool (tool_call_rate)."""
    if not rows:
        raise ValueError(f"{dataset or 'evaluation set'}: no problems to evaluate")
    if samples < 1:
        raise ValueError(f"samples must be >= 1, got {samples}")
    rows = check_rows(rows, dataset or "evaluation set")
    greedy = greedy or temperature == 0  # temperature 0 is the greedy limit (eval_temperature: 0)
    params = SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature if temperature > 0 else 1.0,
                            top_p=top_p, greedy=greedy, seed=seed)
    # one generate call for everything by default: continuous batching refills the slots, where
    # chunks would each wait for their longest completion
    chunk = chunk or len(rows)
    funcs = [accuracy_func] + ([format_func] if format_func is not None else [])
    per, t0, new_tokens, truncated, lengths, errors, called = [], time.perf_counter(), 0, 0, [], 0, 0
    if progress:  # its own phase, named before the rollout bar starts
        tqdm.write(f"eval {dataset or 'evaluation set'}: {len(rows)} problems x {samples} samples", file=sys.stderr)
    bar = tqdm(total=len(rows), desc=f"eval {dataset}".strip(), unit="problem", disable=not progress or chunk >= len(rows))
    for s in range(0, len(rows), chunk):
        part = rows[s: s + chunk]
        ids = [encode_prompt(tok, r["prompt"], system_prompt=system_prompt, suffix=prompt_suffix,
                             max_length=max_prompt_length) for r in part]
        params.seed = seed + s  # each chunk its own stream, the whole run reproducible
        outs = engine.generate(ids, n=samples, params=params, progress=progress and chunk >= len(rows),
                               turns=turns_for(part) if turns_for is not None else None)
        called += sum(bool(getattr(c, "tool_spans", ())) for c in outs)
        texts = [tok.decode(c.token_ids, skip_special_tokens=True) for c in outs]
        cols = {k: [part[c.prompt_index][k] for c in outs] for k in part[0] if k != "prompt"}
        cols["prompts"] = [part[c.prompt_index]["prompt"] for c in outs]
        sc = score(funcs, None, texts, cols, completion_ids=[list(c.token_ids) for c in outs])
        errors += sc.errors
        acc = sc.per_func[next(iter(sc.per_func))]
        fmt = sc.per_func.get("format")
        for i, r in enumerate(part):
            mine = [j for j, c in enumerate(outs) if c.prompt_index == i]
            rec = {"index": s + i, "answer": r.get("answer"), "scores": [acc[j] for j in mine],
                   "correct": sum(acc[j] >= 0.999 for j in mine) / len(mine)}
            if fmt is not None:
                rec["format"] = [fmt[j] for j in mine]
            if keep_text:
                rec["question"] = r.get("question")
                rec["completions"] = [texts[j] for j in mine]
            per.append(rec)
        new_tokens += sum(len(c.token_ids) for c in outs)
        truncated += sum(c.finish_reason == "length" for c in outs)
        lengths += [len(c.token_ids) for c in outs]
        bar.update(len(part))
    bar.close()
    dt = time.perf_counter() - t0
    rates = [p["correct"] for p in per]
    n = len(rates)
    mean = sum(rates) / n
    sd = math.sqrt(sum((x - mean) ** 2 for x in rates) / (n - 1)) if n > 1 else 0.0
    fr = [v for p in per for v in p.get("format", [])]
    return EvalReport(
        dataset=dataset, problems=n, samples=samples, pass_at_1=mean, stderr=sd / math.sqrt(n),
        mean_score=sum(v for p in per for v in p["scores"]) / (n * samples),
        format_rate=sum(fr) / len(fr) if fr else None, completion_length_mean=sum(lengths) / len(lengths),
        truncated_fraction=truncated / len(lengths), reward_errors=errors, seconds=dt,
        tokens_per_s=new_tokens / dt if dt else 0.0,
        tool_call_rate=called / len(lengths) if turns_for is not None else None,
        params={"temperature": temperature, "top_p": top_p, "max_new_tokens": max_new_tokens, "greedy": greedy,
                "seed": seed, "prompt_suffix": prompt_suffix, "system_prompt": system_prompt},
        per_problem=per)
