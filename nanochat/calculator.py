"""
The calculator tool the engine gives the model: <|python_start|> expr <|python_end|> is answered with the value of
`expr`, or with nothing when the calculator refuses it.

    use_calculator("12*7")                     # 84
    use_calculator("'strawberry'.count('r')")  # 3
    use_calculator("__import__('os')")         # None (safe_eval raises CalculatorError saying why)
"""

import ast
import math
import operator
import re
import time

# The model writes Python-looking expressions ("12*7", "'strawberry'.count('r')"). Running them with eval() would hand
# anyone who can prompt the model a Python interpreter, so we parse with `ast` and walk a whitelist instead:
# numbers, + - * / // % ** (bounded), unary +/-, parentheses, and "<string literal>".count("<string literal>").
# Everything else (names, calls, attributes, subscripts, comprehensions, lambdas, ...) is refused before anything runs.

MAX_EXPR_CHARS = 1000  # longer "expressions" are not calculator questions
MAX_AST_NODES = 400
MAX_AST_DEPTH = 60
MAX_INT_BITS = 1024  # ~308 decimal digits: anything bigger is not a useful answer and costs time to print
MAX_POW_EXPONENT = 10_000
CALC_TIME_LIMIT_S = 0.5


class CalculatorError(ValueError):
    """The expression is not something the calculator evaluates (the message says why)."""


_BINOPS = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARYOPS = {ast.UAdd: operator.pos, ast.USub: operator.neg}


def _is_number(x):
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _check_number(x):
    """Results must be finite real numbers of bounded size."""
    if isinstance(x, complex):
        raise CalculatorError("result is a complex number")
    if isinstance(x, float) and not math.isfinite(x):
        raise CalculatorError("result is not finite")
    if isinstance(x, int) and x.bit_length() > MAX_INT_BITS:
        raise CalculatorError(f"result is too large (more than {MAX_INT_BITS} bits)")
    return x


def _safe_pow(base, exp):
    # Refuse before computing: 9**9**9 would otherwise take minutes and gigabytes.
    if abs(exp) > MAX_POW_EXPONENT:
        raise CalculatorError(f"exponent {exp} is too large (limit {MAX_POW_EXPONENT})")
    if isinstance(base, int) and isinstance(exp, int) and exp > 0 and abs(base) > 1:
        if exp * (abs(base).bit_length() - 1) > MAX_INT_BITS:
            raise CalculatorError(f"result is too large (more than {MAX_INT_BITS} bits)")
    if base == 0 and exp < 0:
        raise CalculatorError("division by zero")
    try:
        return base**exp
    except OverflowError:
        raise CalculatorError("result is too large") from None


class _Evaluator:
    def __init__(self, deadline):
        self.deadline = deadline
        self.nodes = 0

    def eval(self, node, depth=0):
        self.nodes += 1
        if self.nodes > MAX_AST_NODES:
            raise CalculatorError(f"expression has more than {MAX_AST_NODES} parts")
        if depth > MAX_AST_DEPTH:
            raise CalculatorError(f"expression is nested deeper than {MAX_AST_DEPTH}")
        if time.monotonic() > self.deadline:
            raise CalculatorError(f"time limit of {CALC_TIME_LIMIT_S}s exceeded")

        if isinstance(node, ast.Expression):
            return self.eval(node.body, depth + 1)
        if isinstance(node, ast.Constant):
            if _is_number(node.value):
                return _check_number(node.value)
            if isinstance(node.value, str):
                raise CalculatorError("a string literal is only allowed as \"text\".count(\"x\")")
            raise CalculatorError(f"constant {node.value!r} is not a number")
        if isinstance(node, ast.BinOp):
            op = _BINOPS.get(type(node.op))
            if op is None:
                raise CalculatorError(f"operator {type(node.op).__name__} is not allowed")
            left = self.eval(node.left, depth + 1)
            right = self.eval(node.right, depth + 1)
            if not (_is_number(left) and _is_number(right)):
                raise CalculatorError("arithmetic is only allowed on numbers")
            if isinstance(node.op, ast.Pow):
                return _check_number(_safe_pow(left, right))
            try:
                return _check_number(op(left, right))
            except ZeroDivisionError:
                raise CalculatorError("division by zero") from None
            except OverflowError:
                raise CalculatorError("result is too large") from None
        if isinstance(node, ast.UnaryOp):
            op = _UNARYOPS.get(type(node.op))
            if op is None:
                raise CalculatorError(f"unary operator {type(node.op).__name__} is not allowed")
            value = self.eval(node.operand, depth + 1)
            if not _is_number(value):
                raise CalculatorError("unary +/- is only allowed on numbers")
            return _check_number(op(value))
        if isinstance(node, ast.Call):
            return self.eval_count(node, depth)
        if isinstance(node, ast.Name):
            raise CalculatorError(f"names are not allowed: {node.id!r}")
        if isinstance(node, ast.Attribute):
            raise CalculatorError(f"attribute access is not allowed: .{node.attr}")
        raise CalculatorError(f"{type(node).__name__} is not allowed in a calculator expression")

    def eval_count(self, node, depth):
        """"text".count("x"[, start[, end]]) with string literals: the one method call the tool supports."""
        func = node.func
        if not (isinstance(func, ast.Attribute) and func.attr == "count"):
            if isinstance(func, ast.Name):
                raise CalculatorError(f"calling {func.id}() is not allowed")
            raise CalculatorError("the only call allowed is \"text\".count(\"x\")")
        if not (isinstance(func.value, ast.Constant) and isinstance(func.value.value, str)):
            raise CalculatorError(".count() is only allowed on a string literal")
        if node.keywords or not (1 <= len(node.args) <= 3):
            raise CalculatorError(".count() takes a string literal and optionally start/end positions")
        needle = node.args[0]
        if not (isinstance(needle, ast.Constant) and isinstance(needle.value, str)):
            raise CalculatorError(".count() needs a string literal to count")
        bounds = [self.eval(a, depth + 1) for a in node.args[1:]]
        if not all(isinstance(b, int) and not isinstance(b, bool) for b in bounds):
            raise CalculatorError(".count() start/end must be integers")
        return func.value.value.count(needle.value, *bounds)


def safe_eval(expr):
    """Evaluate a calculator expression or raise CalculatorError saying why it was refused. Never runs code."""
    if not isinstance(expr, str):
        raise CalculatorError(f"expression must be a string, got {type(expr).__name__}")
    expr = expr.strip()
    if not expr:
        raise CalculatorError("empty expression")
    if len(expr) > MAX_EXPR_CHARS:
        raise CalculatorError(f"expression is longer than {MAX_EXPR_CHARS} characters")
    if "'" not in expr and '"' not in expr:
        # thousands separators as models (and GSM8K) write them: 1,234,567 -> 1234567
        expr = re.sub(r"(?<=\d),(?=\d{3}(?!\d))", "", expr)
    try:
        tree = ast.parse(expr, mode="eval")
    except SyntaxError as e:
        raise CalculatorError(f"not a single expression: {e.msg}") from None
    except (ValueError, RecursionError, MemoryError) as e:
        raise CalculatorError(f"cannot parse expression: {type(e).__name__}") from None
    try:
        return _Evaluator(time.monotonic() + CALC_TIME_LIMIT_S).eval(tree)
    except RecursionError:
        raise CalculatorError("expression is nested too deeply") from None


def use_calculator(expr):
    """The tool as the engine calls it: the value, or None when the expression is refused or fails."""
    try:
        return safe_eval(expr)
    except CalculatorError:
        return None
