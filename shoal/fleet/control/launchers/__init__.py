"""Launchers: where replica processes run (local processes, Ray actors), behind one protocol."""
