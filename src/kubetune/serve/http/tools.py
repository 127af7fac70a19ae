"""Tool calls and `response_format` for the chat API: the request types, the prompt, the parser.

Torch-free (pydantic, json and jinja2 only), so the API layer can validate and render without
the engine. Three pieces:

- Request types in protocol.py's strict style: `ResponseFormat`, `Tool`, `ToolChoice`, and
  `ToolCall` for the assistant messages a client sends back.
- `chat_messages`: what reaches `tokenizer.apply_chat_template`. A chat template that reads
  `tools` (Qwen2.5, Llama 3.1, Hermes, Mistral, ...) gets them as `tools=`, and the messages in
  the form HF templates expect. A template without tool support (SmolLM2's) gets the Hermes
  convention as plain text: the functions listed as JSON in the system turn, earlier calls
  as `<tool_call>` blocks in the assistant's turn, results as `<tool_response>` blocks in a user
  turn (as Qwen2.5's template renders them, so every template accepts the roles).
- `parse_tool_calls` (and `ToolCallStream` for streams): the Hermes `<tool_call>` blocks of an
  answer become OpenAI tool calls; a malformed block stays content, never an error.

`plan_tools` says what a request's `tool_choice` means: "none" offers no tools, "auto" offers
them and parses the answer, "required" or a named function also constrains the answer to a
JSON call by construction (`ToolGrammar`, compiled by engine/structured.py), read by `calls_from_json`.
"""

from __future__ import annotations

import functools
import json
import re
import secrets
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

import jinja2
import jinja2.meta
from pydantic import BaseModel, Field

from kubetune.serve.http.fields import STRICT, JsonObject, Text

FUNCTION_NAME = r"^[a-zA-Z0-9_-]{1,64}$"  # OpenAI's rule for function and schema names
CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
RESPONSE_OPEN, RESPONSE_CLOSE = "<tool_response>", "</tool_response>"
NO_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}


# --- request types ---------------------------------------------------------------------------
class ResponseFormatText(BaseModel):
    model_config = STRICT

    type: Literal["text"]


class ResponseFormatJsonObject(BaseModel):
    model_config = STRICT

    type: Literal["json_object"]


class JsonSchemaFormat(BaseModel):
    model_config = STRICT

    name: str = Field(pattern=FUNCTION_NAME)
    description: Text | None = None
    # `schema` would shadow a BaseModel attribute; the JSON field is still "schema"
    schema_: JsonObject = Field(alias="schema")
    strict: bool | None = None


class ResponseFormatJsonSchema(BaseModel):
    model_config = STRICT

    type: Literal["json_schema"]
    json_schema: JsonSchemaFormat


ResponseFormat = Annotated[
    ResponseFormatText | ResponseFormatJsonObject | ResponseFormatJsonSchema, Field(discriminator="type")
]


class FunctionDef(BaseModel):
    model_config = STRICT

    name: str = Field(pattern=FUNCTION_NAME)
    description: Text | None = None
    parameters: JsonObject | None = None  # None: a function without arguments
    strict: bool | None = None

    def parameters_schema(self) -> dict[str, Any]:
        return self.parameters if self.parameters is not None else NO_PARAMETERS


class Tool(BaseModel):
    model_config = STRICT

    type: Literal["function"]
    function: FunctionDef


class FunctionName(BaseModel):
    model_config = STRICT

    name: str = Field(pattern=FUNCTION_NAME)


class NamedToolChoice(BaseModel):
    model_config = STRICT

    type: Literal["function"]
    function: FunctionName


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class FunctionCall(BaseModel):
    model_config = STRICT

    name: str = Field(min_length=1)
    arguments: Text  # a JSON object as a string, as OpenAI sends it


class ToolCall(BaseModel):
    model_config = STRICT

    id: str = Field(min_length=1)
    type: Literal["function"] = "function"
    function: FunctionCall


