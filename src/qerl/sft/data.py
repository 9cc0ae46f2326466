"""SFT rows -> token ids and the mask of the tokens trained on.

TRL's dataset formats: `messages` (a conversation), plain `text`, or `prompt` + `completion`
(strings, or message lists). A conversation is rendered by the tokenizer's chat template and cut
into segments where each assistant turn starts and ends, found by rendering the conversation up to
the turn (with the generation prompt) and through it; each segment is tokenized on its own, so the
ids are those a multi-turn rollout builds (the prompt's template text, the model's turn, the
template text around a tool's answer). The template must render a conversation's start the same
way whatever follows (prefix-preserving), which chat templates do. Tool messages go through the
template's tool role, or (templates without one, SmolLM2's) become one user turn of
<tool_response> blocks, as the rollout engine appends them (qerl.tools.chat).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path


@dataclass
class Example:
    ids: list[int]
    trained: list[bool]  # per token: in the loss (the first token never is: nothing predicts it)

    @property
    def first_trained(self) -> int:
        return self.trained.index(True)


@dataclass
class Tokenized:
    examples: list[Example]
    truncated: int = 0  # examples cut at max_length
    dropped: int = 0    # examples with no trained token left (e.g. cut before the assistant turn)


def load_rows(name: str, options: dict) -> list[dict]:
    """The training rows of `dataset_name`: the tool task's transcripts, a local file or a hub dataset."""
    options = dict(options)
    if name in ("tool_arithmetic", "tool-arithmetic"):
        from ..tasks.tool_arithmetic import task, transcripts

        return transcripts(task(**options).train)
    path = Path(name).expanduser()
    if path.suffix.lower() in (".jsonl", ".json", ".parquet") or os.path.lexists(path):
        if options:
            raise ValueError(f"dataset_config: a local file takes no options, got {sorted(options)}")
        from ..tasks.data import regular_file

        # a FIFO, a device or a folder named by os.stat, never opened (a FIFO's reader waits for a writer)
        return read_file(regular_file(path, "dataset_name"))
    from datasets import load_dataset

    split = options.pop("split", "train")
    config = options.pop("config", None)
    if options:
        raise ValueError(f"dataset_config: unknown option(s) {sorted(options)} for hub dataset {name} "
                         "(known: config, split)")
    return [dict(r) for r in load_dataset(name, config, split=split)]


def check_messages(messages) -> list[dict]:
    """A conversation's turns, each a known role with text (or tool calls): copies of them, or ValueError."""
    if not isinstance(messages, list) or not messages:
        raise ValueError("'messages' must be a non-empty list of {role, content} messages")
    for k, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ("system", "user", "assistant", "tool"):
            raise ValueError(f"message {k}: expected a role of system, user, assistant or tool, got "
                             f"{m.get('role') if isinstance(m, dict) else type(m).__name__!r}")
        if not isinstance(m.get("content"), str) and not m.get("tool_calls"):
            raise ValueError(f"message {k} ({m['role']}): its content is not text")
    return [dict(m) for m in messages]


def row_format(row, text_field: str = "text") -> str:
    """Which of TRL's formats a row is ("messages", "prompt_completion" or "text"), or ValueError saying what it
    lacks: the one structural check, made by the tokenizer and, before the model loads, by `check_rows`."""
    if not isinstance(row, dict):
        raise ValueError(f"expected a mapping, got {type(row).__name__}")
    if "messages" in row:
        check_messages(row["messages"])
        return "messages"
    if "prompt" in row and "completion" in row:
        return "prompt_completion"
    if text_field in row:
        if not isinstance(row[text_field], str):
            raise ValueError(f"'{text_field}' is {type(row[text_field]).__name__}, not text")
        return "text"
    raise ValueError(f"no 'messages', '{text_field}' or 'prompt' + 'completion' field (fields: {sorted(row)})")


