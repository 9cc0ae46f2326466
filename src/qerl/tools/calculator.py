"""The built-in calculator: arithmetic on model text without `eval`.

The expression is parsed with `ast` and walked over a whitelist (number literals, + - * / // % **,
unary + and -, parentheses); anything else (names, calls, attributes, strings) is refused by node
type. Work is bounded before it happens: the text's length, the tree's depth, every intermediate
value's magnitude, and a power's result size estimated from its operands before it is computed
(so 9**9**9 is refused, not attempted).

`one_operation_calculator` is the same arithmetic limited to one binary operation per call (a sign on
a number is no operation): the chained tool task offers it, so longer expressions take a chain of calls.
"""

from __future__ import annotations

import ast
import math
import operator

MAX_CHARS = 500
MAX_DEPTH = 100
MAX_ABS = 10 ** 100  # intermediate values above this are refused (ints stay exact below it)

_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
_UNARY = {ast.USub: operator.neg, ast.UAdd: operator.pos}
_ALLOWED = "numbers, + - * / // % ** and parentheses"


class CalculatorError(ValueError):
    pass


def _check(x):
    if isinstance(x, complex) or not isinstance(x, (int, float)):
        raise CalculatorError(f"the result is not a real number ({type(x).__name__})")
    if isinstance(x, float) and not math.isfinite(x):
        raise CalculatorError("the result is not finite")
    if abs(x) > MAX_ABS:
        raise CalculatorError("a value exceeds 1e100")
    return x


def _power(a, b):
    # |a**b| = 10**(b*log10|a|): refuse on the estimate, before Python builds a huge int
    if abs(a) > 1 and b > 0 and b * math.log10(abs(a)) > 100:
        raise CalculatorError(f"{a} ** {b} exceeds 1e100")
    if a == 0 and b < 0:
        raise CalculatorError("zero to a negative power")
    return a ** b


def _apply(op, a, b):
    try:
        v = _power(a, b) if isinstance(op, ast.Pow) else _BINARY[type(op)](a, b)
    except ZeroDivisionError:
        raise CalculatorError("division by zero") from None
    except OverflowError:
        raise CalculatorError("a value exceeds the floating-point range") from None
    return _check(v)


def _eval(node, depth: int = 0):
    if depth > MAX_DEPTH:
        raise CalculatorError(f"the expression is nested more than {MAX_DEPTH} levels deep")
    if isinstance(node, ast.Expression):
        return _eval(node.body, depth + 1)
    if isinstance(node, ast.Constant):
        if type(node.value) not in (int, float):  # bool is an int subclass: refuse True/False too
            raise CalculatorError(f"{node.value!r} is not a number")
        return _check(node.value)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _check(_UNARY[type(node.op)](_eval(node.operand, depth + 1)))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        # a flat chain `1 + 2 + ... + 150` parses left-deep: walk it as one level, not 150 (only
        # parentheses and right operands nest); ** is right-associative and stays recursive
        chain = []
        while isinstance(node, ast.BinOp) and type(node.op) in _BINARY and not isinstance(node.op, ast.Pow):
            chain.append(node)
            node = node.left
        if not chain:
            return _apply(node.op, _eval(node.left, depth + 1), _eval(node.right, depth + 1))
        acc = _eval(node, depth + 1)
        for link in reversed(chain):
            acc = _apply(link.op, acc, _eval(link.right, depth + 1))
        return acc
    what = type(node.op).__name__ if isinstance(node, (ast.BinOp, ast.UnaryOp)) else type(node).__name__
    raise CalculatorError(f"{what} is not allowed (only {_ALLOWED})")


def evaluate(expression: str) -> int | float:
    """The value of an arithmetic expression; CalculatorError says what is wrong otherwise."""
    if not isinstance(expression, str):
        raise CalculatorError(f"the expression must be a string, got {type(expression).__name__}")
    if len(expression) > MAX_CHARS:
        raise CalculatorError(f"the expression is {len(expression)} characters long (at most {MAX_CHARS})")
    text = expression.strip().replace("×", "*").replace("÷", "/").replace("−", "-")
    if not text:
        raise CalculatorError("the expression is empty")
    try:
        tree = ast.parse(text, mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError) as e:
        raise CalculatorError(f"cannot parse {text[:80]!r}: {getattr(e, 'msg', e)}") from None
    try:
        return _eval(tree)
    except RecursionError:
        raise CalculatorError("the expression is nested too deeply") from None


def format_number(x: int | float) -> str:
    """Integers exactly; floats with 12 significant digits, whole floats without '.0' (7/7 -> '1')."""
    if isinstance(x, float):
        if x.is_integer() and abs(x) < 1e15:
            return str(int(x))
        return f"{x:.12g}"
    return str(x)


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression and return its value.

    Args:
        expression: An arithmetic expression using numbers, + - * / // % ** and parentheses, e.g. "(12 + 7) * 3".
    """
    return format_number(evaluate(expression))


def operations(expression: str) -> list[str]:
    """The binary operators of an arithmetic expression, in the tree's order ('7 * 3 - 2' -> ['-', '*']);
    a sign on a number is no operation. CalculatorError when it does not parse."""
    text = expression.strip().replace("×", "*").replace("÷", "/").replace("−", "-")
    try:
        tree = ast.parse(text, mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError) as e:
        raise CalculatorError(f"cannot parse {text[:80]!r}: {getattr(e, 'msg', e)}") from None
    return [_SYMBOL.get(type(n.op), type(n.op).__name__) for n in ast.walk(tree) if isinstance(n, ast.BinOp)]


_SYMBOL = {ast.Add: "+", ast.Sub: "-", ast.Mult: "*", ast.Div: "/", ast.FloorDiv: "//", ast.Mod: "%", ast.Pow: "**"}


def one_operation_calculator(expression: str) -> str:
    """One arithmetic operation on two numbers.

    Args:
        expression: One operation, e.g. "12 * 7" or "-5 + 30".
    """
    # the chained tool task's calculator (tasks/tool_arithmetic.py, dataset chain_arithmetic): a whole
    # expression is refused, so the model must order the operations and carry each result into the next call
    if not isinstance(expression, str):
        raise CalculatorError(f"the expression must be a string, got {type(expression).__name__}")
    if len(expression) > MAX_CHARS:
        raise CalculatorError(f"the expression is {len(expression)} characters long (at most {MAX_CHARS})")
    ops = operations(expression)
    if len(ops) != 1:
        raise CalculatorError(f"one operation per call: {expression.strip()[:80]!r} has {len(ops)}"
                              + (f" ({', '.join(ops)})" if ops else "")
                              + "; call once per operation and write earlier results as numbers")
    return calculator(expression)
