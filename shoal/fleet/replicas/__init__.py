"""The replica table and health probing: what the gateway knows of each replica."""
