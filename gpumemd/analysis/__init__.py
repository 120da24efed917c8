"""Pure functions over records: no torch, no threads, no I/O, no clock."""
