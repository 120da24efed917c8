"""Plain frozen dataclasses: the vocabulary every layer shares.

Records import nothing heavier than the standard library, so analysis code and tests can build
them by hand. Each feature keeps its records in its own module (``step``, ``census``, ``findings``...).
"""
