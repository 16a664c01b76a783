"""The one error type of prompt data."""

from __future__ import annotations


class DatasetError(ValueError):
    """A dataset file is missing, malformed or not UTF-8 (the error names file:line), has no usable rows, or
    holds an answer the configured reward could never score."""
