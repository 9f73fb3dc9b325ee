"""Request bodies as msgspec structs: OpenAI chat / completions / responses, Anthropic messages, tokenize.

Unknown fields are refused (400 naming the field), as OpenAI's own API does; fields that are
accepted but have no effect here are listed in docs/api.md.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec
from leat.options import CHAT_MAX_TOKENS, COMPLETION_MAX_TOKENS
from msgspec import Meta, Struct

Temperature = Annotated[float, Meta(ge=0, le=2)]
Probability = Annotated[float, Meta(ge=0, le=1)]
Penalty = Annotated[float, Meta(ge=-2, le=2)]
Positive = Annotated[int, Meta(ge=1)]
TopLogprobs = Annotated[int, Meta(ge=0, le=20)]
# any integer of 64 bits, signed or not (decode's range check): -1 is llama.cpp's "a random seed"; other negative
# seeds are taken modulo 2**64 (as torch's generators, so vLLM's API, take them). Service.sampling maps both
Seed = int
Effort = Literal["none", "minimal", "low", "medium", "high", "xhigh"]
TokenBudget = Annotated[int, Meta(ge=0)]


class Body(Struct, forbid_unknown_fields=True, omit_defaults=True):
    pass


# --- OpenAI chat ---------------------------------------------------------------------------------------------


class TextPart(Body, tag="text"):
    text: str


class ImageURLPart(Body, tag="image_url"):
    image_url: dict[str, Any]


class AudioPart(Body, tag="input_audio"):
    input_audio: dict[str, Any]


class FilePart(Body, tag="file"):
    file: dict[str, Any]


class RefusalPart(Body, tag="refusal"):
    refusal: str


ContentPart = TextPart | ImageURLPart | AudioPart | FilePart | RefusalPart


class FunctionCall(Body):
    name: str
    arguments: str


class ToolCall(Body):
    id: str
    function: FunctionCall
    type: Literal["function"] = "function"


class ChatMessage(Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None
    refusal: str | None = None


class FunctionDef(Body):
    name: Annotated[str, Meta(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.:-]+$")]
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(Body):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(Body):
    name: str


class NamedToolChoice(Body):
    type: Literal["function"]
    function: NamedFunction


class StreamOptions(Body):
    include_usage: bool = False
    include_obfuscation: bool | None = None  # accepted, no effect: leat never pads stream chunks


class JSONSchemaFormat(Body):
    name: str = "response"
    schema: dict[str, Any] | None = None
    description: str | None = None
    strict: bool | None = None


class TextFormat(Body, tag="text"):
    pass


class JSONObjectFormat(Body, tag="json_object"):
    pass


class JSONSchemaResponseFormat(Body, tag="json_schema"):
    json_schema: JSONSchemaFormat


ResponseFormat = TextFormat | JSONObjectFormat | JSONSchemaResponseFormat


class Sampling(Body):
    """Sampling fields common to chat and completions: OpenAI's names and vLLM's ``repetition_penalty`` here, the
    fields every loaded sampler stage declares (top_k, min_p, ...) added by :func:`with_sampling_fields`."""

    temperature: Temperature | None = None
    top_p: Probability | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    repetition_penalty: Annotated[float, Meta(gt=0)] | None = None
    seed: Seed | None = None
    logit_bias: dict[str, Annotated[float, Meta(ge=-100, le=100)]] | None = None
    stop: str | list[str] | None = None
    n: Positive = 1
    ignore_eos: bool = False
    # vLLM's token-level controls (openai_api.token_controls)
    min_tokens: Annotated[int, Meta(ge=0)] = 0
    stop_token_ids: list[int] | None = None
    allowed_token_ids: list[int] | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    session: str | None = None  # an engine session: its KV is kept and the next request extends it
    user: str | None = None
    metadata: dict[str, str] | None = None
    store: bool | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None


class StructuredOutputs(Body):
    """vLLM's ``structured_outputs``: the output is JSON of a schema, plain text a regular expression matches whole,
    or one of a list of strings."""

    json: dict[str, Any] | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None  # GBNF, as llama-server's grammar


class Guided(Sampling):
    """Chat's and completions' fields beyond sampling: vLLM's guided decoding (its earlier names for
    ``structured_outputs``' parts) and llama-server's ``grammar`` (GBNF)."""

    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    grammar: str | None = None  # llama-server's name: GBNF
    structured_outputs: StructuredOutputs | None = None


class ChatReasoning(Body):
    """``reasoning`` (OpenRouter's and vLLM's shape): thinking on or off, its effort, and a cap on its tokens."""

    effort: Effort | None = None
    max_tokens: TokenBudget | None = None
    enabled: bool | None = None


class ChatCompletionRequest(Guided):
    messages: Annotated[list[ChatMessage], Meta(min_length=1)] = msgspec.field(default_factory=list)
    model: str = ""
    max_tokens: Positive | None = CHAT_MAX_TOKENS
    max_completion_tokens: Positive | None = CHAT_MAX_TOKENS
    stream: bool = False
    stream_options: StreamOptions | None = None
    logprobs: bool = False
    top_logprobs: TopLogprobs | None = None
    tools: list[Tool] | None = None
    tool_choice: str | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    response_format: ResponseFormat | None = None
    reasoning_effort: Effort | None = None
    reasoning: ChatReasoning | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    continue_final_message: bool = False  # vLLM's: the last (assistant) message is continued
    add_generation_prompt: bool | None = None  # vLLM's: open the assistant's turn (None: unless the last is its)
    modalities: list[str] | None = None
    audio: dict[str, Any] | None = None
    prediction: dict[str, Any] | None = None
    web_search_options: dict[str, Any] | None = None
    verbosity: str | None = None
    functions: list[dict[str, Any]] | None = None
    function_call: str | dict[str, Any] | None = None


class CompletionRequest(Guided):
    prompt: str | list[str | int | list[int]] = ""  # text, token ids, or a batch of one (msgspec allows one list type)
    model: str = ""
    max_tokens: Annotated[int, Meta(ge=0)] | None = COMPLETION_MAX_TOKENS
    stream: bool = False
    stream_options: StreamOptions | None = None
    logprobs: Annotated[int, Meta(ge=0, le=20)] | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: Positive | None = None
    response_format: ResponseFormat | None = None


class TokenizeRequest(Body):
    content: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special: bool | None = None
    add_special_tokens: bool | None = None
    parse_special: bool = True
    with_pieces: bool = False
    model: str = ""


class DetokenizeRequest(Body):
    tokens: list[int]
    model: str = ""


class EmbeddingRequest(Body):
    input: str | list[str | int | list[int]]  # a text, token ids, or a list of either (msgspec allows one list type)
    model: str = ""
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Positive | None = None
    user: str | None = None


class RerankRequest(Body):
    """``POST /v1/rerank`` (llama-server's, and Jina's and Cohere's): ``documents`` ranked by relevance to ``query``."""

    query: str
    documents: list[str]
    model: str = ""
    top_n: Annotated[int, Meta(ge=0)] | None = None
    return_documents: bool = False


class ModelRequest(Body):
    """``POST /models/load`` and ``POST /models/unload``: the model, by name or alias."""

    model: str


class SessionRequest(Body):
    """``POST /v1/sessions`` (a new empty session) and ``POST /v1/sessions/{name}/fork`` (the fork's name)."""

    id: str


# --- Anthropic messages --------------------------------------------------------------------------------------


class AText(Body, tag="text"):
    text: str
    cache_control: dict[str, Any] | None = None
    citations: list[Any] | None = None


class AImage(Body, tag="image"):
    source: dict[str, Any]
    cache_control: dict[str, Any] | None = None


class ADocument(Body, tag="document"):
    source: dict[str, Any]
    cache_control: dict[str, Any] | None = None
    title: str | None = None
    context: str | None = None
    citations: dict[str, Any] | None = None


class AToolUse(Body, tag="tool_use"):
    id: str
    name: str
    input: dict[str, Any]
    cache_control: dict[str, Any] | None = None


class AToolResult(Body, tag="tool_result"):
    tool_use_id: str
    content: str | list[AText | AImage] | None = None
    is_error: bool = False
    cache_control: dict[str, Any] | None = None


class AThinking(Body, tag="thinking"):
    thinking: str
    signature: str | None = None


class ARedactedThinking(Body, tag="redacted_thinking"):
    data: str


ABlock = AText | AImage | ADocument | AToolUse | AToolResult | AThinking | ARedactedThinking


class AMessage(Body):
    role: Literal["user", "assistant", "system"]
    content: str | list[ABlock]


class ATool(Body):
    name: Annotated[str, Meta(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9_.:-]+$")]
    input_schema: dict[str, Any]
    description: str | None = None
    type: str | None = None
    cache_control: dict[str, Any] | None = None


class AToolChoice(Body):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class AThinkingConfig(Body):
    type: Literal["enabled", "disabled", "adaptive", "between_tools"]
    budget_tokens: TokenBudget | None = None
    display: str | None = None


class AJSONFormat(Body):
    type: Literal["json_schema"]
    schema: dict[str, Any]


class AOutputConfig(Body):
    effort: str | None = None
    format: AJSONFormat | None = None


class MessagesRequest(Body):
    model: str
    max_tokens: Positive
    messages: Annotated[list[AMessage], Meta(min_length=1)]
    system: str | list[AText] | None = None
    stop_sequences: list[str] | None = None
    stream: bool = False
    temperature: Annotated[float, Meta(ge=0, le=1)] | None = None
    top_p: Probability | None = None
    top_k: int | None = None
    tools: list[ATool] | None = None
    tool_choice: AToolChoice | None = None
    thinking: AThinkingConfig | None = None
    session: str | None = None  # a leat extension, as on chat completions
    output_config: AOutputConfig | None = None
    metadata: dict[str, Any] | None = None
    service_tier: str | None = None
    cache_control: dict[str, Any] | None = None
    container: Any = None
    diagnostics: dict[str, Any] | None = None
    inference_geo: str | None = None
    speed: str | None = None
    user_profile_id: str | None = None
    workspace_id: str | None = None


# --- OpenAI responses ----------------------------------------------------------------------------------------


class RInputText(Body, tag="input_text"):
    text: str


class ROutputText(Body, tag="output_text"):
    text: str
    annotations: list[Any] | None = None
    logprobs: list[Any] | None = None


class RInputImage(Body, tag="input_image"):
    image_url: str | None = None
    file_id: str | None = None
    detail: str | None = None


class RInputFile(Body, tag="input_file"):
    file_id: str | None = None
    file_data: str | None = None
    filename: str | None = None
    file_url: str | None = None


class RRefusal(Body, tag="refusal"):
    refusal: str


RContent = RInputText | ROutputText | RInputImage | RInputFile | RRefusal


class RMessage(Body, tag="message"):
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[RContent]
    id: str | None = None
    status: str | None = None


class RFunctionCall(Body, tag="function_call"):
    call_id: str
    name: str
    arguments: str
    id: str | None = None
    status: str | None = None


class RFunctionCallOutput(Body, tag="function_call_output"):
    call_id: str
    output: str | list[RContent]
    id: str | None = None
    status: str | None = None


class RReasoning(Body, tag="reasoning"):
    summary: list[dict[str, Any]] = msgspec.field(default_factory=list)
    id: str | None = None
    content: list[dict[str, Any]] | None = None
    encrypted_content: str | None = None
    status: str | None = None


RItem = RMessage | RFunctionCall | RFunctionCallOutput | RReasoning


class RFunctionTool(Body, tag="function"):
    name: Annotated[str, Meta(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.:-]+$")]
    parameters: dict[str, Any] | None = None
    description: str | None = None
    strict: bool | None = None


class RNamedChoice(Body):
    type: Literal["function"]
    name: str


class RTextFormatText(Body, tag="text"):
    pass


class RTextFormatJSONObject(Body, tag="json_object"):
    pass


class RTextFormatJSONSchema(Body, tag="json_schema"):
    schema: dict[str, Any]
    name: str = "response"
    description: str | None = None
    strict: bool | None = None


class RText(Body):
    format: RTextFormatText | RTextFormatJSONObject | RTextFormatJSONSchema | None = None
    verbosity: str | None = None


class RReasoningConfig(Body):
    effort: Effort | None = None
    summary: str | None = None
    generate_summary: str | None = None


class ResponsesRequest(Body):
    input: str | list[dict[str, Any]]
    model: str = ""
    instructions: str | None = None
    max_output_tokens: Positive | None = None
    temperature: Temperature | None = None
    top_p: Probability | None = None
    stream: bool = False
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | RNamedChoice | None = None
    parallel_tool_calls: bool | None = None
    text: RText | None = None
    reasoning: RReasoningConfig | None = None
    previous_response_id: str | None = None
    store: bool | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    truncation: str | None = None
    include: list[str] | None = None
    background: bool | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    top_logprobs: TopLogprobs | None = None
    stream_options: dict[str, Any] | None = None
    seed: Seed | None = None


def with_sampling_fields(struct: type[Body], fields: dict[str, msgspec.structs.FieldInfo]) -> type[Body]:
    """``struct`` with every sampling field it lacks (``leat.sampling.fields``: what the loaded stages declare), each
    optional (left out: the model's recommendation, else the stage's default), with its constraints and description."""
    have = set(struct.__struct_fields__)
    extra = [(name, f.type | None, None) for name, f in fields.items() if name not in have]
    return msgspec.defstruct(struct.__name__, extra, bases=(struct,), kw_only=True, module=struct.__module__)
