"""`shoal sim`, `shoal plan` and `shoal profile` on the command line: a run from a saved profile,
and flags out of range refused with the flag's name before anything runs or is written."""

from __future__ import annotations

import json

import pytest

from shoal.cli import main
from shoal.sim.profile import made_up_profile


@pytest.fixture(scope="module")
def profile_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("cli") / "profile.json"
    made_up_profile().save(path)
    return str(path)


def test_a_simulation_runs_from_a_saved_profile_and_writes_its_summary(profile_path, tmp_path, capsys):
    out = tmp_path / "summary.json"
    argv = ["sim", "--profile", profile_path, "--num-requests", "40", "--rate", "20", "--replicas", "2"]
    assert main([*argv, "--json", str(out)]) == 0
    assert "simulated 2 replica(s)" in capsys.readouterr().out
    assert json.loads(out.read_text())["completed"] == 40
    # Steps drawn around their prices: the exact simulator draws them.
    assert main([*argv, "--decode-step-noise", "0.15", "--json", str(out)]) == 0
    assert "(exact)" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("flags", "said"),
    [
        (["--replicas", "0"], "argument --replicas: 0 is below 1"),
        (["--replicas", "2.5"], "argument --replicas: '2.5' is not a whole number"),
        (["--num-requests", "-3"], "argument --num-requests: -3 is below 1"),
        (["--rate", "-1"], "argument --rate: -1 is not above 0"),
        (["--rate", "nan"], "argument --rate: nan is not above 0"),
        (["--max-num-seqs", "0"], "argument --max-num-seqs: 0 is below 1"),
        (["--max-replicas", "2", "--target-inflight", "0"], "argument --target-inflight: 0 is not above 0"),
        (
            ["--max-replicas", "2", "--scale-down-delay", "-5"],
            "argument --scale-down-delay: -5 is not at least 0",
        ),
        (["--routing", "bogus"], "argument --routing: invalid choice: 'bogus'"),
        (["--slo-ttft-ms", "0"], "argument --slo-ttft-ms: 0 is not above 0"),
        (["--prefix-len", "-1"], "argument --prefix-len: -1 is below 0"),
        (["--decode-step-noise", "-0.1"], "argument --decode-step-noise: -0.1 is not at least 0"),
    ],
)
def test_a_flag_out_of_range_is_refused_by_name(profile_path, tmp_path, capsys, flags, said):
    out = tmp_path / "summary.json"
    with pytest.raises(SystemExit) as exit_:
        main(["sim", "--profile", profile_path, "--json", str(out), *flags])
    assert exit_.value.code == 2
    assert said in capsys.readouterr().err
    assert not out.exists()


@pytest.mark.parametrize(
    ("flags", "said"),
    [
        (["--max-replicas", "1", "--min-replicas", "3"], "need 0 <= min_replicas (3) <= max_replicas (1)"),
        (
            ["--prefill", "1", "--decode", "1", "--max-replicas", "2"],
            "a pool of whole replicas, not a P/D fleet",
        ),
        (["--prefill", "1"], "a P/D fleet takes --prefill N and --decode M"),
        (["--mode", "fast", "--prompt-step-noise", "0.1"], "prices each step as its profile does"),
    ],
)
def test_flags_that_do_not_go_together_are_refused(profile_path, tmp_path, capsys, flags, said):
    out = tmp_path / "summary.json"
    assert main(["sim", "--profile", profile_path, "--json", str(out), *flags]) == 2
    assert said in capsys.readouterr().err
    assert not out.exists()


@pytest.mark.parametrize(
    ("argv", "said"),
    [
        (["plan", "--users", "0"], "argument --users: 0 is below 1"),
        (["plan", "--what-if", "-2"], "argument --what-if: -2 is not at least 0"),
        (["profile", "--decode-batches", "1,x"], "argument --decode-batches: 'x' is not a whole number"),
        (["profile", "--decode-batches", "0,4"], "argument --decode-batches: 0 is below 1"),
    ],
)
def test_plan_and_profile_refuse_flags_out_of_range(capsys, argv, said):
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2
    assert said in capsys.readouterr().err
