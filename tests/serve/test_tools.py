"""Tool calls through the chat template and back: request types, rendering (the real SmolLM2
template, which has no tool support, and a template that reads `tools`), the Hermes parser,
its streaming form, and what tool_choice means."""

from __future__ import annotations

import json

import jsonschema
import pytest
from pydantic import TypeAdapter, ValidationError

from kubetune.serve.http.tools import (
    NamedToolChoice,
    ResponseFormat,
    Tool,
    ToolCall,
    ToolCallStream,
    calls_from_json,
    chat_messages,
    parse_tool_calls,
    plan_tools,
    template_reads_tools,
)

WEATHER = Tool.model_validate(
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather in a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    }
)
CLOCK = Tool.model_validate({"type": "function", "function": {"name": "now"}})

# the shape of Qwen2.5's tool handling, cut down: tools in the system turn, calls dumped with tojson
TOOLS_TEMPLATE = (
    "{% if tools %}<tools>{% for t in tools %}{{ t | tojson }}{% endfor %}</tools>\n{% endif %}"
    "{% for m in messages %}<{{ m.role }}>{{ m.content }}"
    "{% for c in m.tool_calls or [] %}[call {{ c.function.name }} {{ c.function.arguments | tojson }}]{% endfor %}"
    "{% if m.tool_call_id %}(for {{ m.tool_call_id }}){% endif %}</{{ m.role }}>\n{% endfor %}"
)

CONVERSATION = [
    {"role": "user", "content": "Weather in Oslo and Rome?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}},
            {"id": "call_2", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}},
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": "-3 C, snow"},
    {"role": "tool", "tool_call_id": "call_2", "content": "18 C, sun"},
]


def render(tokenizer, prompt) -> str:
    return tokenizer.apply_chat_template(
        prompt.messages, tokenize=False, add_generation_prompt=True, **prompt.template_kwargs
    )


# --- request types ---------------------------------------------------------------------------
def test_response_format_types():
    fmt = TypeAdapter(ResponseFormat)
    parsed = fmt.validate_python({"type": "json_schema", "json_schema": {"name": "p", "schema": {"type": "object"}}})
    assert parsed.json_schema.schema_ == {"type": "object"}
    assert fmt.validate_python({"type": "json_object"}).type == "json_object"
    with pytest.raises(ValidationError) as missing:
        fmt.validate_python({"type": "json_schema", "json_schema": {"name": "p"}})
    assert missing.value.errors()[0]["loc"] == ("json_schema", "json_schema", "schema")
    with pytest.raises(ValidationError):
        fmt.validate_python({"type": "xml"})


def test_tool_and_call_types_are_strict():
    with pytest.raises(ValidationError, match="name"):
        Tool.model_validate({"type": "function", "function": {"name": "has space"}})
    with pytest.raises(ValidationError, match="arguments"):  # arguments are a JSON string, as OpenAI sends them
        ToolCall.model_validate({"id": "c", "type": "function", "function": {"name": "f", "arguments": {"a": 1}}})
    assert CLOCK.function.parameters_schema() == {"type": "object", "properties": {}}


# --- rendering -------------------------------------------------------------------------------
def test_smollm2_template_has_no_tool_support(tokenizer):
    assert not template_reads_tools(tokenizer.chat_template)
    assert template_reads_tools(TOOLS_TEMPLATE)
    assert template_reads_tools({"default": "{{ messages }}", "tool_use": TOOLS_TEMPLATE})
    assert not template_reads_tools(None)
    # transformers' own {% generation %} tag is no jinja2 syntax: the source text decides
    assert template_reads_tools("{% generation %}{{ tools }}{% endgeneration %}")
    assert not template_reads_tools("{% generation %}{{ messages }}{% endgeneration %}")
    assert not template_reads_tools("{% set toolsy = 1 %}{{ toolsy }}")  # a variable, not `tools`


def test_hermes_rendering_lists_the_tools_and_keeps_the_run_system_prompt(tokenizer):
    prompt = chat_messages(CONVERSATION[:1], [WEATHER, CLOCK], tokenizer.chat_template, "You answer doctors.")
    assert prompt.template_kwargs == {}
    text = render(tokenizer, prompt)
    assert text.startswith("<|im_start|>system\nYou answer doctors.\n\n# Tools")
    assert json.dumps(WEATHER.model_dump(exclude_none=True)) in text
    assert '<tool_call>\n{"name": <function-name>' in text
    assert "SmolLM" not in text  # the template's default system turn is replaced, not doubled


