"""`--moe-layer-freq`'s per-layer pattern, read as data.

Megatron-LM evaluates the flag's text as Python ('([0]+[1])*2'); the text also comes from
checkpoints (stored arguments), so here it is parsed by a small grammar instead: integers, list
literals, '+' (concatenation), '*' (repetition) and parentheses. Every size is bounded before
anything is built from it: '9**9**9' and '[1]*10**9' are refused at once, not computed.

    expr   := term ('+' term)*
    term   := factor ('*' factor)*
    factor := INT | '[' [expr (',' expr)*] ']' | '(' expr ')'
"""

import re

MAX_TEXT = 65536  # characters: a 10,000-layer list literal fits
MAX_LAYERS = 10000  # the longest pattern, and the largest integer, the parser builds
MAX_DEPTH = 32  # nested brackets and parentheses

_TOKEN = re.compile(r"\s*(?:(\d+)|(.))")


class PatternError(ValueError):
    """The text is not a pattern this parser reads; the message says what was expected."""


def _tokens(text: str) -> list:
    out = []
    for m in _TOKEN.finditer(text):
        number, symbol = m.groups()
        if number is not None:
            if len(number) > len(str(MAX_LAYERS)):
                raise PatternError(f"integer {number[:12]}{'...' if len(number) > 12 else ''} exceeds {MAX_LAYERS}")
            out.append(int(number))
        elif symbol is not None and not symbol.isspace():
            if symbol not in "[](),+*":
                raise PatternError(f"unexpected character {symbol!r}; expected digits, [ ] ( ) , + *")
            out.append(symbol)
    return out


class _Parser:
    def __init__(self, tokens: list):
        self.tokens, self.at, self.depth = tokens, 0, 0

    def peek(self):
        return self.tokens[self.at] if self.at < len(self.tokens) else None

    def take(self, symbol=None):
        token = self.peek()
        if token is None or (symbol is not None and token != symbol):
            raise PatternError(f"expected {symbol or 'a value'!r} at token {self.at + 1}, found "
                               f"{'the end' if token is None else repr(token)}")
        self.at += 1
        return token

    def expr(self):
        value = self.term()
        while self.peek() == "+":
            self.take("+")
            value = _add(value, self.term())
        return value

    def term(self):
        value = self.factor()
        while self.peek() == "*":
            self.take("*")
            value = _times(value, self.factor())
        return value

    def factor(self):
        token = self.take()
        if isinstance(token, int):
            return token
        if token not in "[(":
            raise PatternError(f"unexpected {token!r} at token {self.at}; expected an integer, '[' or '('")
        self.depth += 1
        if self.depth > MAX_DEPTH:
            raise PatternError(f"brackets nested deeper than {MAX_DEPTH}")
        if token == "(":
            value = self.expr()
            self.take(")")
        else:
            value = []
            while self.peek() != "]":
                if value:
                    self.take(",")
                item = self.expr()
                if not isinstance(item, int):
                    raise PatternError("a list holds integers, not lists")
                if len(value) >= MAX_LAYERS:
                    raise PatternError(f"the pattern exceeds {MAX_LAYERS} layers")
                value.append(item)
            self.take("]")
        self.depth -= 1
        return value


def _add(a, b):
    if isinstance(a, int) != isinstance(b, int):
        raise PatternError("'+' joins two lists or two integers, not a list and an integer")
    if isinstance(a, int):
        return _bounded_int(a + b)
    if len(a) + len(b) > MAX_LAYERS:
        raise PatternError(f"the pattern exceeds {MAX_LAYERS} layers")
    return a + b


def _times(a, b):
    if isinstance(a, list) and isinstance(b, list):
        raise PatternError("'*' repeats a list an integer number of times, not by a list")
    if isinstance(a, int) and isinstance(b, int):
        return _bounded_int(a * b)
    items, count = (a, b) if isinstance(a, list) else (b, a)
    if len(items) * count > MAX_LAYERS:
        raise PatternError(f"the pattern exceeds {MAX_LAYERS} layers ({len(items)} x {count})")
    return items * count


def _bounded_int(n: int) -> int:
    if n > MAX_LAYERS:
        raise PatternError(f"integer {n} exceeds {MAX_LAYERS}")
    return n


def parse(text: str):
    """An integer N (MoE every N-th layer) or a list of 0/1 (one per layer) from `text`."""
    if len(text) > MAX_TEXT:
        raise PatternError(f"text of {len(text)} characters; expected at most {MAX_TEXT}")
    parser = _Parser(_tokens(text))
    value = parser.expr()
    if parser.peek() is not None:
        raise PatternError(f"unexpected {parser.peek()!r} at token {parser.at + 1}; expected the end")
    if isinstance(value, list) and any(v not in (0, 1) for v in value):
        raise PatternError(f"a per-layer pattern holds 0 (dense) and 1 (MoE), found {sorted(set(value) - {0, 1})[:3]}")
    return value
