"""Chat templates: real models' templates render exactly what transformers renders, inside the sandbox."""

from __future__ import annotations

import json
import sys
import time
from datetime import datetime

import pytest
from leat.chat import ChatTemplate, render_chat
from leat.errors import TemplateError

# HuggingFaceTB/SmolLM2-135M-Instruct, as stored in its GGUF (tokenizer.chat_template).
SMOLLM2 = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}"
    "{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# meta-llama/Llama-3.1-8B-Instruct (tokenizer_config.json).
LLAMA31 = r"""{{- bos_token }}
{%- if custom_tools is defined %}
    {%- set tools = custom_tools %}
{%- endif %}
{%- if not tools_in_user_message is defined %}
    {%- set tools_in_user_message = true %}
{%- endif %}
{%- if not date_string is defined %}
    {%- set date_string = "26 Jul 2024" %}
{%- endif %}
{%- if not tools is defined %}
    {%- set tools = none %}
{%- endif %}

{#- This block extracts the system message, so we can slot it into the right place. #}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content']|trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
{%- endif %}

{#- System message + builtin tools #}
{{- "<|start_header_id|>system<|end_header_id|>\n\n" }}
{%- if builtin_tools is defined or tools is not none %}
    {{- "Environment: ipython\n" }}
{%- endif %}
{%- if builtin_tools is defined %}
    {{- "Tools: " + builtin_tools | reject('equalto', 'code_interpreter') | join(", ") + "\n\n"}}
{%- endif %}
{{- "Cutting Knowledge Date: December 2023\n" }}
{{- "Today Date: " + date_string + "\n\n" }}
{%- if tools is not none and not tools_in_user_message %}
    {{- "You have access to the following functions. To call a function, please respond with JSON for a function call." }}
    {{- 'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.' }}
    {{- "Do not use variables.\n\n" }}
    {%- for t in tools %}
        {{- t | tojson(indent=4) }}
        {{- "\n\n" }}
    {%- endfor %}
{%- endif %}
{{- system_message }}
{{- "<|eot_id|>" }}

{#- Custom tools are passed in a user message with some extra guidance #}
{%- if tools_in_user_message and not tools is none %}
    {#- Extract the first user message so we can plug it in here #}
    {%- if messages | length != 0 %}
        {%- set first_user_message = messages[0]['content']|trim %}
        {%- set messages = messages[1:] %}
    {%- else %}
        {{- raise_exception("Cannot put tools in the first user message when there's no first user message!") }}
{%- endif %}
    {{- '<|start_header_id|>user<|end_header_id|>\n\n' -}}
    {{- "Given the following functions, please respond with a JSON for a function call " }}
    {{- "with its proper arguments that best answers the given prompt.\n\n" }}
    {{- 'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.' }}
    {{- "Do not use variables.\n\n" }}
    {%- for t in tools %}
        {{- t | tojson(indent=4) }}
        {{- "\n\n" }}
    {%- endfor %}
    {{- first_user_message + "<|eot_id|>"}}
{%- endif %}

{%- for message in messages %}
    {%- if not (message.role == 'ipython' or message.role == 'tool' or 'tool_calls' in message) %}
        {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + '<|eot_id|>' }}
    {%- elif 'tool_calls' in message %}
        {%- if not message.tool_calls|length == 1 %}
            {{- raise_exception("This model only supports single tool-calls at once!") }}
        {%- endif %}
        {%- set tool_call = message.tool_calls[0].function %}
        {%- if builtin_tools is defined and tool_call.name in builtin_tools %}
            {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' -}}
            {{- "<|python_tag|>" + tool_call.name + ".call(" }}
            {%- for arg_name, arg_val in tool_call.arguments | items %}
                {{- arg_name + '="' + arg_val + '"' }}
                {%- if not loop.last %}
                    {{- ", " }}
                {%- endif %}
                {%- endfor %}
            {{- ")" }}
        {%- else  %}
            {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' -}}
            {{- '{"name": "' + tool_call.name + '", ' }}
            {{- '"parameters": ' }}
            {{- tool_call.arguments | tojson }}
            {{- "}" }}
        {%- endif %}
        {%- if builtin_tools is defined %}
            {#- This means we're in ipython mode #}
            {{- "<|eom_id|>" }}
        {%- else %}
            {{- "<|eot_id|>" }}
        {%- endif %}
    {%- elif message.role == "tool" or message.role == "ipython" %}
        {{- "<|start_header_id|>ipython<|end_header_id|>\n\n" }}
        {%- if message.content is mapping or message.content is iterable %}
            {{- message.content | tojson }}
        {%- else %}
            {{- message.content }}
        {%- endif %}
        {{- "<|eot_id|>" }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}
{%- endif %}
"""

