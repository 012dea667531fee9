"""Tokenizer built on `tokenizers`, from tokenizer.json or from GGUF metadata, plus chat template."""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gguf import GGUFReader
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

from shoal.models.chat_template import ChatTemplateError, render_chat
from shoal.models.gguf_meta import field_value

_GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# Pre-tokenizers by llama.cpp's `tokenizer.ggml.pre` name. smollm/starcoder split every digit alone
# before the GPT-2 regex, as their tokenizer.json does.
_DIGIT_THEN_GPT2 = ("smollm", "starcoder", "refact", "command-r")
_SPLIT_BY_PRE = {"llama3": _LLAMA3_SPLIT, "llama-bpe": _LLAMA3_SPLIT, "qwen2": _QWEN2_SPLIT}

CONTROL = 3
USER_DEFINED = 4


@dataclass
class Tokenizer:
    backend: HFTokenizer
    bos_token_id: int | None = None
    eos_token_ids: frozenset[int] = frozenset()
    add_bos: bool = False
    chat_template: str | None = None
    special_tokens: dict[str, str | None] = field(default_factory=dict)

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    @functools.cached_property
    def max_token_chars(self) -> int:
        """An upper bound on the characters one token stands for (a vocabulary entry's length:
        byte-level and sentencepiece entries spell each byte or character once), so that a text
        longer than `n * max_token_chars` surely has more than n tokens, without tokenizing it."""
        return max(len(t) for t in self.backend.get_vocab(with_added_tokens=True))

    @property
    def eos_token_id(self) -> int | None:
        return min(self.eos_token_ids) if self.eos_token_ids else None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = self.backend.encode(text, add_special_tokens=False).ids
        bos = self.bos_token_id
        if add_special_tokens and self.add_bos and bos is not None and (not ids or ids[0] != bos):
            ids = [bos, *ids]
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(ids, skip_special_tokens=skip_special_tokens)

    def id_to_token(self, token_id: int) -> str | None:
        return self.backend.id_to_token(token_id)

    def apply_chat_template(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **kwargs: Any
    ) -> str:
        if not self.chat_template:
            raise ChatTemplateError("this model has no chat template; use a completion prompt instead")
        return render_chat(
            self.chat_template,
            messages,
            add_generation_prompt=add_generation_prompt,
            special_tokens=self.special_tokens,
            **kwargs,
        )

    def encode_chat(self, messages: list[dict[str, Any]], **kwargs: Any) -> list[int]:
        text = self.apply_chat_template(messages, **kwargs)
        # The template writes BOS itself where the model wants one.
        return self.encode(text, add_special_tokens=False)

    # --- construction -------------------------------------------------------------------

    @classmethod
    def from_hf_dir(cls, model_dir: Path) -> Tokenizer:
        backend = HFTokenizer.from_file(str(model_dir / "tokenizer.json"))
        cfg = _read_json(model_dir / "tokenizer_config.json")
        gen = _read_json(model_dir / "generation_config.json")
        template = cfg.get("chat_template")
        if isinstance(template, list):  # named templates: take the default
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        jinja_file = model_dir / "chat_template.jinja"
        if template is None and jinja_file.exists():
            template = jinja_file.read_text()

        def token_str(key):
            v = cfg.get(key)
            return v.get("content") if isinstance(v, dict) else v

        specials = {k: token_str(k) for k in ("bos_token", "eos_token", "unk_token", "pad_token")}
        bos = backend.token_to_id(specials["bos_token"]) if specials["bos_token"] else None
        eos: set[int] = set()
        if specials["eos_token"] and backend.token_to_id(specials["eos_token"]) is not None:
            eos.add(backend.token_to_id(specials["eos_token"]))
        gen_eos = gen.get("eos_token_id")
        eos.update(gen_eos if isinstance(gen_eos, list) else [gen_eos] if gen_eos is not None else [])
        return cls(
            backend=backend,
            bos_token_id=bos,
            eos_token_ids=frozenset(eos),
            add_bos=bool(cfg.get("add_bos_token", False)),
            chat_template=template,
            special_tokens=specials,
        )

    @classmethod
    def from_gguf(cls, reader: GGUFReader) -> Tokenizer:
        kind = field_value(reader, "tokenizer.ggml.model")
        if kind != "gpt2":
            raise ValueError(
                f"GGUF tokenizer model {kind!r} is not supported yet (only byte-level BPE 'gpt2')"
            )
        tokens: list[str] = field_value(reader, "tokenizer.ggml.tokens")
        types = field_value(reader, "tokenizer.ggml.token_type") or [1] * len(tokens)
        merges = [tuple(m.split(" ", 1)) for m in field_value(reader, "tokenizer.ggml.merges") or []]
        vocab = {tok: i for i, tok in enumerate(tokens)}
        backend = HFTokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
        backend.pre_tokenizer = _pre_tokenizer(field_value(reader, "tokenizer.ggml.pre", "default"))
        backend.decoder = decoders.ByteLevel()
        backend.add_special_tokens(
            [AddedToken(t, special=True, normalized=False) for t, ty in zip(tokens, types) if ty == CONTROL]
        )
        backend.add_tokens(
            [
                AddedToken(t, special=False, normalized=False)
                for t, ty in zip(tokens, types)
                if ty == USER_DEFINED
            ]
        )

        def tid(key):
            v = field_value(reader, f"tokenizer.ggml.{key}_token_id")
            return int(v) if v is not None else None

        eos = {i for i in (tid("eos"), tid("eot"), tid("eom")) if i is not None}
        bos = tid("bos")
        return cls(
            backend=backend,
            bos_token_id=bos,
            eos_token_ids=frozenset(eos),
            add_bos=bool(field_value(reader, "tokenizer.ggml.add_bos_token", False)),
            chat_template=field_value(reader, "tokenizer.chat_template"),
            special_tokens={
                "bos_token": tokens[bos] if bos is not None else None,
                "eos_token": tokens[tid("eos")] if tid("eos") is not None else None,
            },
        )


def _pre_tokenizer(pre: str):
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    if pre in _DIGIT_THEN_GPT2:
        split = [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.Split(Regex(_GPT2_SPLIT), "isolated"),
        ]
    else:
        split = [pre_tokenizers.Split(Regex(_SPLIT_BY_PRE.get(pre, _GPT2_SPLIT)), "isolated")]
    return pre_tokenizers.Sequence([*split, byte_level])


def _read_json(path: Path) -> dict:
    return json.loads(path.read_text()) if path.exists() else {}
