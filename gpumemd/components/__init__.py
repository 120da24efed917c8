"""Capabilities plugged into the agent. Each module holds one component class (see
``gpumemd.components.base.Component``); ``gpumemd.api.build_components`` builds the ones a normal
``attach()`` starts, with their dependencies, in start order (the agent stops them in reverse).
"""
