"""LoRA adapters (PEFT's format) on random checkpoints, against HF transformers with peft applying
the same adapter: each row of a batch that mixes several adapters and the base model gets the
tokens and logprobs HF gives that adapter alone; more adapters than slots cycle through them; two
adapters never share K/V; adapters that do not fit the model are refused with the reason."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from shoal.engine.cpu_decode import CpuFusedDecoder
from shoal.engine.request_checks import RequestRejectedError
from shoal.engine.sampling_params import SamplingParams
from shoal.kernels.cpu import cpu_kernels
from shoal.llm import LLM
from shoal.models.loader import load_model
from shoal.models.lora import AdapterError
from shoal.models.lora_layers import LoRABatch, LoRAStack
from tests.helpers import assert_pool_whole, hf_greedy
from tests.test_hf_parity import _check_logprobs, make_random_checkpoint

peft = pytest.importorskip("peft")

NEW_TOKENS = 10
# name -> (rank, alpha, target modules, rslora)
ADAPTERS = {
    "all": (8, 16, ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"], False),
    "attn": (16, 8, ["q_proj", "v_proj"], True),
    "mlp": (4, 8, ["gate_proj", "up_proj", "down_proj"], False),
    "kv_o": (8, 32, ["k_proj", "v_proj", "o_proj"], False),
}


def make_adapter(hf_model, path, name: str, seed: int) -> None:
    """A random adapter (A and B both random, so it changes the output) saved as PEFT saves it."""
    rank, alpha, targets, rslora = ADAPTERS[name]
    config = peft.LoraConfig(
        r=rank, lora_alpha=alpha, target_modules=targets, use_rslora=rslora, init_lora_weights=False
    )
    torch.manual_seed(seed)
    model = peft.get_peft_model(hf_model, config)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_" in n:
                p.normal_(0, 0.05)
    model.save_pretrained(path)
    model.unload()  # the base model without the adapter's layers, for the next one


def reference(base_dir, adapter_dir, prompts) -> list[tuple[list[int], torch.Tensor]]:
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(base_dir, torch_dtype=torch.float32).eval()
    if adapter_dir is not None:
        hf = peft.PeftModel.from_pretrained(hf, adapter_dir).eval()
    return [hf_greedy(hf, p, NEW_TOKENS) for p in prompts]


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def setup(request, tmp_path_factory):
    """A random checkpoint, four adapters for it, and HF's greedy tokens for each prompt under
    each adapter (and under none)."""
    root = tmp_path_factory.mktemp(f"lora-{request.param}")
    base = root / "base"
    hf = make_random_checkpoint(request.param, base)
    dirs = {}
    for i, name in enumerate(ADAPTERS):
        dirs[name] = root / name
        make_adapter(hf, dirs[name], name, seed=10 + i)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(2, 512, (n,), generator=g).tolist() for n in (6, 19, 33)]
    refs = {None: reference(base, None, prompts)}
    for name, d in dirs.items():
        refs[name] = reference(base, d, prompts)
    return base, dirs, prompts, refs


def engine(base, dirs, **options) -> LLM:
    options = {"num_blocks": 128, "max_num_batched_tokens": 256, **options}
    modules = {name: str(d) for name, d in dirs.items()}
    return LLM(loaded=load_model(str(base)), enable_lora=True, lora_modules=modules, **options)


PARAMS = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=5)


def check(outs, wanted) -> None:
    for out, (tokens, logprobs) in zip(outs, wanted, strict=True):
        assert out.outputs[0].token_ids == tokens
        _check_logprobs(out.outputs[0], logprobs)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("rows", [1, 7, 40])
def test_the_c_kernel_and_the_segmented_torch_product_match_a_float64_reference(rows, dtype):
    kernels = cpu_kernels()
    if kernels is None:
        pytest.skip("no CPU kernels here")
    g = torch.Generator().manual_seed(rows)
    fan_in, fan_out, offset = 72, 52, 3  # not multiples of the vector widths; a part inside a wider output
    stack = LoRAStack(5, 16, fan_in, fan_out, dtype, "cpu")  # float16: the weights as held, rounded
    for slot, rank in [(1, 16), (2, 4), (4, 9)]:  # slot 3: an adapter that leaves this module alone
        stack.put(slot, torch.randn(rank, fan_in, generator=g), torch.randn(fan_out, rank, generator=g))
    stack.put(3, None, None)
    x = torch.randn(rows, fan_in, generator=g)
    row_slots = torch.randint(0, 5, (rows,), generator=g)
    row_slots[0] = 1
    base = torch.randn(rows, offset + fan_out + 5, generator=g)
    want = base.double()
    for i, s in enumerate(row_slots.tolist()):
        r = int(stack.ranks[s])
        if s and r:
            delta = stack.b[s, :r].double().t() @ (stack.a[s, :r].double() @ x[i].double())
            want[i, offset : offset + fan_out] += delta
    params = kernels.lora_params(stack.a, stack.b, stack.ranks, offset)
    got = base.clone()
    kernels.lora_apply(params, x, row_slots, got)
    batch = LoRABatch()
    batch.set_rows(row_slots.tolist(), torch.device("cpu"))
    by_torch = base.clone()
    stack.add_torch(x, by_torch, offset, batch.segments())
    for y in (got, by_torch):
        torch.testing.assert_close(y.double(), want, rtol=1e-5, atol=1e-5 * want.abs().max().item())
    untouched = (row_slots == 0) | (row_slots == 3)
    assert torch.equal(got[untouched], base[untouched])
    assert torch.equal(got[:, :offset], base[:, :offset]) and torch.equal(
        got[:, offset + fan_out :], base[:, -5:]
    )
    for i in range(rows):  # a row's bits do not depend on the rows beside it
        alone = base[i : i + 1].clone()
        kernels.lora_apply(params, x[i : i + 1], row_slots[i : i + 1], alone)
        assert torch.equal(alone, got[i : i + 1])


def test_one_batch_mixing_four_adapters_and_the_base_gives_each_row_its_own(setup):
    base, dirs, prompts, refs = setup
    llm = engine(base, dirs, max_loras=4)
    if cpu_kernels() is not None:  # the decode steps run the fused C layer, adapters included
        assert isinstance(llm.engine.core.executor.runner.fused_decoder, CpuFusedDecoder)
    names = [None, *ADAPTERS]
    # Every adapter (and the base) on every prompt, all in one batch.
    batch = [(name, i) for name in names for i in range(len(prompts))]
    outs = llm.generate([prompts[i] for _, i in batch], PARAMS, lora=[name for name, _ in batch])
    for (name, i), out in zip(batch, outs):
        check([out], [refs[name][i]])
    # The adapters do change the output: no row's tokens equal the base model's everywhere.
    for name in ADAPTERS:
        assert [refs[name][i][0] for i in range(len(prompts))] != [refs[None][i][0] for i in range(3)]
    assert_pool_whole(llm.engine)
    manager = llm.engine.core.lora
    assert manager.users == {} and set(manager.idle) == set(ADAPTERS)
    # n > 1: the forked choices run with their parent's adapter, and give its slot back too.
    forked = SamplingParams(n=2, temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    out = llm.generate([prompts[1]], forked, lora="mlp")[0]
    assert [c.token_ids for c in out.outputs] == [refs["mlp"][1][0]] * 2
    assert manager.users == {}
    assert_pool_whole(llm.engine)


def test_more_adapters_than_slots_cycle_through_them(setup):
    base, dirs, prompts, refs = setup
    llm = engine(base, dirs, max_loras=2, max_num_seqs=4)
    names = [name for name in ADAPTERS for _ in range(2)] + [None, None]
    outs = llm.generate([prompts[k % 3] for k in range(len(names))], PARAMS, lora=names)
    for k, (name, out) in enumerate(zip(names, outs)):
        check([out], [refs[name][k % 3]])
    manager = llm.engine.core.lora
    assert sum(manager.loads.values()) >= 4 and sum(manager.evictions.values()) >= 2
    assert manager.users == {} and len(manager.slot_of) <= 2
    assert_pool_whole(llm.engine)
    # Again, one at a time: each loads into a slot another left.
    for k, name in enumerate(ADAPTERS):
        check(llm.generate([prompts[k % 3]], PARAMS, lora=name), [refs[name][k % 3]])


def test_a_request_waiting_for_a_slot_does_not_hold_up_the_requests_behind_it(setup):
    base, dirs, prompts, refs = setup
    llm = engine(base, dirs, max_loras=1)
    e = llm.engine
    e.add_request(
        "long", prompts[0], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True), lora="all"
    )
    e.step()  # admitted: its adapter holds the only slot
    e.add_request("other-adapter", prompts[1], PARAMS, lora="attn")  # no slot until "long" ends
    e.add_request("base", prompts[2], PARAMS)
    done, outs = [], {}
    while e.has_unfinished_requests():
        for out in e.step():
            if out.finished:
                done.append(out.request_id)
                outs[out.request_id] = out
    assert done == ["base", "long", "other-adapter"]
    check([outs["base"], outs["other-adapter"]], [refs[None][2], refs["attn"][1]])
    assert outs["long"].outputs[0].token_ids[:NEW_TOKENS] == refs["all"][0][0]
    assert llm.engine.core.lora.users == {}
    assert_pool_whole(llm.engine)


def test_two_adapters_never_share_kv_and_one_reuses_its_own(setup):
    base, dirs, prompts, refs = setup
    llm = engine(base, dirs, max_loras=2, block_size=4)
    prompt = prompts[2]  # 33 tokens: 8 full blocks
    first = llm.generate([prompt], PARAMS, lora="all")[0]
    other = llm.generate([prompt], PARAMS, lora="attn")[0]
    again = llm.generate([prompt], PARAMS, lora="all")[0]
    base_out = llm.generate([prompt], PARAMS)[0]
    assert first.num_cached_tokens == 0
    assert other.num_cached_tokens == 0  # the same tokens, another adapter: nothing reused
    assert again.num_cached_tokens == 32  # its own blocks
    assert base_out.num_cached_tokens == 0
    check([first, other, again, base_out], [refs["all"][2], refs["attn"][2], refs["all"][2], refs[None][2]])


def test_adapters_that_do_not_fit_are_refused_with_the_reason(setup, tmp_path):
    base, dirs, prompts, _ = setup
    llm = engine(base, {"all": dirs["all"]}, max_loras=1, max_lora_rank=8)
    core = llm.engine.core
    with pytest.raises(RequestRejectedError, match="'nope' does not exist"):
        llm.generate([prompts[0]], PARAMS, lora="nope")
    with pytest.raises(AdapterError, match="rank 16 is above --max-lora-rank 8"):
        core.adapters().add("attn", str(dirs["attn"]))
    # An adapter trained on a model of another shape.
    other = tmp_path / "other-base"
    hf = make_random_checkpoint("llama", other, hidden_size=48, num_attention_heads=3, num_key_value_heads=1)
    make_adapter(hf, tmp_path / "misfit", "mlp", seed=1)
    with pytest.raises(AdapterError, match="trained on another model"):
        core.adapters().add("misfit", str(tmp_path / "misfit"))
    dora = tmp_path / "dora"
    shutil.copytree(dirs["mlp"], dora)
    config = json.loads((dora / "adapter_config.json").read_text())
    (dora / "adapter_config.json").write_text(json.dumps({**config, "use_dora": True}))
    with pytest.raises(AdapterError, match="DoRA"):
        core.adapters().add("dora", str(dora))
    with pytest.raises(AdapterError, match=r"no adapter_config\.json"):
        core.adapters().add("empty", str(tmp_path))
    # None of it changed what is served.
    assert core.adapters().names == ["all"]
    check(llm.generate([prompts[0]], PARAMS, lora="all"), [setup[3]["all"][0]])
