"""Names of the built-in prompt tasks that other data modules decide on (no imports: a leaf of `data`)."""

SYNTHETIC_TASKS = ("max3", "sum2")
"""The word-level synthetic tasks (`rlhf_core.data.synthetic`): their answers match one tokenization."""
