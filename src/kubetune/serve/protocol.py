"""The OpenAI request bodies `kubetune serve` accepts, and its error body.

Validation failures become 400s in OpenAI's error shape (see api.py), never 500s. Types are
strict, as JSON states them: `true` is not a number, `"yes"` is not a boolean, `1.5` is
not a count. Text must be valid Unicode without NUL characters (a lone surrogate such as
`\ud800` cannot be encoded, so no tokenizer can read it), and every number must be finite
and in range before the engine sees it. Unknown extra fields (e.g. `user`) are accepted
and ignored, as vLLM does, so that clients written for OpenAI work unchanged.
"""

from __future__ import annotations

import math
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field

SEED_MAX = 2**64 - 1  # torch.Generator.manual_seed takes 64 bits


def _text(value: str) -> str:
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError("is not valid Unicode (a lone surrogate such as \\ud800?)") from None
    if "\x00" in value:
        raise ValueError("holds a NUL character (\\u0000), which is not text")
    return value


def _finite(value: float) -> float:
    if not math.isfinite(value):
        raise ValueError("must be a finite number")
    return value


Text = Annotated[str, AfterValidator(_text)]
Finite = Annotated[float, AfterValidator(_finite)]
STRICT = ConfigDict(extra="allow", strict=True)


class StreamOptions(BaseModel):
    model_config = STRICT

    include_usage: bool = False


class _Sampling(BaseModel):
    model_config = STRICT

    model: str = Field(min_length=1)
    temperature: Finite = Field(1.0, ge=0.0, le=2.0)
    top_p: Finite = Field(1.0, gt=0.0, le=1.0)
    n: int = Field(1, ge=1, le=1, description="one choice per request")
    stop: Text | list[Text] | None = None
    seed: int | None = Field(None, ge=0, le=SEED_MAX)
    stream: bool = False
    stream_options: StreamOptions | None = None

    def stops(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else [s for s in self.stop if s]

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class TextPart(BaseModel):
    model_config = STRICT

    type: Literal["text"]
    text: Text


class ChatMessage(BaseModel):
    model_config = STRICT

    role: Literal["system", "developer", "user", "assistant"]
    content: Text | list[TextPart] | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


class CompletionRequest(_Sampling):
    prompt: Text | list[Text]
    max_tokens: int | None = Field(16, ge=1)  # OpenAI's default for completions

    def prompt_text(self) -> str | None:
        """The one prompt (a list of exactly one is accepted), None when several are given."""
        if isinstance(self.prompt, str):
            return self.prompt
        return self.prompt[0] if len(self.prompt) == 1 else None

    def requested_max_tokens(self) -> int | None:
        return self.max_tokens


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
