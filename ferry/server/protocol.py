"""Request bodies of the OpenAI API (and vLLM's extra fields), as pydantic models.

Types are strict where a client's mistake would otherwise be taken silently: a boolean is never
a number (``max_tokens: true`` is not 1), floats must be finite (no Infinity, no 1e309), and no
string may hold a lone UTF-16 surrogate (the tokenizer cannot encode one).
"""
from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr, model_validator

from ferry.core.sampling_params import SamplingParams, StructuredOutputs

Number = Annotated[float, Field(strict=True, allow_inf_nan=False)]
TokenIds = list[StrictInt]


class UnsupportedField(ValueError):
    """A field ferry understands but does not implement: refused rather than silently ignored."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


def _find_surrogate(value: Any, path: str) -> str | None:
    """The path of the first string under ``value`` holding a lone surrogate, if any."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return path
    elif isinstance(value, dict):
        for k, v in value.items():
            found = _find_surrogate(k, path) or _find_surrogate(v, f"{path}.{k}" if path else str(k))
            if found:
                return found
    elif isinstance(value, list):
        for i, v in enumerate(value):
            found = _find_surrogate(v, f"{path}[{i}]")
            if found:
                return found
    return None


class StreamOptions(BaseModel):
    include_usage: StrictBool = False


class JsonSchemaFormat(BaseModel):
    name: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None
    description: str | None = None


