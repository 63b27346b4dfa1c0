"""Episodes: multi-turn rollouts against environments, with tools.

``protocol`` (the environment protocol, tools and their calls), ``chat`` (messages to
token ids through the chat template, or a plain format), ``episodes`` (the generator's
episode runner), ``sandbox`` (the sandboxed Python tool), ``builtins`` and ``adapters``
(environments: built-in, reasoning-gym, OpenEnv, verifiers) and ``spec`` (``--env``).
See docs/environments.md.
"""

from llamarl.app.envs.protocol import (BAD_ARGUMENTS, TOOL_ERRORS, TOOL_RAISED, UNKNOWN_TOOL, UNPARSED,
                                       Environment, Message, Observation, Step, Tool, as_messages,
                                       call_tools, parse_tool_calls, tool_schemas)

__all__ = ["BAD_ARGUMENTS", "Environment", "Message", "Observation", "Step", "TOOL_ERRORS", "TOOL_RAISED", "Tool",
           "UNKNOWN_TOOL", "UNPARSED", "as_messages", "call_tools", "parse_tool_calls", "tool_schemas"]
