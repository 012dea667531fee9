"""Command-line flags generated from config dataclasses.

A flag names the dataclass field it sets; its type and its default come from the field, so a
default is written once, in the dataclass, and `--help` shows that one. Parsed values are handed
back only for the flags given, and the config is built from them: the dataclass fills in the rest
(and runs its own checks), and a config file read first keeps what no flag overrides.
"""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Flag:
    """One flag for one field of a FlagSet's dataclass."""

    field: str
    names: tuple[str, ...] = ()  # spellings, long first; default: --field-name
    help: str = ""
    choices: Iterable[str] | None = None
    parse: Callable[[str], Any] | None = None  # default: the field's type
    show: Callable[[Any], str] = str  # how --help shows the default
    # A bool field that defaults to True: the flag turns it off (--no-prefix-caching).
    negate: bool = False
    metavar: str | tuple[str, ...] | None = None
    nargs: int | str | None = None  # a tuple field: this many values ("+": any), each through `parse`

    @property
    def spellings(self) -> tuple[str, ...]:
        return self.names or ("--" + self.field.replace("_", "-"),)

    @property
    def dest(self) -> str:
        """The namespace attribute argparse stores it under (from the long spelling, as usual)."""
        return self.spellings[0].lstrip("-").replace("-", "_")


@dataclass(frozen=True)
class FlagSet:
    """The flags of one config dataclass."""

    config: type
    flags: tuple[Flag, ...]


def field_default(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return None


def _value_type(annotation: Any) -> type:
    """int from `int | None`, and so on."""
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        options = [a for a in typing.get_args(annotation) if a is not type(None)]
        if len(options) == 1:
            return options[0]
        raise TypeError(f"a flag cannot parse {annotation}")
    return annotation


def add_flags(parser: argparse.ArgumentParser | argparse._ArgumentGroup, flag_set: FlagSet) -> None:
    """Adds the set's flags. Each stores None unless given, so `given` sees only what was typed."""
    fields = {f.name: f for f in dataclasses.fields(flag_set.config)}
    hints = typing.get_type_hints(flag_set.config)
    for flag in flag_set.flags:
        f = fields[flag.field]  # a flag for a field the config lacks fails here, at parser build
        default = field_default(f)
        kind = _value_type(hints[f.name])
        options: dict[str, Any] = {"dest": flag.dest, "default": None}
        text = flag.help
        if kind is bool:
            if default is not flag.negate:
                raise TypeError(
                    f"{flag.spellings[0]}: {f.name} defaults to {default}, the flag would not change it"
                )
            options["action"] = "store_false" if flag.negate else "store_true"
        else:
            options["type"] = flag.parse or kind
            if flag.choices is not None:
                options["choices"] = list(flag.choices)
            if flag.metavar:
                options["metavar"] = flag.metavar
            if flag.nargs:
                options["nargs"] = flag.nargs
            if default is not None:
                shown = flag.show(default).replace("%", "%%")
                text = f"{text} (default: {shown})" if text else f"default: {shown}"
        parser.add_argument(*flag.spellings, help=text or None, **options)


def given(args: argparse.Namespace, flag_set: FlagSet) -> dict[str, Any]:
    """Field name -> value, for the set's flags that were given."""
    values = {flag.field: getattr(args, flag.dest, None) for flag in flag_set.flags}
    return {name: tuple(v) if isinstance(v, list) else v for name, v in values.items() if v is not None}


def build(args: argparse.Namespace, flag_set: FlagSet, **fixed: Any) -> Any:
    """The set's config from the flags given (the dataclass's defaults for the rest) and `fixed`."""
    return flag_set.config(**given(args, flag_set), **fixed)