# google/gemma-3-4b-it (tokenizer_config.json); its string literals hold real newlines.
GEMMA3 = r"""{{ bos_token }}
{%- if messages[0]['role'] == 'system' -%}
    {%- if messages[0]['content'] is string -%}
        {%- set first_user_prefix = messages[0]['content'] + '

' -%}
    {%- else -%}
        {%- set first_user_prefix = messages[0]['content'][0]['text'] + '

' -%}
    {%- endif -%}
    {%- set loop_messages = messages[1:] -%}
{%- else -%}
    {%- set first_user_prefix = "" -%}
    {%- set loop_messages = messages -%}
{%- endif -%}
{%- for message in loop_messages -%}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}
        {{ raise_exception("Conversation roles must alternate user/assistant/user/assistant/...") }}
    {%- endif -%}
    {%- if (message['role'] == 'assistant') -%}
        {%- set role = "model" -%}
    {%- else -%}
        {%- set role = message['role'] -%}
    {%- endif -%}
    {{ '<start_of_turn>' + role + '
' + (first_user_prefix if loop.first else "") }}
    {%- if message['content'] is string -%}
        {{ message['content'] | trim }}
    {%- elif message['content'] is iterable -%}
        {%- for item in message['content'] -%}
            {%- if item['type'] == 'image' -%}
                {{ '<start_of_image>' }}
            {%- elif item['type'] == 'text' -%}
                {{ item['text'] | trim }}
            {%- endif -%}
        {%- endfor -%}
    {%- else -%}
        {{ raise_exception("Invalid content type") }}
    {%- endif -%}
    {{ '<end_of_turn>
' }}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{'<start_of_turn>model
'}}
{%- endif -%}
"""