def test_hermes_rendering_joins_an_existing_system_turn(tokenizer):
    messages = [{"role": "developer", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    prompt = chat_messages(messages, [CLOCK], tokenizer.chat_template, "ignored: the client set one")
    assert [m["role"] for m in prompt.messages] == ["system", "user"]
    assert prompt.messages[0]["content"].startswith("Be brief.\n\n# Tools")


def test_hermes_rendering_of_calls_and_results(tokenizer):
    text = render(tokenizer, chat_messages(CONVERSATION, [WEATHER], tokenizer.chat_template))
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    assert f"<|im_start|>assistant\n{call}\n<tool_call>" in text
    results = "<tool_response>\n-3 C, snow\n</tool_response>\n<tool_response>\n18 C, sun\n</tool_response>"
    assert f"<|im_start|>user\n{results}<|im_end|>" in text  # both results in one user turn
    assert text.endswith("<|im_start|>assistant\n")


def test_no_tools_leaves_messages_as_they_are(tokenizer):
    messages = [{"role": "user", "content": "Hi"}]
    assert chat_messages(messages, [], tokenizer.chat_template).messages == messages


def test_native_template_gets_tools_and_argument_objects(tokenizer):
    prompt = chat_messages(CONVERSATION, [WEATHER], TOOLS_TEMPLATE)
    assert prompt.template_kwargs == {"tools": [WEATHER.model_dump(exclude_none=True)]}
    text = tokenizer.apply_chat_template(
        prompt.messages, chat_template=TOOLS_TEMPLATE, tokenize=False, **prompt.template_kwargs
    )
    assert '"name": "get_weather"' in text.split("</tools>")[0]
    assert '[call get_weather {"city": "Oslo"}]' in text  # an object, not a JSON string dumped again
    assert "<tool>18 C, sun(for call_2)</tool>" in text


def test_a_parsed_answer_round_trips_into_the_next_prompt(tokenizer):
    answer = 'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Bergen"}}\n</tool_call>'
    content, calls = parse_tool_calls(answer)
    history = [
        {"role": "user", "content": "Weather in Bergen?"},
        {"role": "assistant", "content": content, "tool_calls": [c.model_dump() for c in calls]},
        {"role": "tool", "tool_call_id": calls[0].id, "content": "rain"},
    ]
    text = render(tokenizer, chat_messages(history, [WEATHER], tokenizer.chat_template))
    assert f"<|im_start|>assistant\n{answer}<|im_end|>" in text
    assert "<|im_start|>user\n<tool_response>\nrain\n</tool_response><|im_end|>" in text


# --- parsing ---------------------------------------------------------------------------------
def test_parse_calls_and_content():
    text = (
        "Checking both.\n"
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>\n'
        '<tool_call>{"name": "now", "arguments": {}}</tool_call>'
    )
    content, calls = parse_tool_calls(text)
    assert content == "Checking both."
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [
        ("get_weather", {"city": "Oslo"}),
        ("now", {}),
    ]
    assert all(c.id.startswith("call_") and c.type == "function" for c in calls)
    assert len({c.id for c in calls}) == 2


def test_only_calls_means_no_content():
    content, calls = parse_tool_calls('<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>\n')
    assert content is None and len(calls) == 1


@pytest.mark.parametrize(
    "answer",
    [
        '<tool_call>{"name": "now", "parameters": {}}</tool_call>',  # Llama 3's key
        '<tool_call>{"name": "now", "arguments": "{}"}</tool_call>',  # arguments sent as a JSON string
        '<tool_call>{"name": "now", "arguments": {}}',  # no closing tag: the answer ended (EOS, max_tokens)
    ],
)
def test_parse_variants(answer):
    _, calls = parse_tool_calls(answer)
    assert [(c.function.name, c.function.arguments) for c in calls] == [("now", "{}")]


@pytest.mark.parametrize(
    "text",
    [
        '<tool_call>{"name": "now", "arguments": {</tool_call>',  # broken JSON
        "<tool_call>[1, 2]</tool_call>",  # JSON, but not a call
        '<tool_call>{"arguments": {}}</tool_call>',  # no name
        '<tool_call>{"name": "now", "arguments": [1]}</tool_call>',  # arguments not an object
        "No tools needed: 2 < 3.",
    ],
)
def test_malformed_calls_are_plain_content(text):
    assert parse_tool_calls(text) == (text, [])


def test_a_malformed_block_stays_beside_a_good_one():
    bad = '<tool_call>{"name": </tool_call>'
    content, calls = parse_tool_calls(f'{bad}\n<tool_call>{{"name": "now", "arguments": {{}}}}</tool_call>')
    assert content == bad and [c.function.name for c in calls] == ["now"]


def test_calls_from_constrained_json():
    assert [c.function.name for c in calls_from_json('{"name": "now", "arguments": {}}')] == ["now"]
    two = calls_from_json('[{"name": "a", "arguments": {"x": 1}}, {"name": "b", "arguments": {}}]')
    assert [(c.function.name, json.loads(c.function.arguments)) for c in two] == [("a", {"x": 1}), ("b", {})]
    assert calls_from_json('{"name": "a", "argu') == []  # cut by max_tokens


# --- streaming -------------------------------------------------------------------------------
def stream(text: str, size: int) -> tuple[str, str | None, list[ToolCall]]:
    parser = ToolCallStream()
    sent = "".join(parser.feed(text[i : i + size]) for i in range(0, len(text), size))
    rest, calls = parser.finish()
    return sent, rest, calls


@pytest.mark.parametrize("size", [1, 3, 7, 1000])
def test_stream_sends_content_and_holds_calls(size):
    text = 'Sure.\n<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>'
    sent, rest, calls = stream(text, size)
    assert sent == "Sure.\n" and rest is None and [c.function.name for c in calls] == ["now"]


@pytest.mark.parametrize("size", [1, 4, 1000])
def test_stream_of_plain_text_loses_nothing(size):
    text = "a < b and <tool is not a call <tool_cal"
    sent, rest, calls = stream(text, size)
    assert sent + (rest or "") == text and calls == []
    assert sent == "a < b and <tool is not a call "  # only what could still begin a call is held


def test_stream_of_a_malformed_call_ends_as_content():
    sent, rest, calls = stream('Hm <tool_call>{"name": oops</tool_call> end', 2)
    assert (sent, rest, calls) == ("Hm ", '<tool_call>{"name": oops</tool_call> end', [])


# --- what tool_choice means ------------------------------------------------------------------
def test_tool_choice_none_and_auto():
    assert plan_tools([WEATHER], "none").offered == []
    assert plan_tools(None, None).parse == "none"
    auto = plan_tools([WEATHER], None)  # OpenAI's default with tools
    assert auto.offered == [WEATHER] and auto.grammar is None and auto.parse == "tags"


def test_tool_choice_without_tools_is_refused():
    with pytest.raises(ValueError, match=r"^tool_choice: .*add `tools`"):
        plan_tools([], "required")


def test_named_tool_choice_schema():
    use = plan_tools(
        [WEATHER, CLOCK], NamedToolChoice.model_validate({"type": "function", "function": {"name": "get_weather"}})
    )
    assert use.parse == "json" and use.grammar is not None and use.grammar.param == "tool_choice"
    schema = use.grammar.schema
    jsonschema.validate({"name": "get_weather", "arguments": {"city": "Oslo"}}, schema)
    for wrong in ({"name": "now", "arguments": {"city": "Oslo"}}, {"name": "get_weather", "arguments": {}}):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(wrong, schema)


def test_named_tool_choice_must_name_an_offered_tool():
    choice = NamedToolChoice.model_validate({"type": "function", "function": {"name": "fly"}})
    with pytest.raises(
        ValueError, match=r"^tool_choice\.function\.name: 'fly' is not in `tools` \(offered: get_weather"
    ):
        plan_tools([WEATHER], choice)


@pytest.mark.parametrize("parallel", [True, False, None])
def test_required_tool_choice_schema(parallel):
    use = plan_tools([WEATHER, CLOCK], "required", parallel)
    assert use.grammar is not None
    schema = use.grammar.schema
    one = {"name": "get_weather", "arguments": {"city": "Oslo"}}
    jsonschema.validate([one], schema)
    for wrong in ([], [{"name": "fly", "arguments": {}}], one):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(wrong, schema)
    two = [one, {"name": "now", "arguments": {}}]
    if parallel is False:
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(two, schema)
    else:
        jsonschema.validate(two, schema)
    assert [p for p, _ in use.grammar.parts] == ["tools[0].function.parameters", "tools[1].function.parameters"]