def check_rows(name: str, options: dict, text_field: str) -> None:
    """A local dataset file's rows, checked before the model loads (minutes saved on a bad row): each row's
    format, named by file and row (0-based, as the tokenizer names it). The file is read again when training
    starts: small next to a model load."""
    path = Path(str(name)).expanduser()
    if not (path.suffix.lower() in (".jsonl", ".json", ".parquet") or os.path.lexists(path)):
        return  # the tool task or a hub dataset: checked as the trainer reads it
    rows = load_rows(name, options)
    if not rows:
        raise ValueError(f"{path}: no training rows")
    for i, row in enumerate(rows):
        check_text(row, f"{path}: row {i}")
        try:
            row_format(row, text_field)
        except ValueError as e:
            raise ValueError(f"{path}: row {i}: {e}") from None


def read_utf8(path, what: str = "file") -> str:
    """A text file's content; a file that is not UTF-8 is a ValueError naming it, the line and the byte
    (a bare codec error named neither)."""
    path = Path(path)
    data = path.read_bytes()
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        col = e.start - (data.rfind(b"\n", 0, e.start) + 1) + 1
        raise ValueError(f"{path}:{line}: not UTF-8 text (byte 0x{data[e.start]:02x} at column {col}); save the "
                         f"{what} as UTF-8") from None


def read_file(path: Path) -> list[dict]:
    suffix = path.suffix.lower()
    if suffix == ".parquet":
        import pyarrow.parquet as pq

        return pq.read_table(path).to_pylist()
    text = read_utf8(path, "data file")
    if suffix == ".json":
        try:
            rows = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}: not valid JSON ({e})") from None
        if not isinstance(rows, list):
            raise ValueError(f"{path}: expected a JSON list of rows, got {type(rows).__name__}")
        for i, row in enumerate(rows):
            check_text(row, f"{path} row {i}")
        return rows
    rows = []
    for i, line in enumerate(text.splitlines()):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{i + 1}: not a JSON row ({e.msg})") from None
        check_text(rows[-1], f"{path} line {i + 1}")  # numbered from 1, as editors and the GRPO loader number
    return rows


