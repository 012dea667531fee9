"""Admission: dispatch to replicas through the fair queue, tenants, usage, demand signals."""
