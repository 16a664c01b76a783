"""Calculator tools for the built-in ToolEnv (docs/environments.md).

Each function is a tool: its JSON schema comes from the type hints and the Google-style docstring
(`transformers.utils.get_json_schema`), and the model sees it through its chat template.

    env:
      tools:
        - {path: examples/envs/calculator.py, name: add}
        - {path: examples/envs/calculator.py, name: multiply}
      max_turns: 3

The model calls one as <tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call> and reads
the result in a `tool` message.
"""


def add(a: float, b: float) -> float:
    """Add two numbers.

    Args:
        a: The first number.
        b: The second number.
    """
    return a + b


def multiply(a: float, b: float) -> float:
    """Multiply two numbers.

    Args:
        a: The first number.
        b: The second number.
    """
    return a * b