def new_call(name: str, arguments: Any) -> ToolCall:
    """A call with a fresh id; `arguments` is dumped to the JSON string OpenAI sends."""
    text = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return ToolCall(id=f"call_{secrets.token_hex(12)}", function=FunctionCall(name=name, arguments=text))


# --- what tool_choice means ------------------------------------------------------------------
@dataclass(frozen=True)
class ToolGrammar:
    """The JSON schema a forced call must follow, for `structured.Grammars.compile`.

    `parts` names each function's parameters schema by its request field, so that a schema the
    grammar library cannot compile is reported at `tools[i].function.parameters`."""

    schema: dict[str, Any]
    param: str
    parts: tuple[tuple[str, dict[str, Any]], ...] = ()


@dataclass(frozen=True)
class ToolUse:
    offered: list[Tool] = field(default_factory=list)  # what the prompt lists ([] for "none")
    grammar: ToolGrammar | None = None  # "required" / a named function: the answer is JSON calls
    parse: Literal["none", "tags", "json"] = "none"  # how to read the answer: as is, <tool_call>, JSON


def plan_tools(tools: Sequence[Tool] | None, choice: ToolChoice | None, parallel: bool | None = True) -> ToolUse:
    """What `tools` + `tool_choice` + `parallel_tool_calls` mean for one request (OpenAI's rules:
    the default choice is "auto" with tools, "none" without). ValueError naming the field."""
    tools = list(tools or [])
    if choice is not None and choice != "none" and not tools:
        raise ValueError("tool_choice: set only when `tools` lists functions; add `tools` or drop tool_choice")
    choice = choice if choice is not None else ("auto" if tools else "none")
    if choice == "none":
        return ToolUse()
    if choice == "auto":
        return ToolUse(tools, parse="tags")
    if choice == "required":
        return ToolUse(tools, _required_grammar(tools, parallel is not False), "json")
    return ToolUse(tools, _named_grammar(tools, choice.function.name), "json")


def _call_schema(function: FunctionDef) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": {"name": {"const": function.name}, "arguments": function.parameters_schema()},
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }


def _parts(tools: Sequence[Tool]) -> tuple[tuple[str, dict[str, Any]], ...]:
    return tuple((f"tools[{i}].function.parameters", t.function.parameters_schema()) for i, t in enumerate(tools))


def _named_grammar(tools: Sequence[Tool], name: str) -> ToolGrammar:
    for i, tool in enumerate(tools):
        if tool.function.name == name:
            return ToolGrammar(_call_schema(tool.function), "tool_choice", _parts(tools)[i : i + 1])
    known = ", ".join(t.function.name for t in tools)
    raise ValueError(f"tool_choice.function.name: {name!r} is not in `tools` (offered: {known}); name one of them")


def _required_grammar(tools: Sequence[Tool], parallel: bool) -> ToolGrammar:
    """An array of one or more calls (one at most without parallel calls): vLLM's form."""
    schema: dict[str, Any] = {"type": "array", "items": {"anyOf": [_call_schema(t.function) for t in tools]}}
    schema["minItems"] = 1
    if not parallel:
        schema["maxItems"] = 1
    return ToolGrammar(schema, "tools", _parts(tools))


# --- the prompt ------------------------------------------------------------------------------
@dataclass(frozen=True)
class ChatPrompt:
    """The arguments for `tokenizer.apply_chat_template(messages, **template_kwargs, ...)`."""

    messages: list[dict[str, Any]]
    template_kwargs: dict[str, Any] = field(default_factory=dict)


def template_reads_tools(chat_template: str | Mapping[str, str] | None) -> bool:
    """Whether a chat template (or any of a tokenizer's named templates) uses the `tools` variable."""
    if not chat_template:
        return False
    sources = chat_template.values() if isinstance(chat_template, Mapping) else [chat_template]
    return any(_reads_tools(src) for src in sources)


