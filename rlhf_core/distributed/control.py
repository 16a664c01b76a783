"""Moved to `rlhf_core.run.control` (the control objects are Ray-free and shared by every host); these names
stay importable from here."""

from rlhf_core.run.control import ExperienceBuffer, WeightStore, busy_fraction, reconcile

__all__ = ["ExperienceBuffer", "WeightStore", "busy_fraction", "reconcile"]
