"""The OpenAI request bodies `kubetune serve` accepts, and its error body.

Validation failures become 400s in OpenAI's error shape (see api.py), never 500s; the field
types are strict (fields.py). Every parameter of vLLM's OpenAI server that kubetune knows is
honoured or refused with a 400 naming it; unknown extra fields (e.g. `user`) are accepted and
ignored, as vLLM does, so that clients written for OpenAI work unchanged.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, Field, model_validator

from kubetune.serve.http.fields import STRICT, Finite, JsonObject, Text
from kubetune.serve.http.tools import ResponseFormat, Tool, ToolCall, ToolChoice

SEED_MAX = 2**64 - 1  # torch.Generator.manual_seed takes 64 bits
MAX_N = 16  # choices per request (each is one sequence of the running batch)
MAX_LOGPROBS = 20  # alternatives per token, as vLLM's default --max-logprobs
TokenIds = list[Annotated[int, Field(ge=0)]]
# apply_chat_template's own arguments: a template variable of these names would change what the
# call returns (token ids instead of text, a dict) or clash with the messages and tools it is given
RESERVED_TEMPLATE_KWARGS = frozenset(
    {
        "messages",
        "conversation",
        "tools",
        "documents",
        "chat_template",
        "add_generation_prompt",
        "continue_final_message",
        "tokenize",
        "padding",
        "truncation",
        "max_length",
        "return_tensors",
        "return_dict",
        "return_assistant_tokens_mask",
        "tokenizer_kwargs",
    }
)


class StreamOptions(BaseModel):
    model_config = STRICT

    include_usage: bool = False


class _Sampling(BaseModel):
    """What chat and completions requests share: vLLM's sampling parameters."""

    model_config = STRICT

    model: str = Field(min_length=1)
    n: int = Field(1, ge=1, le=MAX_N)
    best_of: int | None = Field(None, ge=1, le=MAX_N)
    temperature: Finite = Field(1.0, ge=0.0, le=2.0)
    top_p: Finite = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=-1, description="-1 or 0: off")
    min_p: Finite = Field(0.0, ge=0.0, le=1.0)
    stop: Text | list[Text] | None = None
    stop_token_ids: TokenIds | None = None
    seed: int | None = Field(None, ge=0, le=SEED_MAX)
    stream: bool = False
    stream_options: StreamOptions | None = None
    logit_bias: dict[str, Annotated[Finite, Field(ge=-100.0, le=100.0)]] | None = None
    presence_penalty: Finite = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: Finite = Field(0.0, ge=-2.0, le=2.0)
    repetition_penalty: Finite = Field(1.0, gt=0.0, le=2.0)
    min_tokens: int = Field(0, ge=0)
    ignore_eos: bool = False
    response_format: ResponseFormat | None = None
    # vLLM's: each log-probability's token is "token_id:<id>" instead of its text, and a sequence
    # that ended on EOS keeps EOS's entry, so a client reads back exactly the ids the engine
    # sampled (GRPO's rollout=server trains on them: text would not round-trip through the tokenizer)
    return_tokens_as_token_ids: bool = False

    def stops(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else [s for s in self.stop if s]

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @model_validator(mode="after")
    def _consistent(self) -> _Sampling:
        if self.best_of is not None and self.best_of != self.n:
            raise ValueError("best_of: only best_of = n is served (vLLM's V1 engine dropped best_of > n)")
        for key in self.logit_bias or {}:
            if not key.isdigit():
                raise ValueError(f"logit_bias: the key {key!r} is not a token id (a string of digits)")
        return self


class TextPart(BaseModel):
    model_config = STRICT

    type: Literal["text"]
    text: Text


class ChatMessage(BaseModel):
    model_config = STRICT

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Text | list[TextPart] | None = None
    name: Text | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant's earlier calls
    tool_call_id: Text | None = None  # a tool's result: the call it answers

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""

    @model_validator(mode="after")
    def _tool_fields(self) -> ChatMessage:
        if self.role == "tool" and not self.tool_call_id:
            raise ValueError("tool_call_id: a tool message names the call it answers")
        if self.tool_calls and self.role != "assistant":
            raise ValueError("tool_calls: only an assistant message carries tool calls")
        return self

    def for_template(self) -> dict[str, Any]:
        """The message as HF chat templates read it (a developer message is a system one)."""
        out: dict[str, Any] = {"role": "system" if self.role == "developer" else self.role, "content": self.text()}
        if self.name:
            out["name"] = self.name
        if self.tool_calls:
            out["tool_calls"] = [c.model_dump() for c in self.tool_calls]
        if self.tool_call_id:
            out["tool_call_id"] = self.tool_call_id
        return out


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool = True
    chat_template: Text | None = None
    chat_template_kwargs: JsonObject | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    @property
    def alternatives(self) -> int | None:
        """Top log-probabilities per token to report (None: no log-probabilities)."""
        return (self.top_logprobs or 0) if self.logprobs else None

    @model_validator(mode="after")
    def _logprobs(self) -> ChatCompletionRequest:
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs: set logprobs to true as well")
        self._continuable()
        reserved = sorted(RESERVED_TEMPLATE_KWARGS & set(self.chat_template_kwargs or {}))
        if reserved:
            raise ValueError(
                f"chat_template_kwargs: {reserved[0]!r} is set by the request itself (messages, tools, "
                "add_generation_prompt, ...), not by template variables; drop it"
            )
        return self

    def _continuable(self) -> None:
        """Continuing the last message: never with add_generation_prompt, as vLLM refuses it
        (its protocol.py; the flag is true unless sent as false, so vLLM refuses
        continue_final_message alone too, through transformers). And only an assistant message
        is continued: stricter than vLLM, which renders a user's text open-ended and lets the
        model write on as the user, never what a client meant."""
        if not self.continue_final_message:
            return
        if self.add_generation_prompt:
            raise ValueError(
                "continue_final_message: cannot set both `continue_final_message` and `add_generation_prompt` "
                "to true (add_generation_prompt is true unless sent); send add_generation_prompt: false"
            )
        last = self.messages[-1].role
        if last != "assistant":
            raise ValueError(
                f"continue_final_message: the last message is a {last!r} message; only an assistant message "
                "is continued (end messages with the assistant's start, or drop continue_final_message)"
            )


class CompletionRequest(_Sampling):
    prompt: Text | list[Text] | TokenIds | list[TokenIds]
    max_tokens: int | None = Field(16, ge=1)  # OpenAI's default for completions
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False
    suffix: Text | None = None

    def prompts(self) -> list[str | list[int]]:
        """One entry per prompt: its text, or its token ids."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if p and all(isinstance(x, int) for x in p):
            return [list(p)]  # type: ignore[arg-type]
        return list(p)  # type: ignore[arg-type]

    def requested_max_tokens(self) -> int | None:
        return self.max_tokens

    @property
    def alternatives(self) -> int | None:
        return self.logprobs

    @model_validator(mode="after")
    def _checks(self) -> CompletionRequest:
        if not self.prompt:
            raise ValueError("prompt: give at least one prompt")
        if self.suffix:
            raise ValueError("suffix: not served (fill-in-the-middle needs a model trained for it)")
        if self.echo and self.logprobs is not None:
            raise ValueError("echo: the prompt's own log-probabilities are not served; drop logprobs or echo")
        return self


class TokenizeRequest(BaseModel):
    """vLLM's POST /tokenize: a prompt, or chat messages rendered by the model's template."""

    model_config = STRICT

    model: str | None = None
    prompt: Text | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    return_token_strs: bool = False

    @model_validator(mode="after")
    def _one(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("prompt: give either prompt or messages")
        return self


class DetokenizeRequest(BaseModel):
    model_config = STRICT

    model: str | None = None
    tokens: TokenIds


ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    503: "service_unavailable",
}


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    """OpenAI's error shape: {"error": {"message", "type", "param", "code"}}."""
    return {
        "error": {
            "message": message,
            "type": ERROR_TYPES.get(status, "server_error"),
            "param": param,
            "code": code or str(status),
        }
    }