# Qwen/Qwen3-0.6B (tokenizer_config.json).
QWEN3 = r"""{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0].role == 'system' %}
        {{- messages[0].content + '\n\n' }}
    {%- endif %}
    {{- "# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>" }}
    {%- for tool in tools %}
        {{- "\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n" }}
{%- else %}
    {%- if messages[0].role == 'system' %}
        {{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}
    {%- endif %}
{%- endif %}
{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if ns.multi_step_tool and message.role == "user" and not(message.content.startswith('<tool_response>') and message.content.endswith('</tool_response>')) %}
        {%- set ns.multi_step_tool = false %}
        {%- set ns.last_query_index = index %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>' + '\n' }}
    {%- elif message.role == "assistant" %}
        {%- set content = message.content %}
        {%- set reasoning_content = '' %}
        {%- if message.reasoning_content is defined and message.reasoning_content is not none %}
            {%- set reasoning_content = message.reasoning_content %}
        {%- else %}
            {%- if '</think>' in message.content %}
                {%- set content = message.content.split('</think>')[-1].lstrip('\n') %}
                {%- set reasoning_content = message.content.split('</think>')[0].rstrip('\n').split('<think>')[-1].lstrip('\n') %}
            {%- endif %}
        {%- endif %}
        {%- if loop.index0 > ns.last_query_index %}
            {%- if loop.last or (not loop.last and reasoning_content) %}
                {{- '<|im_start|>' + message.role + '\n<think>\n' + reasoning_content.strip('\n') + '\n</think>\n\n' + content.lstrip('\n') }}
            {%- else %}
                {{- '<|im_start|>' + message.role + '\n' + content }}
            {%- endif %}
        {%- else %}
            {{- '<|im_start|>' + message.role + '\n' + content }}
        {%- endif %}
        {%- if message.tool_calls %}
            {%- for tool_call in message.tool_calls %}
                {%- if (loop.first and content) or (not loop.first) %}
                    {{- '\n' }}
                {%- endif %}
                {%- if tool_call.function %}
                    {%- set tool_call = tool_call.function %}
                {%- endif %}
                {{- '<tool_call>\n{"name": "' }}
                {{- tool_call.name }}
                {{- '", "arguments": ' }}
                {%- if tool_call.arguments is string %}
                    {{- tool_call.arguments }}
                {%- else %}
                    {{- tool_call.arguments | tojson }}
                {%- endif %}
                {{- '}\n</tool_call>' }}
            {%- endfor %}
        {%- endif %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == "tool" %}
        {%- if loop.first or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' }}
        {{- message.content }}
        {{- '\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\n\n</think>\n\n' }}
    {%- endif %}
{%- endif %}"""

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city, in °C <metric>",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "description": "City name"}},
            "required": ["city"],
        },
    },
}
WEATHER_CALL = {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Zürich"}}}
LLAMA_HEADER = "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\n"
LLAMA_DATES = "Cutting Knowledge Date: December 2023\nToday Date: 26 Jul 2024\n\n"


def user(content: str) -> dict:
    return {"role": "user", "content": content}


def assistant(content: str) -> dict:
    return {"role": "assistant", "content": content}


def system(content: str) -> dict:
    return {"role": "system", "content": content}


# --- real templates -------------------------------------------------------------------------------------------


def test_smollm2_adds_its_default_system_prompt():
    assert render_chat(SMOLLM2, [user("Hi")]) == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
        "<|im_start|>user\nHi<|im_end|>\n"
        "<|im_start|>assistant\n"
    )


def test_smollm2_with_system_and_no_generation_prompt():
    out = render_chat(SMOLLM2, [system("Be brief."), user("Hi")], add_generation_prompt=False)
    assert out == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"


def test_llama31_plain_chat():
    out = render_chat(LLAMA31, [user(" Hi ")], bos_token="<|begin_of_text|>")
    assert out == (
        LLAMA_HEADER + LLAMA_DATES + "<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n"
    )


def test_llama31_puts_tools_in_the_first_user_message_as_indented_json():
    messages = [system("You are terse."), user("Weather in Zürich?")]
    out = render_chat(LLAMA31, messages, bos_token="<|begin_of_text|>", tools=[WEATHER_TOOL])
    # transformers' tojson: indent=4, key order kept, non-ASCII and <> written as they are
    tool_json = json.dumps(WEATHER_TOOL, indent=4, ensure_ascii=False)
    assert '"description": "Current weather in a city, in °C <metric>"' in tool_json
    assert out == (
        LLAMA_HEADER + "Environment: ipython\n" + LLAMA_DATES + "You are terse.<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\n"
        "Given the following functions, please respond with a JSON for a function call with its proper arguments "
        "that best answers the given prompt.\n\n"
        'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.'
        "Do not use variables.\n\n" + tool_json + "\n\nWeather in Zürich?<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n"
    )


def test_llama31_tool_call_and_tool_result():
    messages = [
        user("Weather in Zürich?"),
        {"role": "assistant", "tool_calls": [WEATHER_CALL]},
        {"role": "tool", "content": "12"},
    ]
    out = render_chat(LLAMA31, messages, bos_token="<|begin_of_text|>")
    assert out == (
        LLAMA_HEADER + LLAMA_DATES + "<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nWeather in Zürich?<|eot_id|>"
        '<|start_header_id|>assistant<|end_header_id|>\n\n{"name": "get_weather", "parameters": {"city": "Zürich"}}<|eot_id|>'
        '<|start_header_id|>ipython<|end_header_id|>\n\n"12"<|eot_id|>'
        "<|start_header_id|>assistant<|end_header_id|>\n\n"
    )


