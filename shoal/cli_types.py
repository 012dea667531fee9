"""Argparse types for numeric flags: a value out of range is refused at parsing, with the flag's name,
instead of failing deep in a run (a zero replica count, a negative rate, a list with a word in it)."""

from __future__ import annotations

import argparse
import math


def _converted(text: str, convert, what: str):
    try:
        return convert(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not {what}") from None


def whole(least: int, most: int | None = None):
    """An integer of at least `least` (and at most `most`)."""

    def parse(text: str) -> int:
        value = _converted(text, int, "a whole number")
        if value < least:
            raise argparse.ArgumentTypeError(f"{value} is below {least}")
        if most is not None and value > most:
            raise argparse.ArgumentTypeError(f"{value} is above {most}")
        return value

    parse.__name__ = f"whole number of at least {least}" + ("" if most is None else f" and at most {most}")
    return parse


PORT = whole(0, 65535)  # 0: any free port


def number(positive: bool):
    """A finite-or-infinite number above 0 (`positive`) or at least 0; never NaN."""

    def parse(text: str) -> float:
        value = _converted(text, float, "a number")
        if math.isnan(value) or value < 0 or (positive and value == 0):
            raise argparse.ArgumentTypeError(f"{text} is not {'above' if positive else 'at least'} 0")
        return value

    parse.__name__ = "positive number" if positive else "number of at least 0"
    return parse


POSITIVE = number(True)
NON_NEGATIVE = number(False)


def fraction(text: str) -> float:
    """A share from 0 to 1."""
    value = NON_NEGATIVE(text)
    if value > 1:
        raise argparse.ArgumentTypeError(f"{text} is above 1")
    return value


def whole_list(least: int):
    """Comma-separated integers, each at least `least`: `1,4,16`."""
    one = whole(least)

    def parse(text: str) -> tuple[int, ...]:
        parts = [p for p in text.split(",") if p.strip()]
        if not parts:
            raise argparse.ArgumentTypeError("an empty list")
        return tuple(one(p.strip()) for p in parts)

    parse.__name__ = "comma-separated list"
    return parse
