"""The cost of constrained decoding: output tok/s with and without a grammar, in one run, at
concurrency 1 and 32 (offline engine, the default int4 mode), and the compile time of each
constraint (a JSON schema, a regex, and the grammar a required tool call puts on the output).

    python benchmarks/structured_output.py
"""

from __future__ import annotations

import json
import time

from shoal import LLM, SamplingParams
from shoal.engine.structured import StructuredOutput
from shoal.models.tool_formats import SMOLLM2

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "email": {"type": "string", "pattern": "^[a-z]+@[a-z]+\\.[a-z]{2,3}$"},
        "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 3},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
            "required": ["city", "zip"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "age", "email", "tags", "address"],
    "additionalProperties": False,
}
TOOLS = [
    {"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}},
    {"name": "lookup_person", "parameters": PERSON},
]
CONSTRAINTS = {
    "none": None,
    # Never ends by itself (EOS ignored), so every step of every row computes a mask.
    "regex [a-z ,.]+": StructuredOutput("regex", "[a-z ,.]+"),
    "json_schema (nested)": StructuredOutput("json_schema", json.dumps(PERSON)),
    # What tool_choice "required" puts on the output: SmolLM2's call format over two tools.
    "tool call (required)": StructuredOutput("grammar", SMOLLM2.grammar(TOOLS, parallel=True), "tools"),
}
TOKENS = 64


def run(llm: LLM, structured: StructuredOutput | None, conc: int) -> tuple[float, int]:
    prompts = [
        [{"role": "user", "content": f"Describe person number {i} as JSON."}] for i in range(max(8, conc * 2))
    ]
    endless = structured is None or structured.kind == "regex"
    params = SamplingParams(
        temperature=0.8, seed=1, max_tokens=TOKENS, ignore_eos=endless, structured=structured
    )
    t0 = time.perf_counter()
    outs = llm.chat(prompts, params)
    elapsed = time.perf_counter() - t0
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    return tokens / elapsed, tokens


def main() -> None:
    for name, so in CONSTRAINTS.items():
        if so is not None:
            t0 = time.perf_counter()
            so.grammar()
            print(f"compile {name}: {1000 * (time.perf_counter() - t0):.2f} ms")
    results = {}
    for conc in (1, 32):
        llm = LLM(max_num_seqs=conc)
        # Warm up, the grammar backend too: its token table is built on first use (~0.25 s).
        warm = StructuredOutput("regex", "[a-z]+")
        llm.chat([[{"role": "user", "content": "warm up"}]], SamplingParams(max_tokens=4, structured=warm))
        for name, so in CONSTRAINTS.items():
            tok_s, tokens = results[conc, name] = run(llm, so, conc)
            print(f"c={conc} {name}: {tok_s:.1f} output tok/s ({tokens} tokens)")
    print("\n| constraint | c=1 tok/s | c=32 tok/s | cost at c=1 | cost at c=32 |")
    print("| --- | --- | --- | --- | --- |")
    for name in CONSTRAINTS:
        a, b = results[1, name][0], results[32, name][0]
        base1, base32 = results[1, "none"][0], results[32, "none"][0]
        print(f"| {name} | {a:.1f} | {b:.1f} | {1 - a / base1:+.1%} | {1 - b / base32:+.1%} |")


if __name__ == "__main__":
    main()
