"""The proxy: upstream calls, failure judgement and the poison guard, unary and streaming relays,
the prefill/decode decider."""
