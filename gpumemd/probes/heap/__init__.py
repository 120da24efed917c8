"""One pass over the heap: its tensors, their storages, autograd graphs, growing host containers."""
