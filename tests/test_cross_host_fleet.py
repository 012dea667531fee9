"""A fleet across hosts made of network namespaces (shoal.testing.hosts): prefill and decode
workers on two hosts move K/V over TCP (on one host, over shared memory) and give HF's greedy
tokens; the prefill host cut off mid-transfer leaves the decode worker to compute the prompt.
Faults under streaming load: test_cross_host_faults.py."""

from __future__ import annotations

import json
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.conftest import REF_TOKENS
from tests.cross_host_helpers import (
    COMMON_ARGS,
    MODEL,
    STORY,
    decisions,
    finished,
    gateway,
    host_cluster,
    less,
    load,
    on_host,
    samples,
    serve,
    stop_all,
    transfers,
    wait_idle,
    wait_ready,
)
from tests.fleet_helpers import metric
from tests.helpers import PROMPTS, hf_greedy
from tests.server_helpers import ServerProcess

KV_HOLD_TIMEOUT_S = 8.0  # a prefill worker frees K/V nobody pulled (or acknowledged) after this
PD_ARGS = (*COMMON_ARGS, "--quantization", "none", "--kv-hold-timeout", str(KV_HOLD_TIMEOUT_S))
PD_PORTS = {"prefill": 8000, "decode": 8001, "prefill_local": 8002}
# The decode worker gives up a K/V pull past this, and computes the prompt itself.
KV_TRANSFER_TIMEOUT_S = 4.0
PULL_RATE = "16mbit"  # the prefill host's link, for the pull cut midway: 2 MB/s
PULL_TOKENS = 64  # 45 KiB of fp32 K/V a token: ~3 MB, ~1.5 s at PULL_RATE
CUT_AFTER_S = 0.4  # into the pull
# Run on a host: {file in /dev/shm: its first bytes}.
SHM_LISTING = (
    "import json, pathlib; print(json.dumps({p.name: p.read_bytes()[:64].decode(errors='replace') "
    "for p in pathlib.Path('/dev/shm').iterdir() if p.is_file()}))"
)
# Prompts nobody has seen (the decode worker's prefix cache holds PROMPTS after the first test).
ONE_HOST_PROMPTS = [
    "The tallest mountain on Earth is",
    "In the autumn the leaves of the maple trees turn",
    "import numpy as np\n\ndef mean(xs):",
]


@pytest.fixture(scope="module")
def cluster():
    with host_cluster(3) as c:
        yield c


# --- processes -------------------------------------------------------------------------------


# --- P/D across hosts ------------------------------------------------------------------------


@pytest.fixture(scope="class")
def pd(cluster, tmp_path_factory):
    """A prefill worker on h0, a decode worker on h1 and a second prefill worker beside it on
    h1; a gateway over the two hosts' pair, and one over h1's. h1 takes h0's host name for the
    while (and both share the kernel's boot id): only /dev/shm tells the hosts apart."""
    h0, h1 = cluster.hosts[0], cluster.hosts[1]
    h1.check_output(["sh", "-c", f"echo {h0.name} > /proc/sys/kernel/hostname"])
    procs: list[ServerProcess] = []
    try:
        prefill = serve(h0, PD_PORTS["prefill"], "--role", "prefill", *PD_ARGS)
        procs.append(prefill)
        timeout = ("--kv-transfer-timeout", str(KV_TRANSFER_TIMEOUT_S))
        decode = serve(h1, PD_PORTS["decode"], "--role", "decode", *timeout, *PD_ARGS)
        procs.append(decode)
        local = serve(h1, PD_PORTS["prefill_local"], "--role", "prefill", *PD_ARGS)
        procs.append(local)
        wait_ready(procs)
        tmp = tmp_path_factory.mktemp("pd")
        cross = gateway([prefill.url, decode.url], tmp, "cross", disagg_min_prompt_tokens=0)
        procs.append(cross)
        one_host = gateway([local.url, decode.url], tmp, "one-host", disagg_min_prompt_tokens=0)
        procs.append(one_host)
        yield dict(prefill=prefill, decode=decode, local=local, cross=cross, one_host=one_host)
    finally:
        stop_all(procs[::-1])
        h1.check_output(["sh", "-c", f"echo {h1.name} > /proc/sys/kernel/hostname"])


