"""Tool results back into the conversation, as messages and as the token ids the engine appends.

A tool result is a `{"role": "tool", "content": ...}` message. The ids to append after the model's
tool-call tokens are what the tokenizer's chat template renders for that message: the rendering
of a short conversation ending in an assistant tool call, with and without the tool message, and
the difference taken after the call's text (so the assistant's end-of-turn, the tool turn and the
next assistant header all come from the template). Templates with no tool role (SmolLM2's) get
the Hermes / Qwen2.5 form instead: a user turn holding `<tool_response>...</tool_response>` blocks.
"""

from __future__ import annotations

import json
import re

from .calls import HERMES, ToolCallFormat

_TOOL_ROLE = re.compile(r"""(['"])tool\1""")  # a template that handles role "tool" names it as a string


def tool_message(content: str, name: str | None = None) -> dict:
    msg = {"role": "tool", "content": content}
    if name:
        msg["name"] = name  # some templates (GPT-OSS, Llama 3.1) read it
    return msg


def template_has_tool_role(tokenizer) -> bool:
    t = getattr(tokenizer, "chat_template", None) or ""
    t = "\n".join(t.values()) if isinstance(t, dict) else t
    return bool(_TOOL_ROLE.search(t))


def as_template_messages(tool_messages: list[dict], tokenizer) -> list[dict]:
    """The tool messages as the template can render them: unchanged, or one Hermes-style user turn."""
    if template_has_tool_role(tokenizer):
        return list(tool_messages)
    body = "\n".join(f"<tool_response>\n{m['content']}\n</tool_response>" for m in tool_messages)
    return [{"role": "user", "content": body}]


def scrub_special_tokens(text: str, tokenizer) -> str:
    """`text` with the tokenizer's special-token strings removed: a tool echoing model text (an error
    quoting the call) must not forge turn markers such as <|im_end|> into the conversation."""
    specials = set(getattr(tokenizer, "all_special_tokens", []) or [])
    try:
        specials |= set(tokenizer.get_added_vocab())
    except (AttributeError, NotImplementedError):
        pass
    for tok in sorted((t for t in specials if t), key=len, reverse=True):
        while tok in text:  # removal can join pieces into a new marker ("<|im_<|im_end|>end|>"): repeat
            text = text.replace(tok, "")
    return text


def _render(tokenizer, messages, add_generation_prompt: bool) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)


def tool_response_text(tokenizer, tool_messages: list[dict], fmt: ToolCallFormat = HERMES) -> str:
    """The text that follows the model's closing tool-call marker: end of the assistant turn, the
    tool results (special-token strings scrubbed from them), and the header of the next assistant turn."""
    if not tool_messages:
        raise ValueError("tool_response_text: no tool messages")
    name = tool_messages[0].get("name") or "tool"
    call = f'{fmt.open}\n{json.dumps({"name": name, "arguments": {}})}\n{fmt.close}'
    convo = [{"role": "user", "content": "question"}, {"role": "assistant", "content": call}]
    before = _render(tokenizer, convo, False)
    end = before.rfind(call)
    if end < 0:
        raise ValueError("the chat template does not render an assistant message's content as written, so tool "
                         "results cannot be appended after it")
    end += len(call)
    safe = [{**m, "content": scrub_special_tokens(str(m["content"]), tokenizer)} for m in tool_messages]
    after = _render(tokenizer, convo + as_template_messages(safe, tokenizer), True)
    if after[:end] != before[:end]:
        raise ValueError("the chat template renders the conversation before the tool message differently once "
                         "the tool message is added (not prefix-preserving); tool results cannot be appended")
    return after[end:]


def tool_response_ids(tokenizer, tool_messages: list[dict], *, ended_turn: bool = False,
                      fmt: ToolCallFormat = HERMES) -> list[int]:
    """Token ids to append after the model's tokens for its tool call.

    `ended_turn=False`: the engine stopped on the closing marker (`tool_call_stop_strings`), so the
    ids start with the template's end-of-turn token. `ended_turn=True`: the model already emitted
    its end-of-turn (EOS) token after the call, which is then left out here."""
    ids = list(tokenizer(tool_response_text(tokenizer, tool_messages, fmt), add_special_tokens=False)["input_ids"])
    if ended_turn:
        eos = tokenizer.eos_token_id
        if not ids or ids[0] != eos:
            raise ValueError(f"ended_turn=True, but the template does not end the assistant turn with the EOS token "
                             f"({tokenizer.eos_token!r}) right after the tool call")
        ids = ids[1:]
    return ids


def tools_system_prompt(schemas: list[dict], fmt: ToolCallFormat = HERMES) -> str:
    """The tool offer Qwen2.5's template writes into the system turn, for templates without `tools=`."""
    lines = "\n".join(json.dumps(s) for s in schemas)
    return ("# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
            "You are provided with function signatures within <tools></tools> XML tags:\n"
            f"<tools>\n{lines}\n</tools>\n\n"
            f"For each function call, return a json object with function name and arguments within "
            f"{fmt.open}{fmt.close} XML tags:\n{fmt.open}\n"
            '{"name": <function-name>, "arguments": <args-json-object>}\n' f"{fmt.close}")


def with_tools_prompt(messages: list[dict], schemas: list[dict], fmt: ToolCallFormat = HERMES) -> list[dict]:
    """`messages` with the tool offer in the system turn (appended to an existing system message)."""
    offer = tools_system_prompt(schemas, fmt)
    msgs = [dict(m) for m in messages]
    if msgs and msgs[0]["role"] == "system":
        msgs[0]["content"] = msgs[0]["content"] + "\n\n" + offer
        return msgs
    return [{"role": "system", "content": offer}] + msgs


def offer_tools(rows: list[dict], tools) -> list[dict]:
    """Rows whose chat prompts (message lists) offer `tools` in the system turn; rows that already
    offer tools, and plain-text prompts (no turns to put an offer in), are kept as they are."""
    from .tool import as_tools

    schemas = [t.schema for t in as_tools(tools).values()]
    out = []
    for r in rows:
        p = r.get("prompt")
        if isinstance(p, list) and not any(m.get("role") == "system" and "<tools>" in (m.get("content") or "")
                                           for m in p):
            r = {**r, "prompt": with_tools_prompt(p, schemas)}
        out.append(r)
    return out
