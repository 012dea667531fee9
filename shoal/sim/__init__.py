"""Capacity planning: node profiles, a fleet simulator that reuses the engine's scheduler and
the gateway's routing, and a planner that searches fleet shapes against an SLO."""
