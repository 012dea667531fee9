"""Prompt keys: the block hashes a request's prompt will have on a replica (the engine's own
hashes, salted by the deployment, so that KV events name the same blocks), and about how many
tokens it has, for admission."""

from __future__ import annotations

import asyncio
import json
import logging

from shoal.fleet.config import GatewayConfig
from shoal.fleet.replicas.table import ReplicaTable
from shoal.fleet.routing.policies import RouteRequest
from shoal.models.chat_prompt import chat_token_ids, raw_messages
from shoal.models.tokenizer import Tokenizer
from shoal.models.tool_formats import ToolFormat, offered_tools, tool_format
from shoal.protocol.block_hash import NONE_HASH, adapter_keys, hash_blocks, root_hash
from shoal.protocol.secrets import kv_salt

log = logging.getLogger(__name__)

TEXT_BLOCK_BYTES = 64  # without the model's tokenizer, prompts are hashed in blocks of bytes


def prompt_chars(path: str, body: dict) -> int:
    """About how many characters tokenizing the prompt would read (a bound, not an exact count)."""
    if path.endswith("chat/completions"):
        messages = body.get("messages")
        if not isinstance(messages, list):
            return 0
        total = 16 * len(messages)  # the template's own text per message
        for m in messages:
            content = m.get("content") if isinstance(m, dict) else None
            if isinstance(content, str):
                total += len(content)
            elif isinstance(content, list):
                total += sum(len(p.get("text") or "") for p in content if isinstance(p, dict))
        return total
    prompt = body.get(_prompt_field(path))
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list):
        prompt = prompt[0]
    return len(prompt) if isinstance(prompt, str | list) else 0


def _prompt_field(path: str) -> str:
    return "input" if path.endswith("/embeddings") else "prompt"


class PromptKeys:
    def __init__(self, config: GatewayConfig, table: ReplicaTable, tool_call_parser: str = "auto"):
        self.config = config
        self.table = table  # the replicas' block size
        self.tool_call_parser = tool_call_parser  # the replicas' --tool-call-parser
        self.tokenizer: Tokenizer | None = None
        self.tool_format: ToolFormat | None = None
        self.kv_root = NONE_HASH

    async def start(self) -> None:
        """The deployment's hash root, and the model's tokenizer (when it has one here)."""
        self.kv_root = root_hash(kv_salt(self.config.kv_salt, self.config.replica_key))
        try:
            from shoal.models.checkpoint import load_tokenizer

            self.tokenizer = await asyncio.to_thread(load_tokenizer, self.config.tokenizer)
            self.tool_format = tool_format(self.tool_call_parser, self.tokenizer.chat_template)
        except Exception as exc:  # a foreign model: route on text blocks instead
            log.warning("no tokenizer for prefix routing (%s); hashing prompt text instead", exc)

    def hash_ids(self, ids: list[int], adapter: str | None = None) -> list[int]:
        return hash_blocks(ids, self.table.block_size, adapter_keys(adapter), root=self.kv_root)

    async def route(
        self, path: str, body: dict, session: str | None, model: str | None, adapter: str | None = None
    ) -> RouteRequest:
        hashes, tokens = await asyncio.to_thread(self.hashes, path, body, adapter)
        return RouteRequest(hashes, session, model=model, adapter=adapter, tokens=tokens)

    def prompt_ids(self, path: str, body: dict) -> list[int] | None:
        tok = self.tokenizer
        if path.endswith("chat/completions"):
            messages = body.get("messages")
            if tok is None or not isinstance(messages, list):
                return None
            # Rendered by the replica's own function, with its tool format, so the hashes agree.
            return chat_token_ids(
                tok,
                raw_messages(messages),
                offered_tools(body),
                self.tool_format,
                body.get("add_generation_prompt") is not False,
            )
        prompt = body.get(_prompt_field(path))
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list):
            prompt = prompt[0]  # several prompts: route by the first
        if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
            return prompt
        if isinstance(prompt, str) and tok is not None:
            return tok.encode(prompt)
        return None

    def hashes(self, path: str, body: dict, adapter: str | None = None) -> tuple[list[int], int]:
        """The prompt's block hashes and about how many tokens it has. Runs on a worker thread.
        A prompt too long for any context is not tokenized: the replica refuses it anyway, and
        tokenizing megabytes would hold a thread for seconds."""
        limit = self.config.route_tokenize_max_chars
        ids = None
        chars = prompt_chars(path, body)
        if chars <= limit:
            try:
                ids = self.prompt_ids(path, body)
            except Exception:  # a prompt the template refuses: the replica will say why
                ids = None
        if ids is not None:
            return self.hash_ids(ids[:limit], adapter), len(ids)
        prompt = body.get("messages") or body.get("prompt") or ""
        if isinstance(prompt, str):
            text = prompt[:limit]
        else:
            text = json.dumps(prompt, sort_keys=True, ensure_ascii=False)[:limit]
        # About four characters a token, for admission's token estimate.
        blocks = hash_blocks(list(text.encode("utf-8", "replace")), TEXT_BLOCK_BYTES, adapter_keys(adapter))
        return blocks, chars // 4
