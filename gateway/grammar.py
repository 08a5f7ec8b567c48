"""Structured output in the gateway: a request's OutputConstraint compiled to an llguidance matcher.

The matcher lives here, beside the rejection rule, because the gateway is what knows each round's drafts
and verdict: it walks a round's drafts through the grammar, sends the verify one allowed-token mask per
scored position (specd_common/masks.py; the verify restricts the target's logits to it), drops drafts
the grammar forbids, drafts for free the tokens the grammar forces (jump-forward), and advances by what
was kept. llguidance is torch-free (the gateway carries no torch) and measured fast enough on the
default tokenizer's 49,152 tokens: building its tokenizer 0.44 s once, compiling a nested schema 2 ms,
a mask 36 µs median (docs/design/structured-output.md has the numbers against xgrammar).
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Optional, Sequence

import llguidance

from specd.v1 import common_pb2, generate_pb2
from specd_common.errors import InvalidArgument, require
from specd_common.masks import bitmap_allows, encode_mask

MAX_CONSTRAINT_BYTES = 64 * 1024  # a schema, regex or grammar's text: compiling a 277 KB schema took 1.2 s on the EPYC VM
MAX_CHOICES = 256  # strings in a choice constraint
MAX_CHOICE_CHARS = 1024  # characters in one of them
COMPILED_CACHE_SIZE = 128  # compiled grammars kept, by their text: clients repeat the same schema
# One JSON layout: compact but with the spaces json.dumps and most models write. Flexible whitespace
# would let a model pad forever (a known failure of JSON modes) and leave nothing forced to jump over.
JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


@dataclass(frozen=True)
class CompiledGrammar:
    """A constraint checked and compiled once; each request runs its own copy (GrammarState)."""

    matcher: llguidance.LLMatcher  # at the start of the answer; never advanced itself

    def start(self) -> "GrammarState":
        return GrammarState(self.matcher.deep_copy())


class Grammars:
    """Compiles constraints against the target's tokenizer (built on first use: 0.44 s), caching by text."""

    def __init__(self, tokenizer_json: str, vocab_size: int, eos_token_ids: Sequence[int]):
        self._tokenizer_json, self.vocab_size = tokenizer_json, vocab_size
        self._eos = int(eos_token_ids[0]) if eos_token_ids else None
        self._tokenizer: Optional[llguidance.LLTokenizer] = None
        self._compiled: OrderedDict[tuple[str, str], CompiledGrammar] = OrderedDict()
        self._lock = threading.Lock()

    def compile(self, constraint: generate_pb2.OutputConstraint) -> Optional[CompiledGrammar]:
        """The request's constraint compiled (None when it sets none); INVALID_ARGUMENT naming the field
        and what is wrong with it."""
        kind = constraint.WhichOneof("kind")
        if kind is None or (kind == "json_object" and not constraint.json_object):
            return None
        key = (kind, _text(constraint, kind))
        with self._lock:
            if key in self._compiled:
                self._compiled.move_to_end(key)
                return self._compiled[key]
            tokenizer = self._llg_tokenizer()
        grammar = _grammar(kind, key[1])
        matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0)  # compiles (without the GIL)
        if matcher.is_error():
            raise InvalidArgument(f"constraint.{kind} cannot be used: {_first_lines(matcher.get_error())}")
        compiled = CompiledGrammar(matcher)
        with self._lock:
            self._compiled[key] = compiled
            while len(self._compiled) > COMPILED_CACHE_SIZE:
                self._compiled.popitem(last=False)
        return compiled

    def token_bytes(self, token: int) -> bytes:
        """A token's bytes (the HTTP API's logprobs show them; a token may hold part of a character)."""
        with self._lock:
            tokenizer = self._llg_tokenizer()
        return tokenizer.decode_bytes([token])

    def _llg_tokenizer(self) -> llguidance.LLTokenizer:
        if self._tokenizer is None:
            self._tokenizer = llguidance.LLTokenizer(self._tokenizer_json, n_vocab=self.vocab_size, eos_token=self._eos)
        return self._tokenizer


