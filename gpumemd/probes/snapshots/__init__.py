"""Snapshot files: checked opcode by opcode, then loaded without running code."""
