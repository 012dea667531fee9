"""Routing: policies behind one protocol and registry, the prefix index, prompt keys, tiers."""
