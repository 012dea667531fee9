"""Test infrastructure (not part of the product: nothing in shoal's packages imports it)."""
