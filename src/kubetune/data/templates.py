"""Prompt templates: a row -> (prompt text, response text).

`chat` uses the tokenizer's own chat template (so SmolLM2 gets ChatML, Llama-3 its header
tokens, ...); `alpaca` and `llama2` are the classic formats; any other string is a custom
template naming `{instruction}`, `{input}` or both (`custom_fields` says what each receives).
`auto` (the default) is `chat` for a tokenizer with a chat template and `alpaca` for one
without (a base model's): `PromptRenderer` decides it once, from the tokenizer it is given.
The response never carries an EOS: tokenization appends the tokenizer's EOS exactly once.

A preference row is rendered as the two SFT rows it stands for (`pair_sequences`): the same
prompt, answered once with the chosen and once with the rejected answer.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, cast

from kubetune.recipe.chat_template import auto_template
from kubetune.recipe.schema import template_fields

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

# One dataset row, as `sources.load_rows` / `sources.map_columns` produce it (plain JSON values).
Row = dict[str, Any]
Message = dict[str, Any]  # {"role": ..., "content": ...}
ANSWERS = ("chosen", "rejected")  # a preference row's two answers, in the order its samples take

ALPACA = (
    "Below is an instruction that describes a task{ctx}. Write a response that appropriately "
    "completes the request.\n\n### Instruction:\n{instruction}\n\n{input_block}### Response:\n"
)
LLAMA2_SYS = "<<SYS>>\n{system}\n<</SYS>>\n\n"


def user_text(row: Row) -> str:
    """Instruction and input joined the way the chat template expects a user turn."""
    instruction: str = row.get("instruction", "")
    inp: str = row.get("input", "")
    return f"{instruction}\n\n{inp}" if inp and instruction else (instruction or inp)


def pair_sequences(row: Row) -> tuple[Row, Row]:
    """A preference row (`{instruction, input, chosen, rejected}` or `{messages, chosen, rejected}`,
    the messages being the prompt turns) -> its SFT rows: the prompt with each answer."""
    if "messages" in row:
        chosen, rejected = ({"messages": [*row["messages"], {"role": "assistant", "content": row[a]}]} for a in ANSWERS)
    else:
        chosen, rejected = (
            {"instruction": row["instruction"], "input": row["input"], "output": row[a]} for a in ANSWERS
        )
    return chosen, rejected


def custom_fields(template: str, row: Row) -> dict[str, str]:
    """What a custom template's placeholders receive, so that no text of the row is lost.

    With both placeholders each gets its column. A template naming only `{input}` brings its
    own instruction (the medical flashcards template of Intel's Xeon guide,
    `...问题:{input}\n回答:`), so `{input}` is the row's input, or its instruction where the row
    has none (instruction-only data, and `kubetune generate`, which passes the prompt as the
    instruction). A template naming only `{instruction}` has
    no place for the input, so the input follows the instruction as in a chat user turn.
    """
    instruction: str = row.get("instruction", "")
    inp: str = row.get("input", "")
    fields = template_fields(template)
    if fields == {"input"}:
        return {"input": inp or instruction}
    if fields == {"instruction"}:
        return {"instruction": user_text(row)}
    return {"instruction": instruction, "input": inp}


def resolve_template(template: str, tokenizer: PreTrainedTokenizerBase) -> str:
    """data.template as it renders with this tokenizer: `auto` decided, any other as it is."""
    if template != "auto":
        return template
    return auto_template(bool(getattr(tokenizer, "chat_template", None)))


@dataclass
class PromptRenderer:
    template: str  # data.template as given; `auto` is replaced by what it is for this tokenizer
    tokenizer: PreTrainedTokenizerBase
    system_prompt: str | None = None
    asked: str = field(init=False)  # data.template as given

    def __post_init__(self) -> None:
        self.asked, self.template = self.template, resolve_template(self.template, self.tokenizer)

    @property
    def uses_chat_template(self) -> bool:
        return self.template == "chat"

    def describe(self) -> str:
        """The prompt template in one line (the run's log), with why where `auto` chose it."""
        if self.asked != "auto":
            shown = self.template if self.template in ("chat", "alpaca", "llama2") else "custom"
            return f"prompt template: {shown} (data.template)"
        why = "the tokenizer's chat template" if self.uses_chat_template else "the tokenizer has no chat template"
        return f"prompt template: {self.template} (data.template=auto: {why})"

    def render(self, row: Row) -> tuple[str, str]:
        """Return (prompt, response) for a training row."""
        if "messages" in row:
            msgs: list[Message] = row["messages"]
            if msgs[-1]["role"] != "assistant":
                raise ValueError("the last message must be the assistant's answer")
            answer: str = msgs[-1]["content"]
            return self._chat_prompt(msgs[:-1]), answer
        output: str = row["output"]
        return self.prompt(row), output

    def prompt(self, row: Row) -> str:
        """The prompt alone (generation and eval questions)."""
        if "messages" in row:
            msgs = row["messages"]
            history = msgs[:-1] if msgs[-1]["role"] == "assistant" else msgs
            return self._chat_prompt(history)
        if self.template == "chat":
            return self._chat_prompt([{"role": "user", "content": user_text(row)}])
        if self.template == "alpaca":
            # an input-only row (no instruction column) is the instruction, not an empty one
            instruction, inp = row.get("instruction", ""), row.get("input", "")
            instruction, inp = (instruction, inp) if instruction else (inp, "")
            return ALPACA.format(
                ctx=", paired with an input that provides further context" if inp else "",
                instruction=instruction,
                input_block=f"### Input:\n{inp}\n\n" if inp else "",
            )
        if self.template == "llama2":
            sys_block = LLAMA2_SYS.format(system=self.system_prompt) if self.system_prompt else ""
            return f"[INST] {sys_block}{user_text(row)} [/INST] "
        return self.template.format(**custom_fields(self.template, row))

    def _chat_prompt(self, messages: list[Message]) -> str:
        return self.chat_prompt(messages)

    def chat_prompt(
        self,
        messages: list[Message],
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        **template_kwargs: Any,
    ) -> str:
        """A conversation through the chat template (the tokenizer's, or `chat_template`),
        with the run's system prompt where the conversation has none."""
        if self.system_prompt and (not messages or messages[0]["role"] != "system"):
            messages = [{"role": "system", "content": self.system_prompt}] + messages
        if not (chat_template or getattr(self.tokenizer, "chat_template", None)):
            raise ValueError(
                "the tokenizer has no chat template; set data.template=alpaca (or llama2, or a custom string)"
            )
        # with tokenize=False the result is the rendered text (the declared return type is the union
        # of every mode's result)
        return cast(
            str,
            self.tokenizer.apply_chat_template(
                messages,
                tokenize=False,
                chat_template=chat_template,
                add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message,
                **template_kwargs,
            ),
        )
