"""A tiny line-oriented language for the toy code-repair family: lexer, parser, interpreter.

A program is a function of one integer input ``x``; each line is one statement::

    stmt   := VAR '=' expr | 'return' expr | 'if' expr CMP expr ':' simple
    simple := VAR '=' expr | 'return' expr
    expr   := term (('+' | '-') term)*
    term   := unary ('*' unary)*
    unary  := '-' unary | INT | VAR | '(' expr ')'
    CMP    := '==' | '!=' | '<' | '>' | '<=' | '>='

There are no loops, calls or division, so evaluation is a bounded walk over at most a few dozen
nodes: it runs in-process (no sandbox needed) and cannot hang. Values are Python ints capped at
``VALUE_LIMIT`` in magnitude so that a pathological patch (``a = a * a`` chains) stays cheap.

Canonical text puts single spaces between tokens (``a = x + 3``); ``render`` produces it and the
toy tokenizer round-trips it exactly.

It lives with the verifiers because it is what executes toy candidates, as the sandbox executes
Python ones: the toy family's verifier (``gagar_jax.envs.toy.verify``) runs the tests with it,
and the grader's targeted checks on toy workspaces (``grading.adapters.ToyCheckRunner``) run
candidates with it. It imports nothing of the package.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import NamedTuple

VALUE_LIMIT = 10**12
MAX_STATEMENT_TOKENS = 64  # bounds parser recursion: a policy's output must never crash it
KEYWORDS = frozenset({"return", "if", "ins", "del"})
COMPARISONS = ("==", "!=", "<=", ">=", "<", ">")
_TOKEN_RE = re.compile(r"\d+|[A-Za-z_][A-Za-z_0-9]*|==|!=|<=|>=|\S")
_IDENT_RE = re.compile(r"[A-Za-z_][A-Za-z_0-9]*\Z")


class ToyError(ValueError):
    """A syntax or runtime error in toy code (a policy's fault, never an infrastructure error)."""


def lex(line: str) -> list[str]:
    """Splits one line of toy text into tokens (numbers, identifiers, operators, punctuation)."""
    return _TOKEN_RE.findall(line)


def render(tokens: Sequence[str]) -> str:
    """Canonical text of a token sequence: tokens joined by single spaces."""
    return " ".join(tokens)


# ----------------------------------------------------------------------------------------------
# AST: plain tuples keep parsing and evaluation allocation-light and hashable.
#   ('num', n) | ('var', name) | ('neg', e) | ('bin', op, l, r)
#   ('assign', name, e) | ('return', e) | ('if', cmp, l, r, simple)
# ----------------------------------------------------------------------------------------------


class _Parser:
    def __init__(self, tokens: Sequence[str]):
        self.toks = list(tokens)
        self.i = 0

    def peek(self) -> str | None:
        return self.toks[self.i] if self.i < len(self.toks) else None

    def take(self, expected: str | None = None) -> str:
        tok = self.peek()
        if tok is None:
            raise ToyError(f"unexpected end of statement (expected {expected or 'a token'})")
        if expected is not None and tok != expected:
            raise ToyError(f"expected {expected!r}, got {tok!r}")
        self.i += 1
        return tok

    def statement(self, allow_if: bool = True):
        tok = self.peek()
        if tok == "return":
            self.take()
            return ("return", self.expr())
        if tok == "if":
            if not allow_if:
                raise ToyError("nested 'if' is not allowed")
            self.take()
            left = self.expr()
            cmp = self.take()
            if cmp not in COMPARISONS:
                raise ToyError(f"expected a comparison, got {cmp!r}")
            right = self.expr()
            self.take(":")
            return ("if", cmp, left, right, self.statement(allow_if=False))
        if tok is not None and _is_var(tok):
            name = self.take()
            self.take("=")
            return ("assign", name, self.expr())
        raise ToyError(f"a statement starts with 'return', 'if' or a variable, got {tok!r}")

    def expr(self):
        node = self.term()
        while self.peek() in ("+", "-"):
            op = self.take()
            node = ("bin", op, node, self.term())
        return node

    def term(self):
        node = self.unary()
        while self.peek() == "*":
            self.take()
            node = ("bin", "*", node, self.unary())
        return node

    def unary(self):
        tok = self.peek()
        if tok == "-":
            self.take()
            return ("neg", self.unary())
        if tok == "(":
            self.take()
            node = self.expr()
            self.take(")")
            return node
        if tok is not None and tok.isdigit():
            self.take()
            return ("num", int(tok))
        if tok is not None and _is_var(tok):
            self.take()
            return ("var", tok)
        raise ToyError(f"expected a number, variable, '-' or '(', got {tok!r}")


def _is_var(tok: str) -> bool:
    return bool(_IDENT_RE.match(tok)) and tok not in KEYWORDS


def parse_statement(text_or_tokens: str | Sequence[str]):
    """Parses one statement; raises ToyError with the reason on bad syntax."""
    toks = lex(text_or_tokens) if isinstance(text_or_tokens, str) else list(text_or_tokens)
    if not toks:
        raise ToyError("empty statement")
    if len(toks) > MAX_STATEMENT_TOKENS:
        raise ToyError(f"statement longer than {MAX_STATEMENT_TOKENS} tokens")
    p = _Parser(toks)
    stmt = p.statement()
    if p.peek() is not None:
        raise ToyError(f"unexpected trailing token {p.peek()!r}")
    return stmt


class Program(NamedTuple):
    """A parsed program: canonical source lines and their statements."""

    lines: tuple[str, ...]
    stmts: tuple


def parse_program(source: str | Sequence[str]) -> Program:
    """Parses a program given as newline-separated statements (or a list of statement lines)."""
    raw = source.split("\n") if isinstance(source, str) else list(source)
    lines, stmts = [], []
    for n, line in enumerate(raw, start=1):
        toks = lex(line)
        try:
            stmts.append(parse_statement(toks))
        except ToyError as e:
            raise ToyError(f"line {n}: {e}") from None
        lines.append(render(toks))
    return Program(tuple(lines), tuple(stmts))


def _eval(node, env: dict[str, int]) -> int:
    kind = node[0]
    if kind == "num":
        return node[1]
    if kind == "var":
        try:
            return env[node[1]]
        except KeyError:
            raise ToyError(f"variable {node[1]!r} is not defined") from None
    if kind == "neg":
        return -_eval(node[1], env)
    op, a, b = node[1], _eval(node[2], env), _eval(node[3], env)
    value = a + b if op == "+" else a - b if op == "-" else a * b
    if abs(value) > VALUE_LIMIT:
        raise ToyError(f"value overflow (|value| > {VALUE_LIMIT})")
    return value


_CMP = {
    "==": lambda a, b: a == b,
    "!=": lambda a, b: a != b,
    "<": lambda a, b: a < b,
    ">": lambda a, b: a > b,
    "<=": lambda a, b: a <= b,
    ">=": lambda a, b: a >= b,
}


def run_program(program: Program, x: int) -> int:
    """Evaluates the program on input ``x``; raises ToyError if it fails or never returns."""
    env = {"x": x}
    for stmt in program.stmts:
        if stmt[0] == "if":
            if not _CMP[stmt[1]](_eval(stmt[2], env), _eval(stmt[3], env)):
                continue
            stmt = stmt[4]
        if stmt[0] == "return":
            return _eval(stmt[1], env)
        env[stmt[1]] = _eval(stmt[2], env)
    raise ToyError("the program ended without 'return'")


def try_run(program: Program, x: int) -> int | None:
    """``run_program`` that returns None instead of raising on a toy runtime error."""
    try:
        return run_program(program, x)
    except ToyError:
        return None


def variables(stmt) -> tuple[set[str], set[str]]:
    """(names read, names written) by one statement."""
    reads: set[str] = set()
    writes: set[str] = set()

    def walk(node):
        if node[0] == "var":
            reads.add(node[1])
        elif node[0] == "neg":
            walk(node[1])
        elif node[0] == "bin":
            walk(node[2])
            walk(node[3])

    if stmt[0] == "if":
        walk(stmt[2])
        walk(stmt[3])
        stmt = stmt[4]
    if stmt[0] == "assign":
        writes.add(stmt[1])
        walk(stmt[2])
    else:
        walk(stmt[1])
    return reads, writes


def const_value(node) -> int | None:
    """The value of an expression with no variables, else None."""
    try:
        return _eval(node, {})
    except ToyError:
        return None


def expressions(stmt):
    """All expression trees of a statement (guard operands first)."""
    if stmt[0] == "if":
        yield stmt[2]
        yield stmt[3]
        stmt = stmt[4]
    yield stmt[2] if stmt[0] == "assign" else stmt[1]


def subexpressions(node):
    """Pre-order walk over an expression tree."""
    yield node
    if node[0] == "neg":
        yield from subexpressions(node[1])
    elif node[0] == "bin":
        yield from subexpressions(node[2])
        yield from subexpressions(node[3])
