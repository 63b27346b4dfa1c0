"""The environment protocol: tool schemas through the chat template, tool calls parsed
from a turn, failed calls given back to the model and counted, and the plain format."""

import pytest

from llamarl.app.envs import (BAD_ARGUMENTS, TOOL_RAISED, UNKNOWN_TOOL, UNPARSED, call_tools,
                              parse_tool_calls, tool_schemas)
from llamarl.app.envs.chat import PLAIN_TOOLS_HEADER, ChatFormat
from llamarl.app.model.policy import create_default_policy

# A ChatML template with Hermes-style tools (the shape of Qwen's and SmolLM3's).
HERMES_TEMPLATE = (
    "{% if tools %}<|im_start|>system\nTools:\n{% for t in tools %}{{ t | tojson }}\n{% endfor %}"
    "<|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: the first
        b: the second
    """
    return a + b


def broken(x: int) -> int:
    """Always fails.

    Args:
        x: ignored
    """
    raise RuntimeError("boom")


@pytest.fixture(scope="module")
def tokenizer():
    return create_default_policy()[1]


def test_tool_calls_run_and_failures_are_named():
    turn = ('<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>'
            '<tool_call>{"name": "sub", "arguments": {}}</tool_call>'
            '<tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call>'
            '<tool_call>{"name": "broken", "arguments": {"x": 1}}</tool_call>'
            '<tool_call>{"name": add}</tool_call>')
    step = call_tools(turn, [add, broken])
    assert step.tool_calls == 5 and not step.done and step.reward is None
    assert sorted(step.tool_errors) == sorted([UNKNOWN_TOOL, BAD_ARGUMENTS, TOOL_RAISED, UNPARSED])
    answers = [m["content"] for m in step.observation]
    assert "not valid JSON" in answers[0]  # unparsed calls come first
    assert answers[1] == "5"
    assert "no tool named 'sub'" in answers[2] and "boom" in answers[4]
    assert call_tools("#### 5", [add]) is None  # no call: the turn is the answer


def test_arguments_as_a_json_string_and_an_unclosed_call():
    calls, errors = parse_tool_calls('<tool_call>{"name": "add", "arguments": "{\\"a\\": 1, \\"b\\": 2}"}')
    assert not errors and calls[0].arguments == {"a": 1, "b": 2}


def test_tools_reach_the_chat_template_and_observations_extend_the_prompt(tokenizer):
    tokenizer = tokenizer.__class__(tokenizer_object=tokenizer.backend_tokenizer, eos_token="<|im_end|>",
                                    bos_token=None, pad_token=tokenizer.pad_token)
    tokenizer.add_special_tokens({"eos_token": "<|im_end|>"})
    tokenizer.chat_template = HERMES_TEMPLATE
    fmt = ChatFormat(tokenizer, tool_schemas([add]))
    assert fmt.templated and fmt.end_of_turn_id == tokenizer.convert_tokens_to_ids("<|im_end|>")
    text, ids = fmt.prompt([{"role": "user", "content": "2+3?"}])
    assert '"name": "add"' in text and text.endswith("<|im_start|>assistant\n")
    history = [{"role": "user", "content": "2+3?"},
               {"role": "assistant", "content": '<tool_call>{"name": "add"}</tool_call>'}]
    obs_text, obs_ids = fmt.observation(history, [{"role": "tool", "content": "5"}])
    assert obs_text == "\n<|im_start|>tool\n5<|im_end|>\n<|im_start|>assistant\n"
    assert tokenizer.decode(obs_ids) == obs_text


def test_plain_format_without_a_template(tokenizer):
    fmt = ChatFormat(tokenizer, tool_schemas([add]))
    assert not fmt.templated and fmt.end_of_turn_id == tokenizer.eos_token_id
    text, ids = fmt.prompt([{"role": "user", "content": "Q: 2+3?\nA:"}])
    assert text.startswith(PLAIN_TOOLS_HEADER) and text.endswith("\nQ: 2+3?\nA:")
    assert ids[0] == tokenizer.bos_token_id
    plain, _ = ChatFormat(tokenizer).prompt([{"role": "user", "content": "Q: 1\nA:"}])
    assert plain == "Q: 1\nA:"  # no tools: the task's own prompt
    obs, obs_ids = fmt.observation([], [{"role": "tool", "content": "5"}])
    assert obs == "\n<tool_response>5</tool_response>\n" and tokenizer.decode(obs_ids) == obs
