"""``python -m gpumemd ...`` is the same as the ``gpumemd`` command."""

from gpumemd.cli import console_main

if __name__ == "__main__":
    console_main()
