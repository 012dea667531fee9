"""Tensor and pipeline parallelism across hosts made of network namespaces (shoal.testing.hosts):
each rank on a host of its own, with its own address, hostname and /dev/shm, reached over a
bridge; the driver in this process on the bridge's address. Greedy output is HF's, and ranks
sum through shared memory only when they really share /dev/shm."""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from shoal import SamplingParams
from shoal.engine.parallel.worker import AUTHKEY_ENV
from shoal.llm import LLM
from shoal.models.checkpoint import bundled_model_path
from tests.conftest import REF_TOKENS
from tests.cross_host_helpers import host_cluster
from tests.helpers import PROMPTS


@pytest.fixture(scope="module")
def cluster():
    with host_cluster(3) as c:
        yield c


@pytest.fixture
def hidden_dir():
    """A folder in this namespace's /tmp that no test host sees (they see the session's only)."""
    path = tempfile.mkdtemp(prefix="shoal-only-here-", dir="/tmp")
    yield Path(path)
    shutil.rmtree(path)


def own_caches(under: Path, ranks: int) -> list[dict[str, str]]:
    """Each rank a cache of its own holding only the session's built kernels: what a model fetched
    from the driver goes there, and two ranks never race to write one."""
    kernels = Path(os.environ["SHOAL_CACHE_DIR"]) / "kernels"
    envs = []
    for r in range(ranks):
        cache = under / f"cache-rank{r}"
        if kernels.is_dir():
            shutil.copytree(kernels, cache / "kernels")
        cache.mkdir(exist_ok=True)
        envs.append({"SHOAL_CACHE_DIR": str(cache)})
    return envs


def free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def ranks_on(
    cluster, hosts: list[int], driver: str, key: str, logs: list | None, envs: list[dict] | None
) -> list[subprocess.Popen]:
    cmd = [sys.executable, "-m", "shoal.cli", "worker", "--driver", driver]
    out = [{"stderr": log} for log in logs] if logs else [{}] * len(hosts)
    envs = envs or [{}] * len(hosts)
    return [
        cluster.hosts[h].run(
            [*cmd, "--rank", str(rank)], env={**os.environ, AUTHKEY_ENV: key, **envs[rank]}, **out[rank]
        )
        for rank, h in enumerate(hosts)
    ]


def split_engine(
    cluster, hosts: list[int], logs: list | None = None, envs: list[dict] | None = None, **split
) -> tuple[LLM, list[subprocess.Popen]]:
    """A driver here, its ranks started by hand on `hosts` (rank r on hosts[r], with envs[r])."""
    key = secrets.token_hex(16)
    address = cluster.gateway_address
    port = free_port(address)
    procs = ranks_on(cluster, hosts, f"{address}:{port}", key, logs, envs)
    os.environ[AUTHKEY_ENV] = key
    try:
        llm = LLM(
            **{"quantization": "none", **split},
            num_blocks=128,
            launch_workers=False,
            distributed_host=address,
            distributed_port=port,
            startup_timeout_s=240,
        )
    except BaseException:
        for p in procs:
            p.kill()
        raise
    finally:
        del os.environ[AUTHKEY_ENV]
    return llm, procs


def greedy_tokens(llm: LLM, reference: dict, prompts: list[str] = PROMPTS) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=REF_TOKENS, ignore_eos=True)
    outs = llm.generate([reference[p][0] for p in prompts], params)
    return [o.outputs[0].token_ids for o in outs]


@contextlib.contextmanager
def named(host, name: str):
    """The host calls itself `name` for a while (two hosts of one name: only /dev/shm differs)."""
    host.check_output(["sh", "-c", f"echo {name} > /proc/sys/kernel/hostname"])
    try:
        yield
    finally:
        host.check_output(["sh", "-c", f"echo {host.name} > /proc/sys/kernel/hostname"])