def lone_surrogate(value, field: str = "") -> tuple[str, str, int] | None:
    """(field, character, position from 1) of the first lone surrogate in a row's strings (JSON's "\ud800"
    escape decodes to one; no tokenizer takes it), the field spelt as its keys and indexes; None if none."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as e:
            return field, value[e.start], e.start + 1
        return None
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for k, v in items:
        found = lone_surrogate(v, f"{field}[{k!r}]" if field or not isinstance(k, str) else repr(k))
        if found:
            return found
    return None


def check_text(row, where: str) -> None:
    """A row whose text holds a lone surrogate: refused naming where it is and its field (as the GRPO
    loader does), not a tokenizers traceback."""
    found = lone_surrogate(row)
    if found:
        field, char, at = found
        raise ValueError(f"{where}: field {field} holds a lone surrogate {char!r} at character {at}, not text (a "
                         "broken \\uXXXX escape?)")


class Tokenizer:
    """Turns rows of any of TRL's formats into Examples with one tokenizer and one loss setting."""

    def __init__(self, tok, *, text_field: str = "text", max_length: int | None = None,
                 assistant_only_loss: bool = False, completion_only_loss: bool | None = None, source: str = "dataset"):
        self.tok, self.text_field, self.max_length = tok, text_field, max_length
        self.assistant_only, self.completion_only = assistant_only_loss, completion_only_loss is not False
        self.source = source

    def __call__(self, rows: list[dict]) -> Tokenized:
        out = Tokenized([])
        if not rows:
            raise ValueError(f"{self.source}: no training rows")
        for i, row in enumerate(rows):
            check_text(row, f"{self.source}: row {i}")  # rows of the API or a hub dataset: by their index
            try:
                ex = self.example(row)
            except ValueError as e:
                raise ValueError(f"{self.source}: row {i}: {e}") from None
            if self.max_length is not None and len(ex.ids) > self.max_length:
                ex = Example(ex.ids[:self.max_length], ex.trained[:self.max_length])
                out.truncated += 1
            if not any(ex.trained):
                out.dropped += 1
                continue
            out.examples.append(ex)
        if not out.examples:
            raise ValueError(f"{self.source}: no example has a token to train on after max_length={self.max_length} "
                             f"({out.dropped} dropped)")
        return out

    def example(self, row: dict) -> Example:
        kind = row_format(row, self.text_field)
        if kind == "messages":
            segs = self.conversation(row["messages"], trained=None)
        elif kind == "prompt_completion":
            segs = self.prompt_completion(row["prompt"], row["completion"])
        else:
            segs = self._with_eos([(row[self.text_field], True, True)])
        return self._encode(segs)

    # ---- the formats as (text, trained, first-of-a-plain-text) segments -------------------------
    def prompt_completion(self, prompt, completion) -> list[tuple[str, bool, bool]]:
        if isinstance(prompt, list) != isinstance(completion, list):
            raise ValueError("'prompt' and 'completion' must both be text or both be message lists")
        if isinstance(prompt, list):
            if not prompt:
                raise ValueError("'prompt' is an empty message list")
            return self.conversation(list(prompt) + list(completion),
                                     trained=len(prompt) if self.completion_only else None)
        for k, v in (("prompt", prompt), ("completion", completion)):
            if not isinstance(v, str):
                raise ValueError(f"'{k}' is {type(v).__name__}, not text or a message list")
        return self._with_eos([(prompt, not self.completion_only, True), (completion, True, False)])

    def _with_eos(self, segs):
        eos = self.tok.eos_token
        if eos and not segs[-1][0].endswith(eos):  # TRL appends EOS to plain text, so a model learns to stop
            segs = segs + [(eos, True, False)]
        return segs

    def conversation(self, messages, trained: int | None) -> list[tuple[str, bool, bool]]:
        """trained: None -> assistant turns (assistant_only_loss) or everything; k -> the messages from k
        on (a conversational completion), their assistant turns only under assistant_only_loss."""
        from ..tools.chat import as_template_messages

        msgs = self._check_messages(messages)
        # tool messages as the template renders them (a run of them is one user turn without a tool role)
        conv, first = [], None
        i = 0
        while i < len(msgs):
            if msgs[i]["role"] == "tool":
                j = i
                while j < len(msgs) and msgs[j]["role"] == "tool":
                    j += 1
                conv += as_template_messages(msgs[i:j], self.tok)
                i = j
            else:
                conv.append(msgs[i])
                i += 1
            if trained is not None and first is None and i >= trained:
                first = len(conv)
        if not getattr(self.tok, "chat_template", None):
            raise ValueError("a conversation needs a tokenizer with a chat template")
        full = self._render(conv, False)
        cuts = []  # (start, end) character spans of trained text
        for k, m in enumerate(conv):
            if m["role"] != "assistant":
                continue
            if trained is not None and k < first:
                continue
            a, b = self._render(conv[:k], True) if k else "", self._render(conv[:k + 1], False)
            if not (b.startswith(a) and full.startswith(b)):
                raise ValueError(f"message {k}: the chat template renders the conversation before this assistant "
                                 "turn differently once the turn is added (not prefix-preserving), so its tokens "
                                 "cannot be told apart")
            end = len(b.rstrip())  # the template's separator after the end-of-turn token is no model output
            cuts.append((len(a), max(len(a), end)))
        if trained is not None and not self.assistant_only:  # the whole completion, whatever its roles
            cuts = [(len(self._render(conv[:first], True)) if first else 0, len(full.rstrip()))] if first is not None \
                and first < len(conv) else []
        elif trained is None and not self.assistant_only:
            return [(full, True, False)]
        segs, pos = [], 0
        for s, e in cuts:
            if s > pos:
                segs.append((full[pos:s], False, False))
            if e > s:
                segs.append((full[s:e], True, False))
            pos = max(pos, e)
        if pos < len(full):
            segs.append((full[pos:], False, False))
        return segs

    def _check_messages(self, messages) -> list[dict]:
        return check_messages(messages)

    def _render(self, messages, generation_prompt: bool) -> str:
        return self.tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)

    def _encode(self, segs) -> Example:
        ids, trained = [], []
        for text, t, plain_start in segs:
            # plain text starts as the tokenizer starts text (a BOS where it adds one); template text
            # carries its own special tokens
            piece = self.tok(text, add_special_tokens=plain_start)["input_ids"]
            ids += piece
            trained += [t] * len(piece)
        if trained:
            trained[0] = False  # nothing predicts the first token
        return Example(ids, trained)
