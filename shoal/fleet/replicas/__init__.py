"""The replica table, health probing and the prefix index: what the gateway knows of each replica
(its state, its load, the blocks it caches)."""