@functools.lru_cache(maxsize=16)  # one template per served model, asked on every request
def _reads_tools(source: str) -> bool:
    env = jinja2.Environment(extensions=["jinja2.ext.loopcontrols"])  # as transformers renders them
    try:
        # the template's free variables: what apply_chat_template must pass in
        return "tools" in jinja2.meta.find_undeclared_variables(env.parse(source))
    except jinja2.TemplateSyntaxError:  # a tag only transformers defines ({% generation %}): read the text
        return re.search(r"\btools\b", source) is not None


def chat_messages(
    messages: Sequence[Mapping[str, Any]],
    tools: Sequence[Tool],
    chat_template: str | Mapping[str, str] | None,
    system_prompt: str | None = None,
) -> ChatPrompt:
    """The messages (OpenAI's: role, content as text, `tool_calls`, `tool_call_id`) rendered for
    a chat template, with the offered tools where the template reads them, else as Hermes text.

    `system_prompt` is the run's own (PromptRenderer's): the tools section joins it when the
    conversation has no system message, so adding tools never drops it."""
    if template_reads_tools(chat_template):
        kwargs = {"tools": [t.model_dump(exclude_none=True) for t in tools]} if tools else {}
        return ChatPrompt([_native_message(m) for m in messages], kwargs)
    turns = _hermes_turns(messages)
    if tools:
        turns = _with_tools_section(turns, tools, system_prompt)
    return ChatPrompt(turns)


def _role(message: Mapping[str, Any]) -> str:
    role = str(message["role"])
    return "system" if role == "developer" else role


def _calls(message: Mapping[str, Any]) -> list[ToolCall]:
    return [c if isinstance(c, ToolCall) else ToolCall.model_validate(c) for c in message.get("tool_calls") or []]


def _arguments_value(arguments: str) -> Any:
    """Templates dump `arguments` with tojson: give them the object, not its JSON string."""
    try:
        return json.loads(arguments)
    except json.JSONDecodeError:
        return arguments