class GrammarState:
    """One answer's place in its grammar: advanced by the tokens emitted, and asked each round for the
    tokens it forces and the masks along the round's drafts (walked on a copy)."""

    def __init__(self, matcher: llguidance.LLMatcher):
        self._matcher = matcher

    def forced(self, limit: int) -> list[int]:
        """Up to `limit` tokens the grammar forces from here (the canonical tokens of the only bytes it
        allows): drafts that need no drafter. [] when the next token is a choice."""
        return self._matcher.compute_ff_tokens()[:limit] if limit > 0 else []

    def masks_along(self, drafts: Sequence[int], vocab_size: int) -> tuple[int, list[common_pb2.TokenMask]]:
        """How many of a chain's drafts the grammar allows in a row (n), and the allowed tokens at each of
        the n + 1 positions the verify will score for them (after the committed text, then after each
        allowed draft)."""
        walker = self._matcher.deep_copy()  # 20 µs; llguidance's rollback once left a state that allowed a forbidden EOS
        masks, allowed = [], 0
        for position in range(len(drafts) + 1):
            bitmap = walker.compute_bitmask()
            masks.append(encode_mask(bitmap, vocab_size))
            if position == len(drafts) or not bitmap_allows(bitmap, drafts[position]) or not walker.consume_token(drafts[position]):
                break
            allowed += 1
        return allowed, masks

    def advance(self, tokens: Sequence[int]) -> None:
        """Commit the emitted tokens (the verify drew each from its allowed set, so the grammar accepts them)."""
        for token in tokens:  # one by one: consume_tokens refuses the end-of-sequence token after a complete answer
            if not self._matcher.consume_token(token):
                raise RuntimeError(f"the grammar refused emitted token {token}: {_first_lines(self._matcher.get_error())}")


def _text(constraint: generate_pb2.OutputConstraint, kind: str) -> str:
    """The constraint's text, checked for size (and a choice list for shape), as the cache key."""
    if kind == "json_object":
        return ""
    if kind == "choice":
        choices = list(constraint.choice.choices)
        require(1 <= len(choices) <= MAX_CHOICES, f"constraint.choice must hold 1..{MAX_CHOICES} strings, got {len(choices)}")
        for choice in choices:
            require(1 <= len(choice) <= MAX_CHOICE_CHARS, f"each of constraint.choice must be 1..{MAX_CHOICE_CHARS} characters")
        return json.dumps(choices)
    text = getattr(constraint, kind)
    require(0 < len(text.encode()) <= MAX_CONSTRAINT_BYTES,
            f"constraint.{kind} must be 1..{MAX_CONSTRAINT_BYTES} bytes (larger ones would stall the gateway while they "
            f"compile), got {len(text.encode())}")
    return text


def _grammar(kind: str, text: str) -> str:
    """llguidance's grammar for a constraint's text."""
    if kind == "json_object":
        return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_LAYOUT)
    if kind == "json_schema":
        try:
            schema = json.loads(text)
        except ValueError as error:
            raise InvalidArgument(f"constraint.json_schema is not valid JSON: {error}") from None
        require(isinstance(schema, dict), "constraint.json_schema must be a JSON object (a schema)")
        try:
            return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_LAYOUT)
        except ValueError as error:  # what llguidance refuses before compiling
            raise InvalidArgument(f"constraint.json_schema cannot be used: {error}") from None
    if kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(text)
    if kind == "lark_grammar":
        return llguidance.LLMatcher.grammar_from_lark(text)
    # choice: a Lark alternation of string literals (JSON's escapes are Lark's)
    return llguidance.LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in json.loads(text)))


def _first_lines(message: str, lines: int = 6) -> str:
    """An llguidance error, cut to what a client needs (it may append its whole grammar)."""
    return "\n".join(message.strip().splitlines()[:lines])
