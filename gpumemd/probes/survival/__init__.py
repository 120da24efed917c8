"""Long-lived tensors counted across steps: survivors, graph chains, growing tensor families."""