class TestDisaggregationAcrossHosts:
    @staticmethod
    def greedy(gw: ServerProcess, ids: list[int], n: int) -> list[int]:
        body = {"model": MODEL, "prompt": ids, "max_tokens": n, "temperature": 0, "return_token_ids": True}
        r = httpx.post(gw.url + "/v1/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        assert r.headers["x-replica"] == "backend-1"  # the decode worker answers
        out = r.json()
        assert out["usage"]["prompt_tokens"] == len(ids) and out["usage"]["completion_tokens"] == n
        return out["choices"][0]["token_ids"]

    def test_prefill_and_decode_on_two_hosts_move_kv_over_tcp(self, pd, reference):
        gw, prefill, decode = pd["cross"], pd["prefill"], pd["decode"]
        remote, done_p, done_d = decisions(gw, "remote"), finished(prefill.url), finished(decode.url)
        for prompt in PROMPTS:
            ids, tokens, _ = reference[prompt]
            assert self.greedy(gw, ids, len(tokens)) == tokens, prompt
        n = len(PROMPTS)
        assert decisions(gw, "remote") - remote == n  # every prompt computed on the prefill worker
        assert less(finished(prefill.url), done_p) == {"length": n}  # each prompt prefilled once
        assert less(finished(decode.url), done_d) == {"length": n}
        assert metric(decode.url, "shoal:kv_transfer_fallbacks_total") == 0
        assert transfers(decode.url, "tcp") >= n
        text = httpx.get(decode.url + "/metrics", timeout=10).text
        shm = {k: v for k, v in samples(text, "shoal:kv_transfer").items() if 'transport="shm"' in k}
        assert not [k for k, v in shm.items() if v > 0], shm  # not one pull through a /dev/shm it lacks
        sent = 'shoal:kv_transfer_request_bytes_count{direction="sent",transport="tcp"}'
        assert metric(prefill.url, sent) >= n
        for s in (prefill, decode):
            wait_idle(s.url)

    def test_prefill_and_decode_on_one_host_move_kv_through_shared_memory(
        self, pd, cluster, bundled, hf_bundled
    ):
        """The same decode worker, now paired with the prefill worker on its own host."""
        gw, local, decode = pd["one_host"], pd["local"], pd["decode"]
        remote, tcp, shm = decisions(gw, "remote"), transfers(decode.url, "tcp"), transfers(decode.url, "shm")
        done_p, done_d = finished(local.url), finished(decode.url)
        for prompt in ONE_HOST_PROMPTS:
            ids = bundled.tokenizer.encode(prompt)
            tokens, _ = hf_greedy(hf_bundled, ids, REF_TOKENS)
            assert self.greedy(gw, ids, REF_TOKENS) == tokens, prompt
        n = len(ONE_HOST_PROMPTS)
        assert decisions(gw, "remote") - remote == n
        assert metric(decode.url, "shoal:kv_transfer_fallbacks_total") == 0
        assert transfers(decode.url, "shm") - shm == n
        assert transfers(decode.url, "tcp") == tcp
        assert less(finished(local.url), done_p) == less(finished(decode.url), done_d) == {"length": n}
        for s in (local, decode):
            wait_idle(s.url)
        # What is left in h1's /dev/shm: the workers' probes (each file holds its own name), no frame.
        left = json.loads(cluster.hosts[1].check_output([sys.executable, "-c", SHM_LISTING]))
        assert left and all(name == head for name, head in left.items()), left

    def test_the_prefill_host_cut_off_mid_transfer_leaves_the_decode_worker_to_compute_the_prompt(
        self, pd, cluster, bundled, hf_bundled
    ):
        """h0's link capped at PULL_RATE, so that a pull of PULL_TOKENS' K/V takes a while (shown by
        one that arrives whole, in time); then cut CUT_AFTER_S into the next pull. The decode
        worker gives it up after --kv-transfer-timeout and computes the prompt itself: HF's greedy
        tokens all the same. The prefill worker, its K/V never acknowledged, frees it after its
        --kv-hold-timeout."""
        gw, prefill, decode = pd["cross"], pd["prefill"], pd["decode"]
        host = cluster.hosts[0]
        text = " ".join(STORY)  # nobody has seen these (the fleet's prompts come later)
        control, cut = (bundled.tokenizer.encode(f"{lead} {text}")[:PULL_TOKENS] for lead in ("One", "Two"))
        n = 16  # the model ends this prompt (EOS) after 21 tokens; greedy() would stop there
        want, _ = hf_greedy(hf_bundled, cut, n)
        sent = 'shoal:kv_transfer_request_bytes_count{direction="sent",transport="tcp"}'
        pull_s = 'shoal:kv_transfer_duration_seconds_sum{transport="tcp"}'

        def pulls_started() -> float:  # asked on h0 itself: its loopback is neither capped nor cut
            return samples(on_host(host, prefill.url + "/metrics"), sent)[sent]

        remote, done_p, done_d = decisions(gw, "remote"), finished(prefill.url), finished(decode.url)
        fallbacks = samples(
            httpx.get(decode.url + "/metrics", timeout=10).text, "shoal:kv_transfer_fallbacks"
        )
        host.limit(PULL_RATE)
        try:
            tcp, took = transfers(decode.url, "tcp"), metric(decode.url, pull_s)
            self.greedy(gw, control, 1)
            assert transfers(decode.url, "tcp") == tcp + 1
            control_s = metric(decode.url, pull_s) - took
            # Long enough to be cut midway, short enough to arrive in time uncut.
            assert 2 * CUT_AFTER_S < control_s < KV_TRANSFER_TIMEOUT_S - 1, control_s
            with ThreadPoolExecutor(1) as pool:
                before, t0 = pulls_started(), time.monotonic()
                request = pool.submit(self.greedy, gw, cut, n)
                while pulls_started() == before:
                    assert not request.done() and time.monotonic() - t0 < 30, "no pull began"
                t_pull = time.monotonic()
                time.sleep(CUT_AFTER_S)
                host.cut()
                got = request.result(timeout=60)
            answered_s = time.monotonic() - t_pull
        finally:
            host.restore()
            host.limit(None)
        assert got == want
        # It waited out the transfer timeout, then computed the prompt: one fallback, no pull.
        assert KV_TRANSFER_TIMEOUT_S - 0.5 < answered_s < KV_TRANSFER_TIMEOUT_S + 15, answered_s
        now = samples(httpx.get(decode.url + "/metrics", timeout=10).text, "shoal:kv_transfer_fallbacks")
        assert less(now, fallbacks) == {'shoal:kv_transfer_fallbacks_total{reason="timeout"}': 1.0}, now
        assert transfers(decode.url, "tcp") == tcp + 1
        assert decisions(gw, "remote") - remote == 2
        assert less(finished(prefill.url), done_p) == less(finished(decode.url), done_d) == {"length": 2}
        wait_idle(decode.url)
        # The cut pull's K/V, never acknowledged, is held until the hold timeout frees it.
        held = load(prefill.url)["kv_held"]
        wait_idle(prefill.url, timeout=20)
        freed_s = time.monotonic() - t_pull
        print(
            f"pull cut: control pull {control_s:.2f}s, answered {answered_s:.2f}s after the pull began, "
            f"held {held} at restore, freed {freed_s:.1f}s after the pull began"
        )
        assert held == 1 and freed_s < KV_HOLD_TIMEOUT_S + 5, (held, freed_s)