def test_llama31_raise_exception_for_two_tool_calls():
    messages = [user("Hi"), {"role": "assistant", "tool_calls": [WEATHER_CALL, WEATHER_CALL]}]
    with pytest.raises(TemplateError, match="only supports single tool-calls at once"):
        render_chat(LLAMA31, messages)


def test_gemma3_folds_the_system_prompt_into_the_first_turn():
    messages = [system("Be brief."), user(" Hi "), assistant("Hello."), user("Bye")]
    assert render_chat(GEMMA3, messages, bos_token="<bos>") == (
        "<bos><start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n"
        "<start_of_turn>model\nHello.<end_of_turn>\n"
        "<start_of_turn>user\nBye<end_of_turn>\n"
        "<start_of_turn>model\n"
    )


@pytest.mark.parametrize(
    "messages",
    [[user("a"), user("b")], [assistant("a")], [user("a"), assistant("b"), assistant("c")]],
    ids=["user-user", "assistant-first", "assistant-assistant"],
)
def test_gemma3_raises_on_wrong_roles(messages):
    with pytest.raises(TemplateError) as info:
        render_chat(GEMMA3, messages, bos_token="<bos>")
    message = str(info.value)
    assert "Conversation roles must alternate user/assistant/user/assistant/..." in message
    assert "\n" not in message


def test_qwen3_tools_tool_call_and_tool_response():
    messages = [
        system("You are terse."),
        user("Weather in Zürich?"),
        {"role": "assistant", "content": "", "tool_calls": [WEATHER_CALL]},
        {"role": "tool", "content": "12"},
    ]
    assert render_chat(QWEN3, messages, tools=[WEATHER_TOOL]) == (
        "<|im_start|>system\nYou are terse.\n\n# Tools\n\n"
        "You may call one or more functions to assist with the user query.\n\n"
        "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
        '{"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city, '
        'in °C <metric>", "parameters": {"type": "object", "properties": {"city": {"type": "string", '
        '"description": "City name"}}, "required": ["city"]}}}\n</tools>\n\n'
        "For each function call, return a json object with function name and arguments within "
        "<tool_call></tool_call> XML tags:\n<tool_call>\n"
        '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n'
        "<|im_start|>user\nWeather in Zürich?<|im_end|>\n"
        '<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Zürich"}}\n'
        "</tool_call><|im_end|>\n"
        "<|im_start|>user\n<tool_response>\n12\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n"
    )


def test_qwen3_drops_old_reasoning_and_honours_enable_thinking():
    messages = [user("2+2?"), assistant("<think>\nadd them\n</think>\n\n4"), user("Times 3?")]
    assert render_chat(QWEN3, messages, enable_thinking=False) == (
        "<|im_start|>user\n2+2?<|im_end|>\n"
        "<|im_start|>assistant\n4<|im_end|>\n"
        "<|im_start|>user\nTimes 3?<|im_end|>\n"
        "<|im_start|>assistant\n<think>\n\n</think>\n\n"
    )


def test_qwen3_keeps_reasoning_of_the_last_turn():
    messages = [user("2+2?"), assistant("<think>\nadd them\n</think>\n\n4")]
    assert render_chat(QWEN3, messages, add_generation_prompt=False) == (
        "<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n<think>\nadd them\n</think>\n\n4<|im_end|>\n"
    )


# --- environment ----------------------------------------------------------------------------------------------


def test_trim_blocks_and_lstrip_blocks_are_on():
    template = "{% for m in messages %}\n    {% if true %}\n{{ m['content'] }}\n    {% endif %}\n{% endfor %}"
    assert render_chat(template, [user("a"), user("b")]) == "a\nb\n"


def test_loop_controls_extension():
    template = "{% for m in messages %}{% if loop.index0 == 1 %}{% continue %}{% endif %}{{ m['content'] }}{% endfor %}"
    assert render_chat(template, [user("a"), user("b"), user("c")]) == "ac"


