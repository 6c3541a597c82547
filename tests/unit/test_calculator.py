"""The calculator tool: answers arithmetic and string-count questions, refuses code without running any of it."""

import builtins
import os
import time

import pytest

from nanochat.calculator import CALC_TIME_LIMIT_S, CalculatorError, safe_eval, use_calculator


@pytest.mark.parametrize(
    "expr, expected",
    [
        ("12*7", 84),
        ("1 + 2 * 3", 7),
        ("(1 + 2) * 3", 9),
        ("7 / 2", 3.5),
        ("7 // 2", 3),
        ("-7 // 2", -4),
        ("7 % 3", 1),
        ("2 ** 10", 1024),
        ("2 ** -1", 0.5),
        ("-3 + +5", 2),
        ("1.5 * 4", 6.0),
        ("1,234 + 1", 1235),  # thousands separators, as GSM8K-style text writes numbers
        ("1,000,000 / 4", 250000.0),
        ("  48 / 2  ", 24.0),
        ("'strawberry'.count('r')", 3),
        ('"banana".count("an")', 2),
        ('"a,b,c".count(",")', 2),  # commas inside strings are left alone
        ('"abcabc".count("a", 1)', 1),
        ('"mississippi".count("s") * 2 + 1', 9),
    ],
)
def test_answers_arithmetic_and_string_counts(expr, expected):
    result = use_calculator(expr)
    assert result == expected
    assert type(result) is type(expected)


@pytest.mark.parametrize(
    "expr, reason",
    [
        ("import os", "not a single expression"),
        ("__import__('os').system('echo hacked')", "only call allowed"),
        ("__import__('os')", "calling __import__() is not allowed"),
        ("().__class__.__bases__[0].__subclasses__()", "only call allowed"),
        ("(1).__class__", "attribute access is not allowed"),
        ("'a'.__class__", "attribute access is not allowed"),
        ("'abc'.upper().count('A')", ".count() is only allowed on a string literal"),
        ("'abc'.upper()", "only call allowed"),
        ("x + 1", "names are not allowed"),
        ("open('/etc/passwd').read()", "only call allowed"),
        ("len('abc')", "calling len() is not allowed"),
        ("(lambda: 1)()", "only call allowed"),
        ("[i for i in range(10**10)]", "ListComp is not allowed"),
        ("sum(i for i in range(10**12))", "calling sum() is not allowed"),
        ("'a' * 10**10", "string literal is only allowed"),
        ("[0] * 10**10", "List is not allowed"),
        ("while True: pass", "not a single expression"),
        ("9**9**9", "too large"),
        ("2**100000", "too large"),
        ("10**400", "too large"),
        ("10.0**400", "too large"),
        ("(-8) ** 0.5", "complex"),
        ("1/0", "division by zero"),
        ("5 % 0", "division by zero"),
        ("0 ** -1", "division by zero"),
        ("1 << 10", "operator LShift is not allowed"),
        ("~5", "unary operator Invert is not allowed"),
        ("True + 1", "not a number"),
        ("1 if 2 else 3", "IfExp is not allowed"),
        ("'abc'[0]", "Subscript is not allowed"),
        ("'abc'.count(x)", "needs a string literal"),
        ("'abc'.count('a', 1.5)", "must be integers"),
        ("", "empty expression"),
        ("1+" * 600 + "1", "longer than"),
        ("-" * 200 + "1", "nested"),
    ],
)
def test_refuses_code_and_unbounded_work(expr, reason):
    # this thread's CPU time, not the wall clock: a CI machine at load 4 once stalled this process past the bound
    start = time.thread_time()
    with pytest.raises(CalculatorError, match=None) as excinfo:
        safe_eval(expr)
    assert reason in str(excinfo.value), f"{expr!r}: {excinfo.value}"
    assert use_calculator(expr) is None
    # refusals are decided up front, never by running the work and timing out
    assert time.thread_time() - start < CALC_TIME_LIMIT_S


def test_refused_code_never_runs(tmp_path, monkeypatch):
    # If any of these ran, a file would appear (or the process would exit).
    monkeypatch.chdir(tmp_path)
    attacks = [
        "__import__('pathlib').Path('pwned1').touch()",
        "open('pwned2', 'w').write('x')",
        "().__class__.__base__.__subclasses__()[0]('pwned3')",
        "[open('pwned4','w') for _ in '1']",
        "'x'.count(open('pwned5','w'))",
        "__import__('os').system('touch pwned6')",
        "exit()",
    ]
    for expr in attacks:
        assert use_calculator(expr) is None
    assert sorted(os.listdir(tmp_path)) == []


def test_works_without_eval_or_exec(monkeypatch):
    # The evaluator walks the AST itself: with eval/exec gone it still computes.
    def forbidden(*a, **k):
        raise AssertionError("the calculator must not call eval/exec")

    monkeypatch.setattr(builtins, "eval", forbidden)
    monkeypatch.setattr(builtins, "exec", forbidden)
    assert use_calculator("(3 + 4) * 6 - 2 ** 3") == 34
    assert use_calculator("'hello world'.count('o')") == 2


def test_engine_keeps_nanochat_calculator_name():
    # nanochat's engine.py defines use_calculator; code written against nanochat imports it from there
    from nanochat import calculator, engine

    assert engine.use_calculator is calculator.use_calculator
