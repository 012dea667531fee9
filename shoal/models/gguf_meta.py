"""GGUF metadata access that needs no torch (the tokenizer reads its vocabulary through it)."""

from __future__ import annotations

from pathlib import Path

from gguf import GGUFReader


def open_gguf(path: Path) -> GGUFReader:
    return GGUFReader(str(path), "r")


def field_value(reader: GGUFReader, key: str, default=None):
    f = reader.fields.get(key)
    return default if f is None else f.contents()
