"""Calculator tools for the embedded arithmetic task, named in a config by
`env.<name>.tools: [examples/tools/calculator.py:add, ...]` (see docs/environments.md).

A tool is a plain Python function with type hints and a docstring whose Args section
describes each argument: posttrain turns them into the JSON schema the chat template shows
the model. It runs in the environment's Ray actors; an exception goes back to the model as
an error text.
"""


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: The first addend.
        b: The second addend.
    """
    return a + b


def subtract(a: int, b: int) -> int:
    """Subtract b from a.

    Args:
        a: The minuend.
        b: The subtrahend.
    """
    return a - b


def multiply(a: int, b: int) -> int:
    """Multiply two integers.

    Args:
        a: The first factor.
        b: The second factor.
    """
    return a * b