def test_tojson_matches_transformers():
    data = {"b": "<é>", "a": [1, 2]}
    assert render_chat("{{ x | tojson }}", [], x=data) == '{"b": "<é>", "a": [1, 2]}'
    assert render_chat("{{ x | tojson(indent=2) }}", [], x={"a": 1}) == '{\n  "a": 1\n}'
    assert render_chat("{{ x | tojson(separators=(',', ':')) }}", [], x=[1, 2]) == "[1,2]"
    assert render_chat("{{ x | tojson(ensure_ascii=True) }}", [], x="é") == '"\\u00e9"'


def test_strftime_now():
    before = datetime.now().strftime("%Y-%m-%d")
    out = render_chat("{{ strftime_now('%Y-%m-%d') }}", [])
    assert out in (before, datetime.now().strftime("%Y-%m-%d"))


def test_raise_exception_becomes_template_error():
    with pytest.raises(TemplateError) as info:
        render_chat("{{ raise_exception('no system role, please') }}", [system("x")])
    assert "no system role, please" in str(info.value)


def test_syntax_error_is_one_line_template_error():
    with pytest.raises(TemplateError) as info:
        render_chat("{% for m in messages %}\n{{ m }\n", [])
    assert "syntax error on line 2" in str(info.value)
    assert "\n" not in str(info.value)


def test_undefined_error_is_template_error():
    with pytest.raises(TemplateError, match="UndefinedError"):
        render_chat("{{ messages[0]['content'] + '!' }}", [])


def test_python_errors_in_template_expressions_are_template_errors():
    with pytest.raises(TemplateError, match="ZeroDivisionError"):
        render_chat("{{ 1 / 0 }}", [])
    with pytest.raises(TemplateError, match="TypeError"):
        render_chat("{{ messages[0]['content'] + 1 }}", [user("x")])


def test_undefined_variables_render_empty_as_in_transformers():
    assert render_chat("[{{ not_given }}]", []) == "[]"


def test_bos_and_eos_tokens_reach_the_template():
    assert render_chat("{{ bos_token }}x{{ eos_token }}", [], bos_token="<s>", eos_token="</s>") == "<s>x</s>"


# --- sandbox --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "template",
    [
        "{{ ''.__class__.__mro__[1].__subclasses__() }}",
        "{{ messages.__class__.__base__.__subclasses__() }}",
        "{{ raise_exception.__globals__['__builtins__'] }}",
        "{{ cycler.__init__.__globals__.os.popen('id').read() }}",
        "{{ self.__init__.__globals__ }}",
    ],
)
def test_sandbox_refuses_private_attributes(template):
    with pytest.raises(TemplateError, match="unsafe|SecurityError|UndefinedError"):
        render_chat(template, [user("x")])


def test_sandbox_hides_dunder_attributes():
    assert render_chat("[{{ ''.__class__ }}]", []) == "[]"


def test_sandbox_is_immutable():
    with pytest.raises(TemplateError, match="SecurityError"):
        render_chat("{{ messages.append({'role': 'system'}) }}", [user("x")])
    with pytest.raises(TemplateError, match="SecurityError"):
        render_chat("{{ messages[0].update(role='system') }}", [user("x")])


def test_sandbox_cannot_open_files():
    with pytest.raises(TemplateError):
        render_chat("{{ open('/etc/passwd').read() }}", [])
    with pytest.raises(TemplateError):
        render_chat("{% include '/etc/passwd' %}", [])


# --- ChatTemplate.from_metadata -------------------------------------------------------------------------------

VOCAB = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "hello"]


