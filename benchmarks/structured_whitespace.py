"""How often a small model finishes a JSON answer within its budget: a three-field json_schema (a
string, an integer, an array of enums) at temperature 0.7 and max_tokens 120 on the bundled
model, N seeded requests, JSON without free whitespace (the default) against JSON with it (the
opt-in, what every request got before). An answer is complete when it ends by itself
(finish_reason "stop") and parses.

    python benchmarks/structured_whitespace.py [-n 20]
"""

from __future__ import annotations

import argparse
import json
import re

from shoal import LLM, SamplingParams
from shoal.engine.structured import FREE_WHITESPACE, StructuredOutput

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "colors": {"type": "array", "items": {"enum": ["red", "green", "blue"]}},
    },
    "required": ["name", "age", "colors"],
}
ASKS = [
    "Describe a person as JSON.",
    "Give me a person with their favourite colours, in JSON.",
    "Invent a character. Answer in JSON.",
    "Who is your best friend? Reply as JSON.",
]
MODES = {"compact (default)": None, "free whitespace (opt-in)": FREE_WHITESPACE}


def complete(text: str, finish: str) -> bool:
    if finish != "stop":
        return False
    try:
        return isinstance(json.loads(text), dict)
    except json.JSONDecodeError:
        return False


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("-n", type=int, default=20, help="requests per mode")
    args = ap.parse_args()
    llm = LLM()
    chats = [[{"role": "user", "content": ASKS[i % len(ASKS)]}] for i in range(args.n)]
    print(f"{args.n} requests a mode, temperature 0.7, max_tokens 120, seeds 0..{args.n - 1}")
    for name, whitespace in MODES.items():
        grammar = StructuredOutput("json_schema", json.dumps(SCHEMA), whitespace=whitespace)
        params = [
            SamplingParams(temperature=0.7, max_tokens=120, seed=i, structured=grammar) for i in range(args.n)
        ]
        prompts = [llm.tokenizer.encode_chat(c) for c in chats]
        outs = [o.outputs[0] for o in llm.generate(prompts, params)]  # one batch: seeds make it exact
        finished = [o.text for o in outs if complete(o.text, o.finish_reason)]
        tokens = sum(len(o.token_ids) for o in outs) / len(outs)
        # A cut answer may end inside a string, so whitespace is counted in finished ones.
        blank = sum(len(re.findall(r"\s", re.sub(r'"(?:[^"\\]|\\.)*"', "", t))) for t in finished)
        print(
            f"{name:26s} complete {len(finished)}/{len(outs)} ({len(finished) / len(outs):.0%}), "
            f"{tokens:.0f} tokens an answer, "
            f"{blank / max(len(finished), 1):.0f} whitespace characters outside strings a complete one"
        )


if __name__ == "__main__":
    main()
