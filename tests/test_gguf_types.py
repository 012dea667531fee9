"""GGUF files of every supported tensor type load to the same model transformers reads from them.

The tests write a random Llama as GGUF the way llama.cpp's converter does (q/k rows permuted), in
each type; transformers reading the same file is the reference.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf import GGUFWriter, PoolingType
from gguf.quants import quantize

from shoal import LLM, SamplingParams
from shoal.models.loader import load_model
from tests.helpers import add_gguf_tokenizer, assert_matches_hf, assert_pool_whole

HIDDEN, INTER, LAYERS, HEADS, KV_HEADS, VOCAB = 256, 512, 2, 4, 2, 512

# K-quant blocks (256 values): byte offsets of their f16 scale fields, and block size in bytes.
K_QUANTS = {Q.Q4_K: ((0, 2), 144), Q.Q5_K: ((0, 2), 176), Q.Q6_K: ((208,), 210)}


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def encode(w: np.ndarray, qtype: Q, rng: np.random.Generator) -> np.ndarray:
    if qtype == Q.F32:
        return w.astype(np.float32)
    if qtype == Q.F16:
        return w.astype(np.float16)
    if qtype in K_QUANTS:
        # gguf-py cannot quantize K types: random payload with small, finite f16 scales.
        offsets, size = K_QUANTS[qtype]
        blocks = rng.integers(0, 256, (w.shape[0], w.shape[1] // 256, size), dtype=np.uint8)
        for off in offsets:
            scale = np.float16(rng.uniform(2e-4, 6e-4))
            blocks[:, :, off : off + 2] = np.frombuffer(scale.tobytes(), dtype=np.uint8)
        return blocks.reshape(w.shape[0], -1)
    return quantize(w.astype(np.float32), qtype)


def write_gguf(path, qtype: Q, pooling: PoolingType | None = None) -> None:
    rng = np.random.default_rng(0)
    w = GGUFWriter(str(path), "llama")
    if pooling is not None:
        w.add_pooling_type(pooling)
    w.add_block_count(LAYERS)
    w.add_context_length(256)
    w.add_embedding_length(HIDDEN)
    w.add_feed_forward_length(INTER)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    add_gguf_tokenizer(w, VOCAB)

    def mat(rows, cols):
        return rng.normal(0, 0.08, (rows, cols)).astype(np.float32)

    def add(name, arr, raw_type):
        w.add_tensor(name, arr, raw_dtype=raw_type if raw_type not in (Q.F32, Q.F16) else None)

    head_dim = HIDDEN // HEADS
    add("token_embd.weight", encode(mat(VOCAB, HIDDEN), qtype, rng), qtype)
    for i in range(LAYERS):
        add(f"blk.{i}.attn_norm.weight", rng.uniform(0.8, 1.2, HIDDEN).astype(np.float32), Q.F32)
        add(f"blk.{i}.ffn_norm.weight", rng.uniform(0.8, 1.2, HIDDEN).astype(np.float32), Q.F32)
        add(
            f"blk.{i}.attn_q.weight", encode(llama_cpp_permute(mat(HIDDEN, HIDDEN), HEADS), qtype, rng), qtype
        )
        k = llama_cpp_permute(mat(KV_HEADS * head_dim, HIDDEN), KV_HEADS)
        add(f"blk.{i}.attn_k.weight", encode(k, qtype, rng), qtype)
        add(f"blk.{i}.attn_v.weight", encode(mat(KV_HEADS * head_dim, HIDDEN), qtype, rng), qtype)
        add(f"blk.{i}.attn_output.weight", encode(mat(HIDDEN, HIDDEN), qtype, rng), qtype)
        add(f"blk.{i}.ffn_gate.weight", encode(mat(INTER, HIDDEN), qtype, rng), qtype)
        add(f"blk.{i}.ffn_up.weight", encode(mat(INTER, HIDDEN), qtype, rng), qtype)
        add(f"blk.{i}.ffn_down.weight", encode(mat(HIDDEN, INTER), qtype, rng), qtype)
    add("output_norm.weight", np.ones(HIDDEN, dtype=np.float32), Q.F32)
    add("output.weight", encode(mat(VOCAB, HIDDEN), qtype, rng), qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


TYPES = [Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q4_K, Q.Q5_K, Q.Q6_K]


@pytest.mark.parametrize("qtype", TYPES, ids=[t.name for t in TYPES])
def test_gguf_type_matches_transformers(qtype, tmp_path):
    from transformers import AutoModelForCausalLM

    write_gguf(tmp_path / "m.gguf", qtype)
    hf = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file="m.gguf", dtype=torch.float32).eval()
    loaded = load_model(str(tmp_path / "m.gguf"), quantization="none")
    ref_embed = hf.model.embed_tokens.weight
    assert torch.equal(loaded.model.embed_tokens.weight, ref_embed)  # same dequantization
    llm = LLM(loaded=loaded, num_blocks=32)
    prompts = [[5, 9, 200, 31, 7], list(range(40, 77))]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=3))
    assert_matches_hf(hf, prompts, outs, 8)
    assert_pool_whole(llm.engine)


def test_the_conversion_cache_loads_the_same_model(tmp_path, monkeypatch):
    import json
    import os

    cache = tmp_path / "cache"
    monkeypatch.setenv("SHOAL_CACHE_DIR", str(cache))
    path = tmp_path / "m.gguf"
    write_gguf(path, Q.Q4_K, PoolingType.MEAN)
    cold = load_model(str(path))
    assert len(list(cache.iterdir())) == 1
    warm = load_model(str(path))  # read back from the cache
    a, b = cold.model.state_dict(), warm.model.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert cold.config == warm.config and warm.config.pooling == "mean"  # as the file's metadata says
    text = "some text 42"
    assert cold.tokenizer.encode(text) == warm.tokenizer.encode(text)
    assert cold.tokenizer.eos_token_ids == warm.tokenizer.eos_token_ids
    from shoal.models.gguf_cache import _entry

    # A changed file is a new entry, which replaces the old one; so does a new cache format, even
    # from an entry that predates entries naming their source. Another file's entry stays.
    other = tmp_path / "other.gguf"
    write_gguf(other, Q.Q4_K, PoolingType.MEAN)
    load_model(str(other))
    old = _entry(path, torch.float32)
    st = path.stat()
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    (old.parent / "m-0123456789abcdef0123").mkdir()  # an older format's, without its source
    (old.parent / "m-0123456789abcdef0123" / "blocks.json").write_text("{}")
    load_model(str(path))
    current = _entry(path, torch.float32)
    assert current != old
    entries = sorted([current.name, _entry(other, torch.float32).name])
    assert sorted(e.name for e in cache.iterdir()) == entries
    # Beside an entry read back: an older shoal's entry of this file goes, and one of another file
    # whose name begins with this one's stays.
    for name in ("m-0123456789abcdef0123", "m-2-0123456789abcdef0123"):
        (cache / name).mkdir()
        (cache / name / "blocks.json").write_text("{}")
    load_model(str(path))
    entries = sorted([*entries, "m-2-0123456789abcdef0123"])
    assert sorted(e.name for e in cache.iterdir()) == entries
    (current / "config.json").write_text("{broken")  # a broken entry is dropped and rebuilt
    assert load_model(str(path)).config == cold.config
    assert json.loads((current / "config.json").read_text())["vocab_size"] == VOCAB
    monkeypatch.setenv("SHOAL_NO_CACHE", "1")
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 2 * 10**9))
    load_model(str(path))
    assert sorted(e.name for e in cache.iterdir()) == entries  # nothing written, nothing removed
