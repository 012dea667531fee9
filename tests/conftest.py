from __future__ import annotations

import os

import pytest
import torch

from shoal.models.loader import bundled_model_path, load_model
from tests.helpers import PROMPTS, hf_greedy

REF_TOKENS = 24


@pytest.fixture(scope="session", autouse=True)
def _threads():
    torch.set_num_threads(2)


@pytest.fixture(scope="session", autouse=True)
def _converted_model_cache(tmp_path_factory):
    """The session's own GGUF conversion cache: the first load fills it, the servers the tests
    start read it (so they come up fast, and run the cached path the HF checks then verify)."""
    os.environ["SHOAL_CACHE_DIR"] = str(tmp_path_factory.mktemp("shoal-cache"))


@pytest.fixture(scope="session")
def bundled():
    """shoal's unquantized (fp32) load of the bundled GGUF, the one compared token for token with
    HF; shared by every engine built in the session."""
    return load_model(quantization="none")


@pytest.fixture(scope="session")
def hf_bundled():
    from transformers import AutoModelForCausalLM

    path = bundled_model_path()
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    return model.eval()


@pytest.fixture(scope="session")
def reference(bundled, hf_bundled):
    """HF fp32 greedy continuations of PROMPTS, computed once: {prompt: (prompt ids, tokens, logprobs)}."""
    ref = {}
    for p in PROMPTS:
        ids = bundled.tokenizer.encode(p)
        tokens, logprobs = hf_greedy(hf_bundled, ids, REF_TOKENS)
        ref[p] = (ids, tokens, logprobs)
    return ref
