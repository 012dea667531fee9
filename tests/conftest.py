from __future__ import annotations

import contextlib
import os
import shutil
import tempfile

import pytest
import torch

from shoal.models.loader import bundled_model_path, load_model
from tests.fleet_helpers import FLEET_KEY, POISON_MARKER, start_fleet, start_redis, stop_redis
from tests.helpers import PROMPTS, hf_greedy
from tests.server_helpers import ServerProcess, start_server

REF_TOKENS = 24
SHARED_REPLICA_ARGS = "--kv-cache-memory 256MiB --threads 1"

# Servers and fleets shared by several test modules (session scope) are stopped right after the
# last test that uses them, not at the end of the session: their processes would otherwise idle
# (and poll each other) beside every test that follows. Fixture name -> its process, and
# fixture name -> the node id of its last user in this run.
_STARTED = pytest.StashKey[dict]()
_LAST_USER = pytest.StashKey[dict]()
_STATE_DIR = pytest.StashKey[str]()


def pytest_configure(config):
    """The gateways the tests start keep their state (batch jobs, usage) in a folder of this run's,
    removed after it, not in the user's cache one folder a port."""
    if "SHOAL_STATE_DIR" not in os.environ:
        made = tempfile.mkdtemp(prefix="shoal-test-state-")
        config.stash[_STATE_DIR] = os.environ["SHOAL_STATE_DIR"] = made


def pytest_unconfigure(config):
    made = config.stash.get(_STATE_DIR, None)
    if made is not None:
        shutil.rmtree(made, ignore_errors=True)
        del os.environ["SHOAL_STATE_DIR"]


def pytest_collection_finish(session):
    session.config.stash[_LAST_USER] = {
        name: item.nodeid for item in session.items for name in getattr(item, "fixturenames", ())
    }


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item, nextitem):
    result = yield
    started = item.config.stash.get(_STARTED, {})
    for name, last in item.config.stash.get(_LAST_USER, {}).items():
        if last == item.nodeid and name in started:
            started.pop(name).stop()
    return result


def _shared(request, proc):
    """Registers a session fixture's process to be stopped after its last user."""
    request.config.stash.setdefault(_STARTED, {})[request.fixturename] = proc
    return proc


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    """A failed test's report carries the tail of the log of each server or gateway it used: CI
    keeps only the report, and a gateway's traceback says what the client's error cannot."""
    report = yield
    if report.failed and call.when == "call":
        for name, value in getattr(item, "funcargs", {}).items():
            values = (
                value.values() if isinstance(value, dict) else value if isinstance(value, tuple) else [value]
            )
            for server in (v for v in values if isinstance(v, ServerProcess)):
                with contextlib.suppress(OSError):
                    tail = "\n".join(server.log().splitlines()[-40:])
                    report.sections.append((f"log of {name} ({server.url})", tail))
    return report


@pytest.fixture(scope="session")
def shared_fleet(request):
    """Three replicas of the bundled model (int4, 256 MiB of KV, one thread each) behind `fleet
    up` with an API key (FLEET_KEY), and the crash-on-marker hook armed (only a prompt holding
    POISON_MARKER triggers it): test_fleet's routing and failover tests, test_fleet_crash's crash
    tests and test_fleet_hardening's tests run on it, in that order. Tests that kill or freeze a
    replica wait for it to be ready again before they end."""
    env = {"SHOAL_FAULT_CRASH_ON": POISON_MARKER}
    gw = start_fleet(3, "--replica-args", SHARED_REPLICA_ARGS, api_key=FLEET_KEY, env=env)
    yield _shared(request, gw)
    gw.stop()


@pytest.fixture(scope="session")
def chat_server(request):
    """A plain `shoal serve` of the bundled model (int4, 1024 tokens of context, 256 MiB of KV):
    test_structured_output and test_tool_calls send it requests that do not depend on each other."""
    s = start_server("--max-model-len", "1024", "--kv-cache-memory", "256MiB")
    yield _shared(request, s)
    s.stop()


@pytest.fixture(scope="session")
def redis_store():
    """One redis-server on 127.0.0.1 (Debian's package) for the tests that never stop it, each
    under key prefixes of its own: its URL."""
    if shutil.which("redis-server") is None:
        pytest.skip("no redis-server")
    proc, url = start_redis()
    yield url
    stop_redis(proc)


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
