"""The device: the CUDA caching allocator, its allocation history, NVML and which NVML device each ordinal is."""
