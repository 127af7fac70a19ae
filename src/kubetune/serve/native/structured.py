"""Constrained decoding for `response_format` and forced tool calls, on llguidance.

llguidance (the grammar engine behind vLLM's `guided_decoding_backend=guidance`) compiles a
JSON schema into a grammar over the tokenizer's vocabulary and, at each step, gives the set
of tokens that keep the output a prefix of some valid document. Building its tokenizer costs
about half a second, so one `Grammars` per server holds it, and compiled grammars are cached
by spec (clients send the same schema on every request), as are refusals.

A schema is refused at admission (the API's 400) when llguidance cannot compile it, and also
when its grammar cannot take the first step: llguidance's validation passes a recursion with
no way out, which used to fail inside the engine, as a 500.

Per sequence, the engine asks its `Constraint` to `mask` the logits row before sampling and
`advance` it with the chosen token; `advance` says when the document is complete, so the
sequence stops there without waiting for the model's EOS.

JSON is written without free whitespace, with json.dumps's separators (`", "`, `": "`): a
grammar that allows any whitespace lets a small model run newlines until max_tokens (a known
failure of flexible-whitespace grammars), and this is the spacing models see most.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from collections.abc import Callable, Mapping
from typing import Any

import llguidance
import llguidance.hf
import torch
from pydantic import TypeAdapter

from kubetune.contracts.engine import RequestError
from kubetune.serve.http.tools import ResponseFormat, ResponseFormatJsonObject, ResponseFormatJsonSchema, ToolGrammar

JSON_OPTIONS: dict[str, Any] = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
ANY_OBJECT: dict[str, Any] = {"type": "object"}
# short errors: the verbose ones carry the parser's state and the whole grammar (the client's schema)
LIMITS = llguidance.LLParserLimits(verbose_errors=False)
_BITS = torch.arange(32, dtype=torch.int32)


class ConstraintError(RequestError):
    """The answer cannot go on inside its grammar: the grammar engine stopped, or refused the
    token its own mask allowed. Both happen where the schema asks for text that this model's
    vocabulary cannot write (a character none of its tokens holds the first byte of), which
    admission cannot see: the request's fault, a 400 naming the schema's field."""


class Constraint:
    """One sequence's grammar state. Used on the engine's thread only."""

    def __init__(self, matcher: llguidance.LLMatcher, vocab_size: int, param: str = "response_format") -> None:
        self._matcher = matcher
        self._vocab = vocab_size  # the tokenizer's; ids at or above it are the model's padding rows
        self._param = param  # the request field the schema came from, for the error
        self._bitmask = torch.zeros((vocab_size + 31) // 32, dtype=torch.int32)

    def mask(self, logits: torch.Tensor) -> None:
        """Set -inf in place (a [vocab] float row) wherever the grammar forbids the next token.

        EOS stays allowed only where the document may end; padding ids beyond the tokenizer's
        vocabulary are always forbidden."""
        if logits.shape[-1] < self._vocab:  # a bug of ours, not the request's
            raise RuntimeError(f"logits have {logits.shape[-1]} ids, the tokenizer {self._vocab}")
        self._matcher.unsafe_compute_mask_ptr(self._bitmask.data_ptr(), self._bitmask.numel() * 4)
        self._check()
        allowed = ((self._bitmask.unsqueeze(1) >> _BITS) & 1).view(-1)[: self._vocab]
        logits[: self._vocab].masked_fill_(allowed == 0, float("-inf"))
        logits[self._vocab :] = float("-inf")

    def advance(self, token: int) -> bool:
        """Consume the sampled token; True when the document is complete and the sequence must stop."""
        if not self._matcher.consume_token(token):
            raise self._error(f"token {token} is not allowed here ({self._why()})")
        return bool(self._matcher.is_stopped())

    def _check(self) -> None:
        if self._matcher.is_error():
            raise self._error(self._why())

    def _error(self, why: str) -> ConstraintError:
        return ConstraintError(
            f"{self._param}: the answer cannot go on inside this JSON schema with this model's vocabulary "
            f"(llguidance: {why}); characters the vocabulary cannot write are the usual cause",
            self._param,
        )

    def _why(self) -> str:
        return (self._matcher.get_error() or "the grammar engine gave no reason").splitlines()[0]


ConstraintFactory = Callable[[], Constraint]
Spec = ResponseFormat | ToolGrammar | Mapping[str, Any]
_FORMAT: TypeAdapter[Any] = TypeAdapter(ResponseFormat)


class Grammars:
    """The server's grammar compiler: one llguidance tokenizer, a bounded cache of grammars."""

    def __init__(self, tokenizer: Any, eos_token_id: int | None = None, cache_size: int = 64) -> None:
        self._tokenizer = llguidance.hf.from_tokenizer(tokenizer, eos_token=eos_token_id)
        self._vocab = int(self._tokenizer.vocab_size)
        self._cache: OrderedDict[str, llguidance.LLMatcher | str] = OrderedDict()  # a str: why it was refused
        self._cache_size = cache_size
        self._lock = threading.Lock()  # requests compile on the API's worker threads

    def compile(self, spec: Spec | None) -> ConstraintFactory | None:
        """A factory of fresh Constraints for a response_format (a model or its JSON) or a
        ToolGrammar; None where nothing is constrained ({"type": "text"}). ValueError naming
        the field where llguidance cannot follow the schema: it fails to compile it, or to take
        the grammar's first step (both are found here, at admission, not by the engine)."""
        schema, param, parts = _schema_of(spec)
        if schema is None:
            return None
        template = self._template(schema, param, parts)
        vocab = self._vocab
        return lambda: Constraint(template.deep_copy(), vocab, param)

    def _template(
        self, schema: dict[str, Any], param: str, parts: tuple[tuple[str, dict[str, Any]], ...]
    ) -> llguidance.LLMatcher:
        """The schema's matcher, or ValueError; both cached, so a schema is compiled once."""
        key = json.dumps([schema, param], sort_keys=True)
        with self._lock:
            known = self._cache.get(key)
            if known is not None:
                self._cache.move_to_end(key)
        if known is None:
            built = self._build(schema)
            known = built if isinstance(built, llguidance.LLMatcher) else self._blame(param, parts, built)
            with self._lock:
                self._cache[key] = known
                while len(self._cache) > self._cache_size:
                    self._cache.popitem(last=False)
        if isinstance(known, str):
            raise ValueError(known)
        return known

    @staticmethod
    def _grammar(schema: dict[str, Any]) -> str:
        return str(llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS))  # type: ignore[arg-type]

    def _build(self, schema: dict[str, Any]) -> llguidance.LLMatcher | str:
        """The schema's matcher, or what llguidance finds wrong with it (unknown type,
        unsupported keyword, a grammar that cannot take its first step, ...)."""
        try:
            grammar = self._grammar(schema)
        except ValueError as e:
            return _one_line(str(e))
        failed, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, self._tokenizer, limits=LIMITS)
        if failed:
            return _one_line(messages[0])
        matcher = llguidance.LLMatcher(self._tokenizer, grammar, log_level=0, limits=LIMITS)
        return _first_step_error(matcher) or matcher

    def _blame(self, param: str, parts: tuple[tuple[str, dict[str, Any]], ...], error: str) -> str:
        """The message of the 400: the field of the first schema that fails alone, and why."""
        field, why = param, error
        for name, schema in parts:
            own = self._build(schema)
            if isinstance(own, str):
                field, why = name, own
                break
        return f"{field}: this JSON schema cannot be used for constrained decoding ({why}); fix or simplify it"


