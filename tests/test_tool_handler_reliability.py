"""Issue 50, item 10: an environment's `respond()` message with a field JSON cannot hold (an object, a set,
bytes, a cycle) escaped `ToolTurnHandler.respond` as a traceback (json.dumps of the tool-call text, or the
chat template's `tojson`). Now it is what any malformed answer is (docs/reliability.md): one line of error
text for the model naming the environment, the message and the field; the sample ends, the run goes on."""

from __future__ import annotations

import pytest
from test_environment_limits import CALL, LIMITS, RespondOnly, tok  # noqa: F401 - tok: a fixture

from qerl.tools import ToolTurnHandler


def _cycle():
    d = {}
    d["self"] = d
    return d


@pytest.mark.parametrize("field, value, kind", [
    ("name", object(), "object"),  # the field tool_response_text writes into the call's JSON
    ("tool_call_id", b"call-1", "bytes"),
    ("extra", {1, 2}, "set"),
    ("meta", _cycle(), "dict"),
], ids=["name-object", "id-bytes", "extra-set", "cycle"])
def test_a_field_json_cannot_hold_is_one_line_for_the_model_naming_it(tok, field, value, kind):  # noqa: F811
    msgs = [{"role": "tool", "content": "fine"}, {"role": "tool", "content": "ok", field: value}]
    h = ToolTurnHandler(tok, [{"q": 1}], env_factory=lambda: RespondOnly(respond=lambda: msgs), limits=LIMITS,
                        max_turns=3)
    ids = tok(CALL, add_special_tokens=False)["input_ids"]
    out = h.respond(0, 0, ids, CALL)  # raised TypeError before
    text = tok.decode(out)
    line = next(ln for ln in text.splitlines() if "Error" in ln)
    assert "the environment RespondOnly" in line and "message (number 1)" in line
    assert f"field {field!r}" in line and f"type {kind}" in line and "not JSON-serializable" in line
    assert h.env_errors == 1
    assert h.respond(0, 0, ids, CALL) is None  # a broken environment answers nothing more


def test_fields_json_can_hold_pass_as_before(tok):  # noqa: F811
    msgs = [{"role": "tool", "content": "seen", "name": "look", "tool_call_id": "c1", "meta": {"a": [1, None]}}]
    h = ToolTurnHandler(tok, [{"q": 1}], env_factory=lambda: RespondOnly(respond=lambda: msgs), limits=LIMITS,
                        max_turns=3)
    ids = tok(CALL, add_special_tokens=False)["input_ids"]
    text = tok.decode(h.respond(0, 0, ids, CALL))
    assert "seen" in text and "Error" not in text and h.env_errors == 0
