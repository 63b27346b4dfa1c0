"""Messages to token ids: the tokenizer's chat template, or a plain format without one.

An episode's sequence only grows: the prompt's ids, then each sampled turn exactly as
sampled (up to and including its end-of-turn token), then the observation's ids, and so
on. The policy's tokens are never re-tokenized, so their log-probs stay the ones the
generator recorded.

With a chat template, the observation's ids are the template's own text for it: the
conversation rendered with and without the observation (the latter ending at the
assistant turn's end-of-turn token), the former's text past that point tokenized. This
assumes the template renders earlier turns unchanged as the conversation grows (true of
ChatML/Hermes-style templates; a template that drops an earlier turn's reasoning breaks
it, and is refused with a one-line error rather than trained on a sequence the model
never sees). The end of a turn is the tokenizer's EOS token (``<|im_end|>`` for ChatML
models).

Without a template (the tiny test policies), the plain format: the tool schemas as JSON
lines above the first message, messages' contents one per line, no role labels (so a
tool-less episode's prompt is the task's own prompt, the one the warm start taught),
each tool answer as ``<tool_response>...</tool_response>`` on a line of its own, and the
policy's turn ending at EOS.
"""

from __future__ import annotations

import json
from typing import Any, Sequence

from transformers import PreTrainedTokenizerBase

from llamarl.app.envs.protocol import Message
from llamarl.app.model.policy import encode_prompts

PLAIN_TOOLS_HEADER = ('Tools (call one as <tool_call>{"name": ..., "arguments": {...}}</tool_call>, '
                      "its answer comes back as <tool_response>...</tool_response>):")


def plain_tools_header(tools: Sequence[dict[str, Any]]) -> str:
    """The plain format's lines describing ``tools`` above the first message ("" for none)."""
    return "\n".join([PLAIN_TOOLS_HEADER, *(json.dumps(t) for t in tools)]) if tools else ""


class ChatFormat:
    """Renders one environment's conversations for ``tokenizer``."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, tools: Sequence[dict[str, Any]] = ()) -> None:
        if tokenizer.eos_token_id is None:
            raise ValueError("the tokenizer has no EOS token to end a turn with")
        self.tokenizer, self.tools = tokenizer, list(tools)
        self.templated = bool(getattr(tokenizer, "chat_template", None))
        self.end_of_turn_id: int = tokenizer.eos_token_id
        self.end_of_turn: str = tokenizer.eos_token

    def _render(self, messages: list[Message], *, generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(messages, tools=self.tools or None, tokenize=False,
                                                  add_generation_prompt=generation_prompt)

    def _ids(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def prompt(self, messages: list[Message]) -> tuple[str, list[int]]:
        """The prompt's text and ids: the first messages, ready for the policy's turn."""
        if self.templated:
            text = self._render(messages, generation_prompt=True)
        else:
            header = plain_tools_header(self.tools)
            text = "\n".join(([header] if header else []) + [str(m["content"]) for m in messages])
        return text, encode_prompts(self.tokenizer, [text])[0]

    def observation(self, history: list[Message], observation: list[Message]) -> tuple[str, list[int]]:
        """The text and ids to append after the policy's last turn (``history[-1]``, an
        assistant message) for ``observation``, ending where the policy writes again."""
        if not self.templated:
            parts = [f"<tool_response>{m['content']}</tool_response>" if m.get("role") == "tool"
                     else str(m["content"]) for m in observation]
            text = "\n" + "\n".join(parts) + "\n"
            return text, self._ids(text)
        base = self._render(history, generation_prompt=False)
        full = self._render(history + observation, generation_prompt=True)
        cut = base.rfind(self.end_of_turn)
        if cut < 0 or not full.startswith(base[: cut + len(self.end_of_turn)]):
            raise ValueError("the chat template does not render earlier turns unchanged when the "
                             "conversation grows: episodes need one that does (docs/environments.md)")
        text = full[cut + len(self.end_of_turn):]
        return text, self._ids(text)


__all__ = ["ChatFormat", "PLAIN_TOOLS_HEADER", "plain_tools_header"]