class ResponseFormat(BaseModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsField(BaseModel):
    """vLLM's ``structured_outputs`` field: exactly one of these."""

    model_config = ConfigDict(extra="forbid")

    json_: dict[str, Any] | str | None = Field(None, alias="json")
    regex: StrictStr | None = None
    choice: list[StrictStr] | None = None
    grammar: StrictStr | None = None
    json_object: StrictBool | None = None
    structural_tag: StrictStr | None = None


class TextRequest(BaseModel):
    """A request body whose strings must be valid text: a lone UTF-16 surrogate (JSON allows the
    escape; no tokenizer can encode it) is a 400 naming the field that holds it."""

    @model_validator(mode="before")
    @classmethod
    def _no_lone_surrogates(cls, data: Any) -> Any:
        where = _find_surrogate(data, "")
        if where is not None:
            raise ValueError(f"{where or 'body'} holds a lone UTF-16 surrogate, which is not valid text")
        return data


class _Sampling(TextRequest):
    """Fields shared by completions and chat; unknown fields are ignored, as OpenAI servers do."""

    model_config = ConfigDict(extra="ignore", populate_by_name=True)

    model: str | None = None
    max_tokens: StrictInt | None = None
    temperature: Number | None = None
    top_p: Number | None = None
    n: StrictInt = 1
    best_of: StrictInt | None = None
    stop: StrictStr | list[StrictStr] | None = None
    seed: StrictInt | None = None
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    presence_penalty: Number = 0.0
    frequency_penalty: Number = 0.0
    logit_bias: dict[str, Number] | None = None
    user: str | None = None
    response_format: ResponseFormat | None = None
    # vLLM's extras
    top_k: StrictInt | None = None
    min_p: Number | None = None
    repetition_penalty: Number | None = None
    min_tokens: StrictInt = 0
    ignore_eos: StrictBool = False
    priority: StrictInt = 0
    stop_token_ids: TokenIds | None = None
    include_stop_str_in_output: StrictBool = False
    skip_special_tokens: StrictBool = True
    prompt_logprobs: StrictInt | None = None
    structured_outputs: StructuredOutputsField | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: StrictStr | None = None
    guided_choice: list[StrictStr] | None = None
    guided_grammar: StrictStr | None = None

    def check_supported(self) -> None:
        """Raise UnsupportedField for fields that would change the output in ways ferry cannot honour."""
        if self.best_of is not None and self.best_of != self.n:
            raise UnsupportedField("best_of", f"best_of ({self.best_of}) other than n ({self.n}) is not supported")

    def logit_bias_ids(self) -> dict[int, float] | None:
        if not self.logit_bias:
            return None
        try:
            return {int(k): float(v) for k, v in self.logit_bias.items()}
        except ValueError:
            raise UnsupportedField("logit_bias", "logit_bias keys must be token ids (integers as strings)") from None

    def structured(self) -> StructuredOutputs | None:
        """The one output constraint asked for, from whichever of OpenAI's and vLLM's fields carries it."""
        asked: list[tuple[str, StructuredOutputs]] = []
        rf = self.response_format
        if rf is not None and rf.type == "json_object":
            asked.append(("response_format", StructuredOutputs(json_object=True)))
        elif rf is not None and rf.type == "json_schema":
            if rf.json_schema is None or rf.json_schema.schema_ is None:
                raise UnsupportedField("response_format", "response_format of type json_schema needs "
                                                          "json_schema.schema")
            asked.append(("response_format", StructuredOutputs(json=rf.json_schema.schema_)))
        if self.guided_json is not None:
            asked.append(("guided_json", StructuredOutputs(json=self.guided_json)))
        if self.guided_regex is not None:
            asked.append(("guided_regex", StructuredOutputs(regex=self.guided_regex)))
        if self.guided_choice is not None:
            asked.append(("guided_choice", StructuredOutputs(choice=self.guided_choice)))
        if self.guided_grammar is not None:
            asked.append(("guided_grammar", StructuredOutputs(grammar=self.guided_grammar)))
        so = self.structured_outputs
        if so is not None:
            asked.append(("structured_outputs", StructuredOutputs(
                json=so.json_, regex=so.regex, choice=so.choice, grammar=so.grammar,
                json_object=bool(so.json_object), structural_tag=so.structural_tag)))
        if len(asked) > 1:
            raise UnsupportedField(asked[1][0], "give one output constraint, not several: "
                                   + ", ".join(name for name, _ in asked))
        return asked[0][1] if asked else None

    def sampling_params(self, max_tokens: int | None, logprobs: int | None,
                        prompt_logprobs: int | None) -> SamplingParams:
        """Raises ValueError naming the field when a value is out of range."""
        return SamplingParams(
            n=1, temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p, top_k=self.top_k or 0,
            min_p=self.min_p or 0.0, seed=self.seed, presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
            max_tokens=max_tokens, min_tokens=self.min_tokens,
            stop=[self.stop] if isinstance(self.stop, str) else list(self.stop or []),
            stop_token_ids=list(self.stop_token_ids or []), ignore_eos=self.ignore_eos, logprobs=logprobs,
            prompt_logprobs=prompt_logprobs, logit_bias=self.logit_bias_ids(),
            include_stop_str_in_output=self.include_stop_str_in_output,
            skip_special_tokens=self.skip_special_tokens, structured_outputs=self.structured())


class CompletionRequest(_Sampling):
    prompt: StrictStr | list[StrictStr] | TokenIds | list[TokenIds]
    echo: StrictBool = False
    logprobs: StrictInt | None = None
    max_tokens: StrictInt | None = 16  # OpenAI's default for completions
    suffix: str | None = None

    def check_supported(self) -> None:
        super().check_supported()
        if self.suffix:
            raise UnsupportedField("suffix", "suffix (insertion) is not supported")


class CalledFunction(BaseModel):
    """An earlier call's function: its name, and its arguments (OpenAI's JSON text, or the object)."""

    model_config = ConfigDict(extra="allow")  # what else a client sends reaches the template as before

    name: StrictStr
    arguments: StrictStr | dict[str, Any] | None = None


class MessageToolCall(BaseModel):
    """One of an assistant's earlier tool calls, sent back in its message."""

    model_config = ConfigDict(extra="allow")

    id: StrictStr | None = None
    type: StrictStr | None = None
    function: CalledFunction


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: StrictStr | list[dict[str, Any]] | None = None
    name: StrictStr | None = None
    tool_calls: list[MessageToolCall] | None = None  # an assistant's earlier calls, sent back
    tool_call_id: StrictStr | None = None  # a tool result's call
    reasoning_content: StrictStr | None = None
    reasoning: StrictStr | None = None


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: StrictBool = False
    top_logprobs: StrictInt | None = None
    max_completion_tokens: StrictInt | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: StrictBool | None = None
    functions: list[dict[str, Any]] | None = None
    function_call: str | dict[str, Any] | None = None
    chat_template_kwargs: dict[str, Any] | None = None  # vLLM's: passed to the chat template
    chat_template: StrictStr | None = None  # vLLM's: this request's own template (--trust-request-chat-template)
    include_reasoning: StrictBool = True  # vLLM's: False drops the reasoning from the reply
    # OpenAI's: how much the model reasons ("low", "medium", "high"), passed to the chat template
    # (gpt-oss's writes it into its system message).
    reasoning_effort: StrictStr | None = None

    def check_supported(self) -> None:
        super().check_supported()
        if self.functions or self.function_call not in (None, "none"):
            raise UnsupportedField("functions", "the deprecated functions field is not supported; send tools")
