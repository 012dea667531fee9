"""Shared checks and builders for the tests."""

from __future__ import annotations

from pathlib import Path

import torch

from shoal.engine.core import EngineCore
from shoal.engine.llm_engine import LLMEngine
from shoal.engine.sampling_params import SamplingParams

PROMPTS = [
    "The capital of France is",
    "Once upon a time, in a small village by the sea, there lived an old fisherman who",
    "def fibonacci(n):",
    "Water boils at",
    "The three primary colors are red, yellow and blue. When you mix red and yellow you get",
    "Q: What is the largest planet in our solar system?\nA:",
    "Photosynthesis is the process by which plants convert sunlight, water and carbon dioxide into "
    "glucose and oxygen. It takes place mainly in the leaves, inside organelles called chloroplasts, which "
    "contain the green pigment chlorophyll. The overall reaction can be summarised as",
    "Hello",
]


def assert_pool_whole(engine: LLMEngine | EngineCore) -> None:
    """No request holds a block, every ref count is zero, and the free list holds every block once."""
    kv = engine.core.kv if isinstance(engine, LLMEngine) else engine.kv
    pool = kv.pool
    assert not kv.tables, f"block tables left: {list(kv.tables)}"
    assert all(b.ref_cnt == 0 for b in pool.blocks)
    free = list(pool.free_queue)
    assert len(free) == pool.num_free_blocks == pool.num_blocks
    assert len({b.block_id for b in free}) == pool.num_blocks
    for h, b in pool.cached.items():
        assert b.block_hash == h
    assert not engine.has_unfinished_requests()


def run_to_completion(engine: LLMEngine, max_steps: int = 10_000) -> dict:
    """Steps until idle; returns the final RequestOutput per request id."""
    done = {}
    for _ in range(max_steps):
        if not engine.has_unfinished_requests():
            return done
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    raise AssertionError("engine did not finish")


def write_tokenizer(path: Path, vocab_size: int) -> None:
    """A small byte-level BPE tokenizer.json, so random checkpoints load like real ones."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(["hello world, the quick brown fox jumps over the lazy dog"] * 20, trainer)
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text('{"bos_token": "<s>", "eos_token": "</s>"}')


def add_gguf_tokenizer(writer, vocab_size: int) -> None:
    """A GGUF's tokenizer metadata for test files: byte-level BPE over tokens t0, t1, ..., no merges."""
    writer.add_vocab_size(vocab_size)
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list([f"t{i}" for i in range(vocab_size)])
    writer.add_token_types([1] * vocab_size)
    writer.add_token_merges([])
    writer.add_bos_token_id(0)
    writer.add_eos_token_id(1)


def hf_greedy(model, prompt_ids: list[int], max_new_tokens: int) -> tuple[list[int], torch.Tensor]:
    """HF greedy continuation of one unpadded prompt, EOS treated as any other token.

    Returns (tokens, log-probs per step [n, V]). A plain loop over HF's own KV cache: generate()
    would ban EOS under min_new_tokens, which ignore_eos does not do.
    """
    tokens, logprobs = [], []
    ids = torch.tensor([prompt_ids], device=model.device)
    past = None
    with torch.inference_mode():
        for _ in range(max_new_tokens):
            out = model(input_ids=ids, past_key_values=past, use_cache=True)
            past = out.past_key_values
            lp = torch.log_softmax(out.logits[0, -1].float(), dim=-1)
            token = int(lp.argmax())
            tokens.append(token)
            logprobs.append(lp)
            ids = torch.tensor([[token]], device=model.device)
    return tokens, torch.stack(logprobs).cpu()


def assert_matches_hf(hf, prompts, outs, new_tokens: int, atol: float = 2e-3) -> None:
    """Each output's greedy tokens are HF's, and its top log-probs HF's within `atol`."""
    for prompt, out in zip(prompts, outs, strict=True):
        ref_tokens, ref_logprobs = hf_greedy(hf, prompt, new_tokens)
        assert out.outputs[0].token_ids == ref_tokens
        for step, lp in enumerate(out.outputs[0].logprobs):
            for token_id, value in lp.top:
                assert abs(value - float(ref_logprobs[step, token_id])) < atol


def closeness_to_reference(llm, reference: dict, new_tokens: int, lora: str | None = None) -> dict:
    """How close `llm` (with the LoRA adapter `lora`, if given) stays to HF fp32 on PROMPTS.
    Teacher-forced on HF's greedy continuations: the share of positions where its top token is HF's,
    and |its logprob of HF's token - HF's|. Free running: how many first tokens of its own greedy
    continuation match HF's."""
    agree = total = 0
    errors, prefixes = [], []
    for prompt in PROMPTS:
        ids, tokens, logprobs = reference[prompt]
        forced = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1)
        out = llm.generate(ids + tokens, forced, lora=lora)[0]
        for j, (tok, ref_lp) in enumerate(zip(tokens, logprobs)):
            lp = out.prompt_logprobs[len(ids) + j]
            assert lp.token_id == tok
            agree += lp.top[0][0] == tok
            total += 1
            errors.append(abs(lp.logprob - float(ref_lp[tok])))
        params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
        greedy = llm.generate(ids, params, lora=lora)[0]
        got = greedy.outputs[0].token_ids
        prefixes.append(next((j for j, (a, b) in enumerate(zip(got, tokens)) if a != b), len(tokens)))
    return {
        "agreement": agree / total,
        "mean_error": sum(errors) / len(errors),
        "max_error": max(errors),
        "mean_prefix": sum(prefixes) / len(prefixes),
        "whole": prefixes.count(new_tokens),
    }


def describe_closeness(label: str, c: dict, new_tokens: int) -> str:
    return (
        f"{label}: top-1 agreement {c['agreement']:.3f}, mean |dlogprob| {c['mean_error']:.4f}, "
        f"max {c['max_error']:.3f}; greedy continuations match HF for {c['mean_prefix']:.1f} of "
        f"{new_tokens} tokens on average, {c['whole']}/{len(PROMPTS)} whole"
    )
