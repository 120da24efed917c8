"""OOM post-mortem reports: build a JSON-ready dict from records, render it as Markdown and
self-contained HTML, write the directory atomically, and load it back safely for ``gpumemd report``.

Outputs read records; they never mutate agent state.
"""
