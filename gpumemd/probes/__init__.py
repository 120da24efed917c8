"""Probes read the world and decide nothing. A probe never raises into the agent: a probe that
cannot work says so once in the log and reports "absent" (``None`` or an empty tuple)."""