def test_from_metadata_reads_template_and_special_tokens():
    metadata = {
        "tokenizer.chat_template": SMOLLM2,
        "tokenizer.ggml.tokens": VOCAB,
        "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 2,
    }
    template = ChatTemplate.from_metadata(metadata)
    assert template.fallback_reason is None
    assert (template.bos_token, template.eos_token) == ("<|im_start|>", "<|im_end|>")
    assert template.render([system("S"), user("Hi")]) == (
        "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    )


def test_from_metadata_passes_token_text_to_the_template():
    metadata = {
        "tokenizer.chat_template": GEMMA3,
        "tokenizer.ggml.tokens": ["<pad>", "<eos>", "<bos>"],
        "tokenizer.ggml.bos_token_id": 2,
        "tokenizer.ggml.eos_token_id": 1,
    }
    template = ChatTemplate.from_metadata(metadata)
    assert template.render([user("Hi")]) == "<bos><start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\n"


def test_fallback_to_chatml_when_the_vocabulary_has_im_start():
    template = ChatTemplate.from_metadata({"tokenizer.ggml.tokens": VOCAB, "tokenizer.ggml.eos_token_id": 2})
    assert template.fallback_reason == "model has no chat template; using ChatML"
    assert template.eos_token == "<|im_end|>"
    assert template.render([user("Hi")]) == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"


def test_fallback_to_plain_format():
    template = ChatTemplate.from_metadata({"tokenizer.ggml.tokens": ["<s>", "</s>"], "tokenizer.ggml.bos_token_id": 0})
    assert "plain" in template.fallback_reason and "no chat template" in template.fallback_reason
    assert template.bos_token == "<s>"
    out = template.render([system("S"), user("Hi"), assistant("Yo"), user("Bye")])
    assert out == "system: S\nuser: Hi\nassistant: Yo\nuser: Bye\nassistant:"


def test_fallback_without_any_tokenizer_metadata():
    template = ChatTemplate.from_metadata({})
    assert template.fallback_reason is not None
    assert (template.bos_token, template.eos_token) == ("", "")
    assert template.render([user("Hi")], add_generation_prompt=False) == "user: Hi\n"


def test_none_template_renders_chatml():
    assert render_chat(None, [user("Hi")], add_generation_prompt=False) == "<|im_start|>user\nHi<|im_end|>\n"


RUNAWAY = {
    "loops": "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
    "doubling macro": "{% macro d(s) %}{{ d(s ~ s) }}{% endmacro %}{{ d('x') }}",
    "doubling +": "{% set ns = namespace(s='x') %}{% for i in range(40) %}{% set ns.s = ns.s + ns.s %}{% endfor %}",
    "multiplication": "{{ 'x' * 10 ** 10 }}",
    "list multiplication": "{{ (['x'] * 10 ** 9) | length }}",
    "integer growth": "{% set ns = namespace(n=3) %}{% for i in range(40) %}{% set ns.n = ns.n * ns.n %}{% endfor %}",
    "power": "{{ 7 ** 1000000 }}",
    "replace": "{{ ('x' * 5000).replace('', 'y' * 20000) }}",
    "replace filter": "{{ ('x' * 5000) | replace('', 'y' * 20000) }}",
    "padding": "{{ 'x'.center(10 ** 9) }}",
    "padding filter": "{{ 'x' | center(10 ** 9) }}",
    "printf width": "{{ '%1000000000s' % 'x' }}",
    "format width": "{{ '{:>1000000000}'.format('x') }}",
    "join": "{{ ('x' * 60000) ~ ((['y' * 60000] * 2000) | join) }}",
}


@pytest.mark.parametrize("name", RUNAWAY)
def test_runaway_templates_stop_within_their_limits(name):
    from leat.chat import RenderLimits

    before = sys.gettrace()
    started = time.monotonic()
    with pytest.raises(TemplateError, match="stopped"):
        render_chat(RUNAWAY[name], [], limits=RenderLimits(seconds=1, chars=1 << 20))
    assert time.monotonic() - started < 3
    assert sys.gettrace() is before


def test_output_over_the_character_limit_stops():
    from leat.chat import RenderLimits

    template = "{% for i in range(1000) %}{{ messages[0]['content'] }}{% endfor %}"
    with pytest.raises(TemplateError, match="output passed"):
        render_chat(template, [{"role": "user", "content": "x" * 2000}], limits=RenderLimits(chars=1 << 20))


def test_limits_leave_real_templates_alone():
    messages = [{"role": "user", "content": "x" * 100_000}] * 50
    text = render_chat(SMOLLM2, messages)
    assert len(text) > 5_000_000 and text.count("<|im_start|>user") == 50


def test_constant_runaway_is_refused_when_compiling():
    with pytest.raises(TemplateError, match="1,000,000,000"):
        render_chat("{{ 'x' | center(1000000000) }}", [])
