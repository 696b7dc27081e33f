"""Chat templates that ship with RL360 (jinja, rendered by transformers).

`CHATML_TOOLS` follows the Qwen2.5 / SmolLM2 conventions: ChatML turns, tools listed in the
system block, assistant tool calls as `<tool_call>{json}</tool_call>`, and consecutive tool
results grouped into one user turn of `<tool_response>` blocks (TITO edge case 11). Every
literal is emitted by an expression so jinja's whitespace control cannot eat newlines.
"""

_NL = "{{ '\\n' }}"

CHATML_TOOLS = "".join(
    [
        "{%- if tools -%}",
        "{{ '<|im_start|>system\\n' }}",
        "{%- if messages[0].role == 'system' -%}{{ messages[0].content + '\\n\\n' }}{%- endif -%}",
        "{{ '# Tools\\nCall a tool with <tool_call>{\"name\": ..., \"arguments\": {...}}"
        "</tool_call>.\\n<tools>\\n' }}",
        "{%- for t in tools -%}{{ t | tojson }}" + _NL + "{%- endfor -%}",
        "{{ '</tools><|im_end|>\\n' }}",
        "{%- elif messages[0].role == 'system' -%}",
        "{{ '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}",
        "{%- endif -%}",
        "{%- for m in messages -%}",
        "{%- if m.role == 'system' and loop.first -%}",
        "{%- elif m.role == 'user' or m.role == 'system' -%}",
        "{{ '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}",
        "{%- elif m.role == 'assistant' -%}",
        "{{ '<|im_start|>assistant\\n' }}{%- if m.content -%}{{ m.content }}{%- endif -%}",
        "{%- if m.tool_calls -%}{%- for tc in m.tool_calls -%}",
        "{%- if m.content or not loop.first -%}" + _NL + "{%- endif -%}",
        "{{ '<tool_call>\\n{\"name\": \"' + tc.function.name + '\", \"arguments\": ' }}",
        "{%- if tc.function.arguments is string -%}{{ tc.function.arguments }}",
        "{%- else -%}{{ tc.function.arguments | tojson }}{%- endif -%}",
        "{{ '}\\n</tool_call>' }}",
        "{%- endfor -%}{%- endif -%}",
        "{{ '<|im_end|>\\n' }}",
        "{%- elif m.role == 'tool' -%}",
        "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' -%}"
        "{{ '<|im_start|>user' }}{%- endif -%}",
        "{{ '\\n<tool_response>\\n' + m.content + '\\n</tool_response>' }}",
        "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' -%}"
        "{{ '<|im_end|>\\n' }}{%- endif -%}",
        "{%- endif -%}",
        "{%- endfor -%}",
        "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\\n' }}{%- endif -%}",
    ]
)

# SmolLM2-Instruct's own tool-call convention (its model card's function-calling format):
# tools listed as a JSON list of function objects in the system block, calls as ONE
# `<tool_call>[{"name": ..., "arguments": {...}}, ...]</tool_call>` list per reply. Tool results
# come back as a user turn of `<tool_response>` blocks, as in CHATML_TOOLS.
SMOLLM2_TOOLS = "".join(
    [
        "{%- if tools -%}",
        "{{ '<|im_start|>system\\n' }}",
        "{%- if messages[0].role == 'system' -%}{{ messages[0].content + '\\n\\n' }}{%- endif -%}",
        "{{ 'You can call these tools:\\n<tools>[' }}",
        "{%- for t in tools -%}{%- if not loop.first -%}{{ ', ' }}{%- endif -%}",
        "{%- if t.function is defined -%}{{ t.function | tojson }}{%- else -%}{{ t | tojson }}"
        "{%- endif -%}{%- endfor -%}",
        "{{ ']</tools>\\nTo call tools, reply with <tool_call>[{\"name\": \"tool name\", "
        "\"arguments\": {...}}]</tool_call><|im_end|>\\n' }}",
        "{%- elif messages[0].role == 'system' -%}",
        "{{ '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}",
        "{%- endif -%}",
        "{%- for m in messages -%}",
        "{%- if m.role == 'system' and loop.first -%}",
        "{%- elif m.role == 'user' or m.role == 'system' -%}",
        "{{ '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}",
        "{%- elif m.role == 'assistant' -%}",
        "{{ '<|im_start|>assistant\\n' }}{%- if m.content -%}{{ m.content }}{%- endif -%}",
        "{%- if m.tool_calls -%}",
        "{%- if m.content -%}" + _NL + "{%- endif -%}",
        "{{ '<tool_call>[' }}",
        "{%- for tc in m.tool_calls -%}{%- if not loop.first -%}{{ ', ' }}{%- endif -%}",
        "{{ '{\"name\": \"' + tc.function.name + '\", \"arguments\": ' }}",
        "{%- if tc.function.arguments is string -%}{{ tc.function.arguments }}",
        "{%- else -%}{{ tc.function.arguments | tojson }}{%- endif -%}",
        "{{ '}' }}",
        "{%- endfor -%}",
        "{{ ']</tool_call>' }}",
        "{%- endif -%}",
        "{{ '<|im_end|>\\n' }}",
        "{%- elif m.role == 'tool' -%}",
        "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' -%}"
        "{{ '<|im_start|>user' }}{%- endif -%}",
        "{{ '\\n<tool_response>\\n' + m.content + '\\n</tool_response>' }}",
        "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' -%}"
        "{{ '<|im_end|>\\n' }}{%- endif -%}",
        "{%- endif -%}",
        "{%- endfor -%}",
        "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\\n' }}{%- endif -%}",
    ]
)

# `model.chat_template` names: RL360's templates (anything else is a path to a .jinja file,
# or "auto" for the tokenizer's own)
TEMPLATES = {"chatml_tools": CHATML_TOOLS, "smollm2_tools": SMOLLM2_TOOLS}
