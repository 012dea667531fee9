"""Routing: policies behind one protocol and registry, prompt keys, tiers."""
