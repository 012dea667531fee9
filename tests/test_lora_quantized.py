"""A LoRA adapter over the int4 and int8 bases of the bundled model, against HF fp32 with peft
applying the same adapter: held in float16 (`--lora-dtype auto`), it stays within the agreement
documented for that base mode alone (README: Quantization), measured as
tests/test_quantization.py measures it. (Over fp32 weights, tests/test_lora_server.py checks
HF's tokens exactly.)"""

from __future__ import annotations

import pytest

from shoal.llm import LLM
from shoal.models.loader import load_model
from tests.conftest import REF_TOKENS
from tests.helpers import PROMPTS, closeness_to_reference, describe_closeness, hf_greedy
from tests.test_lora_server import make_adapter

pytest.importorskip("peft")

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# The base modes' own bars (tests/test_quantization.py), for the model with the adapter applied.
AGREEMENT = {"int4": 0.95, "int8": 0.85}
MEAN_PREFIX = {"int4": 10, "int8": 3}


@pytest.fixture(scope="module")
def adapted(tmp_path_factory, hf_bundled, bundled, reference):
    """An adapter on every projection, and HF's greedy continuations under it."""
    path = tmp_path_factory.mktemp("quantized-lora") / "adapter"
    hf = make_adapter(hf_bundled, path, seed=21, targets=TARGETS, rank=8, std=0.03)
    ref = {}
    for p in PROMPTS:
        ids = bundled.tokenizer.encode(p)
        tokens, logprobs = hf_greedy(hf, ids, REF_TOKENS)
        ref[p] = (ids, tokens, logprobs)
    changed = sum(ref[p][1] != reference[p][1] for p in PROMPTS)
    assert changed >= len(PROMPTS) // 2, changed  # the adapter does change what the model says
    return path, ref


@pytest.mark.parametrize("method", ["int4", "int8"])
def test_an_adapter_over_each_base_mode_stays_as_close_to_hf_as_that_mode_does(method, adapted):
    path, ref = adapted
    llm = LLM(loaded=load_model(quantization=method), enable_lora=True, lora_modules={"adapter": str(path)})
    c = closeness_to_reference(llm, ref, REF_TOKENS, lora="adapter")
    print("\n" + describe_closeness(f"{method} base + adapter", c, REF_TOKENS))
    assert c["agreement"] >= AGREEMENT[method]
    assert c["mean_error"] < 0.2
    assert c["mean_prefix"] >= MEAN_PREFIX[method]
