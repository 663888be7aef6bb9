"""Errors a user can act on, and the argument types that refuse bad numbers and JSON up front.

`UserError` is the one base class: the CLI prints its message as one line and exits 2 (bad input; see
`specpilot.output`).
"""

import argparse
import json


class UserError(RuntimeError):
    """An error whose message says what happened and what to do."""


def _int_at_least(text: str, least: int) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < least:
        raise argparse.ArgumentTypeError(f"must be at least {least}, got {value}")
    return value


def positive_int(text: str) -> int:
    """argparse type: an integer of at least 1."""
    return _int_at_least(text, 1)


def non_negative_int(text: str) -> int:
    """argparse type: an integer of at least 0."""
    return _int_at_least(text, 0)


def non_negative_float(text: str) -> float:
    """argparse type: a number of at least 0."""
    try:
        return 0.0 if float(text) == 0 else positive_float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None


def positive_float(text: str) -> float:
    """argparse type: a number above 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be above 0, got {text}")
    return value


def json_object(text: str) -> dict:
    """argparse type: a JSON object, such as a flag's engine options."""
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"must be a JSON object, not {text!r} ({exc}), such as '{{\"verify\": \"tree\"}}'") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"must be a JSON object, got {type(value).__name__}")
    return value
