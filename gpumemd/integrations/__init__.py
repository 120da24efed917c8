"""Framework integrations: ``gpumemd.integrations.lightning.GpumemdCallback`` (PyTorch Lightning)
and ``gpumemd.integrations.transformers.GpumemdCallback`` (Hugging Face ``Trainer``).

Nothing here is imported by ``import gpumemd``; each module imports its framework when it is itself
imported, and says what to install when the framework is missing.
"""
