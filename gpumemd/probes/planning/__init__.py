"""Memory planned before a run: a model traced on the meta device, a CPU call's peak."""
