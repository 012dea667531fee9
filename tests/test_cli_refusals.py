"""Every command refuses a setting out of range with one line naming it and exit status 2, before
it starts a process, loads a model or binds a port (the class `shoal sim` and `shoal plan` were
mended for in test_sim_cli.py; here `serve`, `fleet`, `gateway`, `index`, `worker`, `generate` and
`chat`). Flags that set a config's field are checked by the config itself, so a TOML file or a
Python caller is refused alike."""

from __future__ import annotations

import dataclasses

import pytest

from shoal.cli import main

NO_MODEL = "/nonexistent/model.gguf"  # had a command loaded it first, this would be its error
UP = ["fleet", "up", "--replicas", "1"]
GATEWAY = ["gateway", "--backend", "http://127.0.0.1:9"]
BUILD = ["index", "build", "--input", "a", "--out", "b"]
SHARD = ["index", "serve", "shard-0"]


def exit_status(argv: list[str]) -> int:
    try:
        return main(argv)
    except SystemExit as exit_:  # argparse's refusal
        return exit_.code


@pytest.mark.parametrize(
    ("argv", "said"),
    [
        # plain flags, typed at parsing
        (["fleet", "up", "--replicas", "0"], "argument --replicas: 0 is below 1"),
        (["fleet", "up", "--replicas", "two"], "argument --replicas: 'two' is not a whole number"),
        (["fleet", "up", "--prefill", "-1", "--decode", "1"], "argument --prefill: -1 is below 1"),
        ([*UP, "--cores-per-replica", "0"], "argument --cores-per-replica: 0 is below 1"),
        ([*UP, "--launcher", "ray", "--ray-cpus-per-replica", "nan"], "--ray-cpus-per-replica: nan"),
        (["fleet", "update", "--canary", "1.5"], "argument --canary: 1.5 is above 1"),
        (["fleet", "update", "--canary", "-0.1"], "argument --canary: -0.1 is not at least 0"),
        (["fleet", "update", "--canary-seconds", "-1"], "argument --canary-seconds: -1 is not at least 0"),
        (["fleet", "update", "--shadow", "inf"], "argument --shadow: inf is above 1"),
        ([*BUILD, "--shards", "0"], "argument --shards: 0 is below 1"),
        ([*BUILD, "--nlist", "-4"], "argument --nlist: -4 is below 0"),
        ([*BUILD, "--hnsw-m", "1"], "argument --hnsw-m: 1 is below 2"),
        ([*SHARD, "--port", "99999"], "argument --port: 99999 is above 65535"),
        ([*SHARD, "--recall-probe-interval", "-1"], "--recall-probe-interval: -1 is not"),
        (["worker", "--driver", "127.0.0.1:1", "--rank", "-1"], "argument --rank: -1 is below 0"),
        # a fleet's and a gateway's configs
        ([*UP, "--base-port", "-5"], "base_port must be at least 0, not -5"),
        ([*UP, "--port", "65536"], "port must be at most 65535, not 65536"),
        ([*UP, "--max-replicas", "3", "--target-inflight", "0"], "target_inflight must be above 0"),
        ([*UP, "--scale-down-delay", "-1", "--max-replicas", "3"], "scale_down_delay_s must be at least 0"),
        ([*UP, "--disagg-min-prompt-tokens", "-1"], "disagg_min_prompt_tokens must be at least 0"),
        ([*GATEWAY, "--port", "-1"], "port must be at least 0, not -1"),
        ([*GATEWAY, "--shutdown-timeout", "nan"], "shutdown_timeout_s must be at least 0, not nan"),
        ([*GATEWAY, "--max-request-bytes", "0"], "max_body_bytes must be at least 1, not 0"),
        ([*GATEWAY, "--policy", "bogus"], "argument --policy: invalid choice: 'bogus'"),
        # a server's and an engine's configs
        (["serve", NO_MODEL, "--port", "123456"], "port must be at most 65535, not 123456"),
        (["serve", NO_MODEL, "--distributed-port", "65535"], "distributed_port must be at most 65534"),
        (["serve", NO_MODEL, "--max-num-seqs", "0"], "max_num_seqs must be at least 1, not 0"),
        (["serve", NO_MODEL, "--max-num-batched-tokens", "-1"], "max_num_batched_tokens must be at least 1"),
        (["serve", NO_MODEL, "--threads", "0"], "num_threads must be at least 1, not 0"),
        (["serve", NO_MODEL, "--block-size", "0"], "block_size must be at least 1, not 0"),
        (["serve", NO_MODEL, "--kv-cache-memory", "0"], "kv_cache_memory must be at least 1, not 0"),
        (["serve", NO_MODEL, "--tensor-parallel-size", "0"], "tensor_parallel_size must be at least 1"),
        (["serve", NO_MODEL, "--max-waiting-requests", "-1"], "max_waiting_requests must be at least 0"),
        (["serve", NO_MODEL, "--stall-timeout", "0"], "stall_timeout_s must be above 0, not 0"),
        # sampling, checked before the model loads
        (["generate", "hi", "--model", NO_MODEL, "--temperature", "-1"], "temperature must be non-negative"),
        (["generate", "hi", "--model", NO_MODEL, "--top-p", "1.5"], "top_p must be in [0, 1]"),
        (["generate", "hi", "--model", NO_MODEL, "--max-tokens", "-3"], "max_tokens must be non-negative"),
        (["chat", "hi", "--model", NO_MODEL, "--min-p", "nan"], "min_p must be a finite number"),
        (["chat", "hi", "--model", NO_MODEL, "--repetition-penalty", "0"], "repetition_penalty must be"),
    ],
)
def test_a_setting_out_of_range_is_refused_by_name_before_anything_starts(capsys, argv, said):
    assert exit_status(argv) == 2
    err = capsys.readouterr().err
    assert said in err
    assert "Traceback" not in err and "nonexistent" not in err


@pytest.mark.parametrize(
    ("toml", "said"),
    [
        ("[gateway]\nconnect_timeout_s = -2", "connect_timeout_s must be above 0, not -2"),
        ("[gateway]\nprobe_interval_s = 0", "probe_interval_s must be above 0, not 0"),
        ("[gateway]\nmax_inflight_per_replica = 0", "max_inflight_per_replica must be at least 1"),
        ("[gateway]\nrebalance_kv_high = 0.5\nrebalance_kv_low = 0.7", "rebalance_kv_high must be above 0.7"),
        ("[gateway]\npolicy = 'bogus'", "unknown policy 'bogus'"),
        ("[autoscale]\nmax_step = 0", "max_step must be at least 1, not 0"),
        ("restart_backoff_s = -1", "restart_backoff_s must be at least 0"),
        ("[[models]]\nname = 'a'\nmemory_mb = -5", "memory_mb must be at least 0"),
    ],
)
def test_a_fleet_file_is_held_to_the_same_ranges(tmp_path, capsys, toml, said):
    path = tmp_path / "fleet.toml"
    path.write_text(f"replicas = 1\n{toml}\n")
    assert exit_status(["fleet", "up", "--config", str(path)]) == 2
    assert said in capsys.readouterr().err


def test_every_numeric_field_of_the_gateways_config_has_a_range():
    """A field added later without one would take any value from a flag or a file."""
    from shoal.fleet.config import GatewayConfig

    unbounded = ("batch_priority",)  # a priority: any whole number orders
    numeric = [f.name for f in dataclasses.fields(GatewayConfig) if f.type in ("int", "float")]
    assert len(numeric) > 30
    for name in set(numeric) - set(unbounded):
        with pytest.raises(ValueError, match=f"^{name} must be"):
            GatewayConfig(**{name: float("nan")}).check()