@pytest.mark.parametrize(
    "split, hosts, collectives",
    [
        (dict(tensor_parallel_size=2), [0, 1], "torch"),
        (dict(pipeline_parallel_size=2), [1, 2], None),
        (dict(tensor_parallel_size=3), [0, 1, 2], "torch"),
        (dict(tensor_parallel_size=2), [2, 2], "shm"),  # one host: its /dev/shm is shared
    ],
    ids=["tp2-two-hosts", "pp2-two-hosts", "tp3-three-hosts", "tp2-one-host"],
)
def test_ranks_across_hosts_give_hfs_greedy_tokens(cluster, reference, split, hosts, collectives):
    """TP=2's two hosts share a host name: the transport is chosen by a probe of /dev/shm, not by
    the name (by the name, they would have summed through a /dev/shm they do not share)."""
    twin = cluster.hosts[1]
    with named(twin, cluster.hosts[0].name) if hosts == [0, 1] else contextlib.nullcontext():
        llm, procs = split_engine(cluster, hosts, **split)
        try:
            info = llm.engine.core.executor.ranks_info
            assert [r["address"] for r in info] == [cluster.hosts[h].address for h in hosts]
            names = [cluster.hosts[0 if h == 1 and hosts == [0, 1] else h].name for h in hosts]
            assert [r["host"] for r in info] == names
            assert {r["collectives"] for r in info} == {collectives}
            assert greedy_tokens(llm, reference) == [reference[p][1] for p in PROMPTS]
        finally:
            llm.shutdown()
            for p in procs:
                try:
                    assert p.wait(30) == 0  # told to stop by the driver
                finally:
                    p.kill()


def test_ranks_on_hosts_without_the_model_fetch_it_from_the_driver_once(
    cluster, reference, tmp_path, hidden_dir
):
    """The model sits only in this namespace's /tmp (each host has its own /tmp): the ranks fetch
    it from the driver over their authenticated connections into their own caches, and a second
    start reads those caches instead."""
    model = hidden_dir / "only-here.gguf"
    envs = own_caches(tmp_path, 2)
    shutil.copyfile(bundled_model_path(), model)
    for host in cluster.hosts[:2]:
        assert host.check_output(["sh", "-c", f"test -e {model} && echo yes || echo no"]).strip() == "no"
    for attempt in range(2):
        paths = [tmp_path / f"rank{r}-{attempt}.log" for r in range(2)]
        with contextlib.ExitStack() as stack:
            logs = [stack.enter_context(open(p, "w")) for p in paths]
            llm, procs = split_engine(cluster, [0, 1], logs, envs, tensor_parallel_size=2, model=str(model))
            try:
                assert greedy_tokens(llm, reference, PROMPTS[:2]) == [reference[p][1] for p in PROMPTS[:2]]
            finally:
                llm.shutdown()
                for p in procs:
                    p.kill()
                    p.wait()
        fetched = ["fetching it from the driver" in p.read_text() for p in paths]
        assert fetched == [attempt == 0] * 2, fetched


def test_experts_traded_by_all_to_all_across_hosts_answer_as_hf(cluster, tmp_path, hidden_dir):
    """Expert parallelism over two hosts: each rank routes its share of a step's tokens and trades
    them with the other's experts through gloo's all-to-all (the hosts share no /dev/shm); the
    checkpoint lives only here, so the ranks fetch it from the driver first."""
    import torch

    from tests.helpers import assert_matches_hf
    from tests.test_moe import LOGPROB_ATOL, write_checkpoint

    model = hidden_dir / "moe"
    model.mkdir()
    heads = dict(hidden_size=96, num_attention_heads=6, num_key_value_heads=3, moe_intermediate_size=64)
    hf = write_checkpoint("qwen2_moe", model, False, **heads)
    g = torch.Generator().manual_seed(6)
    prompts = [torch.randint(2, 512, (n,), generator=g).tolist() for n in (5, 19, 40)]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=5)
    split = dict(expert_parallel_size=2, expert_dispatch="all-to-all", model=str(model))
    llm, procs = split_engine(cluster, [0, 1], envs=own_caches(tmp_path, 2), **split)
    try:
        info = llm.engine.core.executor.ranks_info
        assert [(r["collectives"], r["expert_dispatch"]) for r in info] == [("torch", "all-to-all")] * 2
        outs = llm.generate(prompts, params)
    finally:
        llm.shutdown()
        for p in procs:
            p.kill()
            p.wait()
    assert_matches_hf(hf, prompts, outs, 8, LOGPROB_ATOL)