def _first_step_error(matcher: llguidance.LLMatcher) -> str | None:
    """Why the grammar cannot take its first step, on a copy: llguidance's validation passes a
    recursion with no way out ({"$ref": "#"}, arrays that must hold arrays), whose first mask
    finds nothing to extend, or whose forced tokens after the first never end."""
    probe = matcher.deep_copy()
    mask = probe.compute_bitmask()
    if not probe.is_error():
        token = _first_allowed(mask)
        if token is None:
            return "no token can start a document of this schema"
        probe.consume_token(token)
    if not probe.is_error():
        return None
    return f"{probe.get_error().splitlines()[0]}, at the first token: a recursion with no way out does this"


def _first_allowed(mask: bytes) -> int | None:
    """The lowest token id a bitmask allows (bit i of byte k is token 8k + i)."""
    at = next((k for k, byte in enumerate(mask) if byte), None)
    if at is None:
        return None
    byte = mask[at]
    return 8 * at + (byte & -byte).bit_length() - 1


def _one_line(message: str, limit: int = 300) -> str:
    text = " ".join(message.split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _schema_of(spec: Spec | None) -> tuple[dict[str, Any] | None, str, tuple[tuple[str, dict[str, Any]], ...]]:
    """(the schema to follow or None, the request field it came from, its parts for errors)."""
    if spec is None:
        return None, "", ()
    if isinstance(spec, ToolGrammar):
        return spec.schema, spec.param, spec.parts
    fmt = _FORMAT.validate_python(spec) if isinstance(spec, Mapping) else spec
    if isinstance(fmt, ResponseFormatJsonObject):
        return ANY_OBJECT, "response_format", ()
    if isinstance(fmt, ResponseFormatJsonSchema):
        return fmt.json_schema.schema_, "response_format.json_schema.schema", ()
    return None, "", ()
