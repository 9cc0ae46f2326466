"""Finding the final answer in a completion and reading numbers the way graders mean them.

Written by hand because math-verify targets LaTeX and sympy expressions, while GSM8K-style
grading needs plain-number rules (thousands commas, units, `#### N`, trailing periods) and has
to survive hostile text: 100 kB completions, unbalanced tags and braces, numbers too long to
convert. Every function here is linear in the text and never evaluates it.
"""

from __future__ import annotations

import re
from fractions import Fraction

TAIL = 4000  # answers sit at the end; longer completions are only read from their last TAIL characters
MAX_DIGITS = 60  # longer digit strings are not answers to grade (and int() of 4300+ digits raises)
MAX_EXPONENT = 300  # |e| of 1e300 or more is no answer to grade; Fraction('1e99999999') builds a 10^8-digit int

_NUMBER = re.compile(
    r"(?<![\w.])[-−]?\$?\s?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:\s*/\s*\d+(?:\.\d+)?)?(?:[eE][-+]?\d+)?%?"
    r"|(?<![\w.])[-−]?\.\d+")
_LATEX_FRAC = re.compile(r"^\\[dt]?frac\{([^{}]+)\}\{([^{}]+)\}$")
_ANSWER_IS = re.compile(r"(?:final answer|answer)\s*(?:is\s*:?|:)\s*", re.I)


def last_tag(text: str, tag: str = "answer") -> str | None:
    """Content of the last complete <tag>...</tag>; None when there is none (an unclosed tag counts as none)."""
    close = text.rfind(f"</{tag}>")
    if close < 0:
        return None
    start = text.rfind(f"<{tag}>", 0, close)
    if start < 0:
        return None
    return text[start + len(tag) + 2: close]


def last_boxed(text: str) -> str | None:
    """Content of the last \\boxed{...} (or \\fbox{...}), nested braces matched; None if unbalanced."""
    text = text[-TAIL:]
    best = None
    for key in ("\\boxed", "\\fbox"):
        i = text.rfind(key)
        if i >= 0 and (best is None or i > best[0]):
            best = (i, key)
    if best is None:
        return None
    j = best[0] + len(best[1])
    while j < len(text) and text[j] == " ":
        j += 1
    if j >= len(text) or text[j] != "{":
        return None
    depth = 0
    for k in range(j, len(text)):
        if text[k] == "{":
            depth += 1
        elif text[k] == "}":
            depth -= 1
            if depth == 0:
                return text[j + 1: k]
    return None


def gsm8k_reference(answer: str) -> str:
    """The final answer of a GSM8K solution ("... #### 42"), or the text itself when there is no ####."""
    return answer.rsplit("####", 1)[1].strip() if "####" in answer else answer.strip()


def final_answer(text: str) -> str:
    """Where a grader looks: the last <answer> tag, else the last \\boxed{}, else after '####' or
    'the answer is', else the last line."""
    tagged = last_tag(text[-(TAIL * 4):])
    if tagged is not None:
        return last_boxed(tagged) or tagged.strip()
    tail = text[-TAIL:]
    boxed = last_boxed(tail)
    if boxed is not None:
        return boxed
    if "####" in tail:
        return tail.rsplit("####", 1)[1].strip()
    m = list(_ANSWER_IS.finditer(tail))
    if m:
        return tail[m[-1].end():].strip()
    lines = [s for s in tail.strip().splitlines() if s.strip()]
    return lines[-1].strip() if lines else ""


def parse_number(s: str) -> Fraction | None:
    """A number as written in an answer: '1,234', '$5.50', '-3', '12 apples', '3/4', '\\frac{3}{4}',
    '50%' (kept as 50, as GSM8K writes percentages), '7.' -> exact Fraction; None when there is none.
    The last number in `s` counts (answers end with it: 'so she has 12 apples')."""
    s = s.strip()[-TAIL:]
    m = _LATEX_FRAC.match(s.replace(" ", ""))
    if m:
        a, b = parse_number(m.group(1)), parse_number(m.group(2))
        return a / b if a is not None and b else None
    s = s.replace("\\!", "").replace("{,}", ",")
    found = list(_NUMBER.finditer(s))
    if not found:
        return None
    if _inside_expression(s[:found[-1].start()], s[found[-1].end():]):
        return None  # \sqrt{2}, 2^{10}, 3! are expressions, not the number they contain
    tok = found[-1].group().replace("−", "-").replace("$", "").replace(" ", "").replace(",", "").rstrip("%")
    try:
        if "/" in tok:
            a, b = (_bounded(x) for x in tok.split("/"))
            return a / b if a is not None and b else None
        return _bounded(tok)
    except (ValueError, ZeroDivisionError, OverflowError):
        return None


# a number right after an operator command or ^/_, or right before ^ or !, is part of an expression
_EXPR_BEFORE = re.compile(r"(?:[\^_]|\\(?!text|mathrm|mathbf|textbf|boxed|fbox)[a-zA-Z]+)\s*\{?\s*$")
_EXPR_AFTER = re.compile(r"^\s*(?:\}\s*)?(?:\^|\\(?:pi|sqrt|cdot|times|log|ln|sin|cos|tan|exp|root)(?![a-zA-Z]))")


def _inside_expression(before: str, after: str) -> bool:
    return bool(_EXPR_BEFORE.search(before[-40:]) or _EXPR_AFTER.match(after[:40]))


def _bounded(tok: str) -> Fraction | None:
    """Fraction(tok) when its digits and exponent are within limits, checked on the text before
    anything expands (the value of '1e99999999' is never built); None otherwise."""
    mantissa, _, exp = tok.lower().partition("e")
    if len(mantissa) > MAX_DIGITS or len(exp) > 6 or (exp and abs(int(exp)) > MAX_EXPONENT):
        return None
    return Fraction(tok)


# formatting that leaves a number plain: \text{..}-style wrappers, thin spaces, escaped $ and %, {,}
_WRAPPERS = re.compile(r"\\(?:text|mathrm|mathbf|textbf|mbox|textnormal)\s*\{|\\[!,;:% $]|\{,\}")
_PLAIN_FRAC = re.compile(r"\\[dt]?frac\s*\{\s*-?[\d.,]+\s*\}\s*\{\s*-?[\d.,]+\s*\}")
_MATH = re.compile(r"[\\^_]|\d\s*!")  # a command, a power or index, a factorial: an expression


def is_plain_number(s: str) -> bool:
    """True when `s` (a final answer) holds a number as plain text ('12', '$1,234.50', 'so 12 apples',
    '\\text{12}', '\\frac{3}{4}'); False for an expression ('\\sqrt[3]{2}', '2^{1}', '\\log_2 4', '3!')
    that only a symbolic reader (math-verify) can value."""
    s = s[-TAIL:]
    return not _MATH.search(_PLAIN_FRAC.sub("0", _WRAPPERS.sub("", s))) and parse_number(s) is not None


def is_expression(s: str) -> bool:
    """True when `s` holds math beyond plain numbers (a command, ^ or _, a factorial): math-verify's case."""
    return _MATH.search(_PLAIN_FRAC.sub("0", _WRAPPERS.sub("", s[-TAIL:]))) is not None


def same_number(pred: str, ref: str) -> bool:
    a, b = parse_number(pred), parse_number(ref)
    return a is not None and b is not None and a == b
