"""Constrained decoding on real llguidance and the real SmolLM2 tokenizer: a random-logits
"model" driven through `Constraint.mask` / `advance` must produce documents that validate."""

from __future__ import annotations

import json

import jsonschema
import pytest
import torch
from pydantic import BaseModel

from kubetune.serve.http.tools import NamedToolChoice, Tool, calls_from_json, plan_tools
from kubetune.serve.native.structured import Constraint, ConstraintError, Grammars

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 130},
        "blood": {"enum": ["A", "B", "AB", "O"]},
        "doses_mg": {"type": "array", "items": {"type": "number"}, "maxItems": 3},
        "allergic": {"type": "boolean"},
        "contact": {
            "type": "object",
            "properties": {"email": {"type": "string", "maxLength": 20}},
            "required": ["email"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "age", "blood", "doses_mg", "allergic", "contact"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def grammars(tokenizer) -> Grammars:
    return Grammars(tokenizer)


@pytest.fixture(scope="module")
def closing_bias(tokenizer) -> torch.Tensor:
    """A nudge towards tokens that close strings, objects and arrays, so random documents end."""
    pieces = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
    return torch.tensor([3.0 if any(ch in p for ch in '"}]') else 0.0 for p in pieces])


def generate(constraint: Constraint, bias: torch.Tensor, seed: int, padding: int = 0, steps: int = 400) -> list[int]:
    """Greedy decoding over random logits (with `padding` extra rows, as a model's head may have)."""
    gen = torch.Generator().manual_seed(seed)
    tokens: list[int] = []
    for _ in range(steps):
        logits = torch.randn(bias.numel() + padding, generator=gen)
        logits[: bias.numel()] += bias
        constraint.mask(logits)
        tokens.append(int(logits.argmax()))
        if constraint.advance(tokens[-1]):
            return tokens
    raise AssertionError(f"no complete document in {steps} tokens")


def json_schema_format(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema, "strict": True}}


@pytest.mark.parametrize("seed", range(6))
def test_json_schema_output_validates(grammars, tokenizer, closing_bias, seed):
    factory = grammars.compile(json_schema_format(PERSON))
    assert factory is not None
    text = tokenizer.decode(generate(factory(), closing_bias, seed))
    jsonschema.validate(json.loads(text), PERSON)


def test_pydantic_schema_as_the_openai_client_sends_it(grammars, tokenizer, closing_bias):
    """`client.beta.chat.completions.parse(response_format=Model)` sends the model's JSON schema,
    with $defs and $ref for nested models."""

    class Dose(BaseModel):
        drug: str
        mg: float

    class Plan(BaseModel):
        doses: list[Dose]
        notes: str | None

    schema = Plan.model_json_schema()
    assert "$defs" in schema
    factory = grammars.compile(json_schema_format(schema))
    assert factory is not None
    for seed in range(3):
        text = tokenizer.decode(generate(factory(), closing_bias, seed))
        Plan.model_validate_json(text)  # raises if the document does not fit the model
        jsonschema.validate(json.loads(text), schema)


@pytest.mark.parametrize("seed", range(4))
def test_json_object_gives_an_object(grammars, tokenizer, closing_bias, seed):
    factory = grammars.compile({"type": "json_object"})
    assert factory is not None
    assert isinstance(json.loads(tokenizer.decode(generate(factory(), closing_bias, seed))), dict)


def test_text_format_is_unconstrained(grammars):
    assert grammars.compile({"type": "text"}) is None
    assert grammars.compile(None) is None


@pytest.mark.parametrize(
    ("schema", "why"),
    [({"type": "objectx"}, "objectx"), ({"type": "string", "format": "no-such-format"}, "no-such-format")],
)
def test_a_schema_llguidance_cannot_compile_names_the_field(grammars, schema, why):
    with pytest.raises(ValueError, match=rf"^response_format\.json_schema\.schema: .*{why}"):
        grammars.compile(json_schema_format(schema))


# Schemas that llguidance's validation passes but whose grammar fails at its first step: a
# recursion with no way out has no finite document (the first mask finds no extension, or the
# forced tokens after "{" / "[" never end). The engine used to hit this and answer 500.
UNSATISFIABLE_RECURSION = [
    ({"$ref": "#"}, "NoExtensionBias"),
    ({"$defs": {"a": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}, "NoExtensionBias"),
    ({"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]}, "Too many items"),
    ({"type": "array", "items": {"$ref": "#"}, "minItems": 1}, "Too many items"),
]


@pytest.mark.parametrize(("schema", "why"), UNSATISFIABLE_RECURSION)
def test_a_schema_that_fails_at_its_first_step_is_refused_when_compiled(grammars, schema, why):
    with pytest.raises(ValueError, match=rf"^response_format\.json_schema\.schema: .*{why}"):
        grammars.compile(json_schema_format(schema))


def test_a_recursion_with_a_way_out_is_served(grammars, tokenizer, closing_bias):
    tree = {"type": "object", "properties": {"kids": {"type": "array", "items": {"$ref": "#"}, "maxItems": 2}}}
    factory = grammars.compile(json_schema_format(tree))
    assert factory is not None
    jsonschema.validate(json.loads(tokenizer.decode(generate(factory(), closing_bias, 0))), tree)


def test_each_schema_is_compiled_once_refused_or_not(tokenizer, monkeypatch):
    grammars = Grammars(tokenizer)
    compiled: list[dict] = []
    to_grammar = Grammars._grammar
    monkeypatch.setattr(Grammars, "_grammar", staticmethod(lambda s: compiled.append(s) or to_grammar(s)))
    for _ in range(3):
        assert grammars.compile(json_schema_format({"type": "array", "maxItems": 2})) is not None
    for _ in range(3):
        with pytest.raises(ValueError, match="NoExtensionBias"):
            grammars.compile(json_schema_format({"$ref": "#"}))
    assert compiled == [{"type": "array", "maxItems": 2}, {"$ref": "#"}]


def test_a_bad_tool_schema_names_its_tool(grammars):
    tools = [
        Tool.model_validate({"type": "function", "function": {"name": "ok", "parameters": {"type": "object"}}}),
        Tool.model_validate({"type": "function", "function": {"name": "bad", "parameters": {"type": "nope"}}}),
    ]
    use = plan_tools(tools, "required")
    with pytest.raises(ValueError, match=r"^tools\[1\]\.function\.parameters: .*nope"):
        grammars.compile(use.grammar)


def test_eos_is_forbidden_until_the_document_may_end(grammars, tokenizer):
    eos = tokenizer.eos_token_id
    factory = grammars.compile(json_schema_format({"type": "integer"}))
    assert factory is not None
    constraint = factory()
    logits = torch.zeros(len(tokenizer))
    constraint.mask(logits)
    assert logits[eos] == float("-inf")
    assert not constraint.advance(tokenizer.convert_tokens_to_ids("1"))  # "1" may go on: "12"
    logits = torch.zeros(len(tokenizer))
    constraint.mask(logits)
    assert logits[eos] == 0.0 and logits[tokenizer.convert_tokens_to_ids("2")] == 0.0
    assert constraint.advance(eos)


def test_a_finished_document_stops_without_eos(grammars, tokenizer):
    factory = grammars.compile({"type": "json_object"})
    assert factory is not None
    constraint = factory()
    ids = tokenizer.encode("{}", add_special_tokens=False)
    assert [constraint.advance(t) for t in ids][-1] is True


def test_padding_ids_are_forbidden(grammars, tokenizer, closing_bias):
    factory = grammars.compile(json_schema_format(PERSON))
    assert factory is not None
    constraint = factory()
    logits = torch.full((len(tokenizer) + 64,), 50.0)  # padding rows the argmax would pick
    constraint.mask(logits)
    assert torch.isinf(logits[len(tokenizer) :]).all()
    assert torch.isfinite(logits[: len(tokenizer)]).any()
    with pytest.raises(RuntimeError, match="logits have 100 ids"):  # our bug, not the request's
        constraint.mask(torch.zeros(100))


def test_a_forbidden_token_raises_and_never_hangs(grammars, tokenizer):
    factory = grammars.compile({"type": "json_object"})
    assert factory is not None
    constraint = factory()
    word = tokenizer.encode("hello", add_special_tokens=False)[0]
    with pytest.raises(ConstraintError, match=f"response_format: .*token {word} is not allowed") as refused:
        constraint.advance(word)
    assert refused.value.param == "response_format"


def test_a_character_the_vocabulary_cannot_write_ends_the_answer_as_the_requests_fault(grammars, tokenizer):
    """SmolLM2's byte-level vocabulary has no token for the byte 0xF1, which starts U+40000:
    llguidance's mask then allows a token that its next step refuses. The answer must end
    with an error naming the schema's field (a 400), never a token outside the schema."""
    factory = grammars.compile(json_schema_format({"const": "\U00040000"}))
    assert factory is not None
    constraint = factory()
    with pytest.raises(ConstraintError) as refused:
        for _ in range(8):
            logits = torch.zeros(len(tokenizer))
            constraint.mask(logits)
            if constraint.advance(int(logits.argmax())):
                break
    assert refused.value.param == "response_format.json_schema.schema"
    assert "vocabulary" in str(refused.value)


def test_constraints_of_one_grammar_are_independent(grammars, tokenizer):
    factory = grammars.compile({"type": "json_object"})
    assert factory is not None
    first, second = factory(), factory()
    for t in tokenizer.encode("{}", add_special_tokens=False):
        first.advance(t)
    logits = torch.zeros(len(tokenizer))
    second.mask(logits)  # still at the start: "{" allowed, EOS not
    assert logits[tokenizer.eos_token_id] == float("-inf")
    assert logits[tokenizer.convert_tokens_to_ids("{")] == 0.0


def test_the_cache_is_bounded(tokenizer):
    grammars = Grammars(tokenizer, cache_size=2)
    for n in range(4):
        grammars.compile(json_schema_format({"type": "array", "maxItems": n}))
    assert len(grammars._cache) == 2


@pytest.mark.parametrize("parallel", [True, False])
def test_required_tool_choice_gives_valid_calls_by_construction(grammars, tokenizer, closing_bias, parallel):
    weather = {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 10}, "unit": {"enum": ["C", "F"]}},
        "required": ["city", "unit"],
        "additionalProperties": False,
    }
    tools = [
        Tool.model_validate({"type": "function", "function": {"name": "get_weather", "parameters": weather}}),
        Tool.model_validate({"type": "function", "function": {"name": "now"}}),  # no parameters
    ]
    use = plan_tools(tools, "required", parallel)
    factory = grammars.compile(use.grammar)
    assert factory is not None and use.parse == "json"
    for seed in range(3):
        calls = calls_from_json(tokenizer.decode(generate(factory(), closing_bias, seed)))
        assert calls and (parallel or len(calls) == 1)
        for call in calls:
            assert call.function.name in {"get_weather", "now"}
            if call.function.name == "get_weather":
                jsonschema.validate(json.loads(call.function.arguments), weather)


def test_named_tool_choice_calls_that_function(grammars, tokenizer, closing_bias):
    tools = [
        Tool.model_validate({"type": "function", "function": {"name": "a"}}),
        Tool.model_validate({"type": "function", "function": {"name": "b"}}),
    ]
    use = plan_tools(tools, NamedToolChoice.model_validate({"type": "function", "function": {"name": "b"}}))
    factory = grammars.compile(use.grammar)
    assert factory is not None
    calls = calls_from_json(tokenizer.decode(generate(factory(), closing_bias, 0)))
    assert [c.function.name for c in calls] == ["b"]