def _native_message(message: Mapping[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {"role": _role(message), "content": message.get("content") or ""}
    calls = _calls(message)
    if calls:
        out["tool_calls"] = [
            {
                "id": c.id,
                "type": "function",
                "function": {"name": c.function.name, "arguments": _arguments_value(c.function.arguments)},
            }
            for c in calls
        ]
    for key in ("tool_call_id", "name"):
        if message.get(key):
            out[key] = message[key]
    return out


def call_block(name: str, arguments: Any) -> str:
    """One call as the Hermes convention writes it (and as the tools section asks for it)."""
    return f"{CALL_OPEN}\n{json.dumps({'name': name, 'arguments': arguments}, ensure_ascii=False)}\n{CALL_CLOSE}"


def _hermes_turns(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Calls written into the assistant's text; consecutive tool results as one user turn."""
    turns: list[dict[str, Any]] = []
    for message in messages:
        role, content = _role(message), str(message.get("content") or "")
        if role == "tool":
            block = f"{RESPONSE_OPEN}\n{content}\n{RESPONSE_CLOSE}"
            if turns and turns[-1].get("tool_results"):
                turns[-1]["content"] += "\n" + block
            else:
                turns.append({"role": "user", "content": block, "tool_results": True})
            continue
        blocks = [call_block(c.function.name, _arguments_value(c.function.arguments)) for c in _calls(message)]
        turns.append({"role": role, "content": "\n".join(([content] if content else []) + blocks)})
    for turn in turns:
        turn.pop("tool_results", None)  # only marked which user turns gather results
    return turns


def tools_section(tools: Iterable[Tool]) -> str:
    listed = "\n".join(json.dumps(t.model_dump(exclude_none=True), ensure_ascii=False) for t in tools)
    return (
        "# Tools\n\n"
        "You may call one or more functions to answer the user. They are listed as JSON "
        f"within <tools></tools> XML tags:\n<tools>\n{listed}\n</tools>\n\n"
        f"To call a function, answer with a JSON object holding its name and arguments within "
        f"{CALL_OPEN}{CALL_CLOSE} XML tags, one block per call:\n"
        f'{CALL_OPEN}\n{{"name": <function-name>, "arguments": <arguments-json-object>}}\n{CALL_CLOSE}'
    )


def _with_tools_section(
    turns: list[dict[str, Any]], tools: Sequence[Tool], system_prompt: str | None
) -> list[dict[str, Any]]:
    if turns and turns[0]["role"] == "system":
        head, rest = turns[0]["content"], turns[1:]
    else:
        head, rest = system_prompt or "", turns
    system = f"{head}\n\n{tools_section(tools)}" if head else tools_section(tools)
    return [{"role": "system", "content": system}, *rest]


# --- reading the answer ----------------------------------------------------------------------
# a closed block, or the last one left open when the answer ended (EOS or max_tokens)
_BLOCK = re.compile(re.escape(CALL_OPEN) + r"(.*?)(?:" + re.escape(CALL_CLOSE) + r"|\Z)", re.DOTALL)


def _read_call(payload: Any) -> ToolCall | None:
    """{"name": str, "arguments": object} (Hermes; "parameters" as Llama 3 writes it) -> a call."""
    if not isinstance(payload, dict) or not isinstance(payload.get("name"), str) or not payload["name"]:
        return None
    arguments = payload.get("arguments", payload.get("parameters", {}))
    if isinstance(arguments, str):  # some models send the JSON string itself
        arguments = _arguments_value(arguments)
    if not isinstance(arguments, dict):
        return None
    return new_call(payload["name"], arguments)


def _loads(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return None


def parse_tool_calls(text: str) -> tuple[str | None, list[ToolCall]]:
    """(the content left outside the calls, the calls) of a Hermes-style answer.

    A block that is not a JSON call stays in the content as written; with no call at all the
    content is the text unchanged. Content that is only whitespace around calls is None, as
    OpenAI sends it."""
    calls: list[ToolCall] = []
    kept: list[str] = []
    end = 0
    for match in _BLOCK.finditer(text):
        call = _read_call(_loads(match.group(1).strip()))
        kept.append(text[end : match.start()] if call else text[end : match.end()])
        end = match.end()
        if call:
            calls.append(call)
    if not calls:
        return text, []
    content = ("".join(kept) + text[end:]).strip()
    return content or None, calls


def calls_from_json(text: str) -> list[ToolCall]:
    """The calls of an answer constrained by a `ToolGrammar`: one object, or an array of them.
    Empty where the answer is not complete JSON (it ran out of max_tokens)."""
    payload = _loads(text)
    items = payload if isinstance(payload, list) else [payload]
    calls = [_read_call(item) for item in items]
    return [c for c in calls if c is not None]


class ToolCallStream:
    """Streams an "auto" answer: content goes out as it comes, while anything from `<tool_call>`
    on is held until the end (a call is only known once its JSON closes) and read by `finish`."""

    def __init__(self) -> None:
        self._text = ""
        self._sent = 0  # characters of _text already given out as content
        self._in_call = False

    def feed(self, delta: str) -> str:
        """The content of `delta` that can be sent now ("" while a call may be starting)."""
        self._text += delta
        if self._in_call:
            return ""
        start = self._text.find(CALL_OPEN, self._sent)
        if start >= 0:
            self._in_call = True
            return self._give(start)
        return self._give(len(self._text) - _partial_open(self._text))

    def _give(self, upto: int) -> str:
        out, self._sent = self._text[self._sent : upto], max(self._sent, upto)
        return out

    def finish(self) -> tuple[str | None, list[ToolCall]]:
        """The content not yet sent (None if none) and the calls, once the answer is complete."""
        content, calls = parse_tool_calls(self._text[self._sent :])
        return (content or None), calls


def _partial_open(text: str) -> int:
    """The length of the longest end of `text` that could begin `<tool_call>`."""
    for n in range(min(len(CALL_OPEN) - 1, len(text)), 0, -1):
        if CALL_OPEN.startswith(text[-n:]):
            return n
    return 0
