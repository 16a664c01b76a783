"""The options of the built-in algorithms, one pydantic class each (torch-free: the config validates with them).

A config writes them under `algorithm.loss_options` and `algorithm.advantage_options`, validated against the class
of the loss or estimator it names, so an option that does not apply is refused. The defaults are those the
config had when these options were flat fields of `algorithm:` (`FLAT_KEYS`), but for the group std of 'grpo'
(`GRPO_STD_UNBIASED`, `GRPO_STD_EPS`: since 2026-12-06 the sample std with eps 1e-4, as TRL's GRPOTrainer; it was
the population std with eps 1e-6).
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import Any, Literal, Optional

from pydantic import BaseModel, ConfigDict, Field, model_validator

from rlhf_core.algorithms.registry import REGISTRIES, AlgorithmOptions

IMPORTANCE_LEVELS = ("token", "sequence")
GRPO_STD_UNBIASED = True
"""The default std of 'grpo' advantages: the sample std (Bessel's correction, / (G - 1)), as TRL's GRPOTrainer and
verl compute it; False: the population std (/ G), this project's default until 2026-12-06."""
GRPO_STD_EPS = 1e-4
"""The default eps added to that std (TRL's GRPOTrainer: 1e-4; this project's until 2026-12-06: 1e-6)."""
M2PO_MASKINGS = ("trust_region", "ratio_sq")


class PPOOptions(AlgorithmOptions):
    """The clipped surrogate of PPO (and of GRPO, the same loss): `algorithm.loss` 'ppo' or 'grpo'."""

    clip_eps: Optional[float] = Field(
        0.2,
        gt=0,
        lt=1,
        description="PPO clip range (lower, and upper unless clip_eps_high is set); null disables clipping.",
    )
    clip_eps_high: Optional[float] = Field(
        None, gt=0, description="Upper clip range (DAPO clip-higher); None uses clip_eps."
    )
    dual_clip: Optional[float] = Field(
        None,
        gt=1,
        description="Dual-clip constant c > 1 bounding the loss of negative-advantage tokens; None disables.",
    )


class M2POOptions(PPOOptions):
    """M2PO (arXiv 2510.01161): `algorithm.loss` 'm2po'. It clips only when clip_eps is set ('ratio_sq' masking
    clips at 0.2 when it is null)."""

    m2_threshold: float = Field(
        0.04, gt=0, description="M2PO bound on the mean squared log-ratio over candidate tokens."
    )
    masking: Literal["trust_region", "ratio_sq"] = Field(
        "trust_region",
        description="M2PO masking: Algorithm 1 of arXiv 2510.01161, or the r^2 < ratio_sq_threshold rule; computed "
        "over the whole step's batch.",
    )
    ratio_sq_threshold: float = Field(
        4.0, gt=0, description="M2PO 'ratio_sq' masking: keep tokens with r^2 below this."
    )


class GRPOAdvantageOptions(AlgorithmOptions):
    """Group-relative advantages: `algorithm.advantage` 'grpo'."""

    scale: Literal["group", "batch", "none"] = Field(
        "group", description="Normalisation of the centred rewards: group std, batch std, or none (Dr.GRPO)."
    )
    eps: float = Field(GRPO_STD_EPS, gt=0, description="Added to the std when normalising.")
    unbiased: bool = Field(
        GRPO_STD_UNBIASED,
        description="The sample std (Bessel's correction: / (G - 1), as TRL and verl) when true; the population "
        "std (/ G) when false. For scale 'group' and 'batch'.",
    )


class GAEOptions(AlgorithmOptions):
    """Generalised advantage estimation with a learned critic: `algorithm.advantage` 'gae' (the critic is
    configured under critic:)."""

    gamma: float = Field(1.0, ge=0, le=1, description="Discount over response tokens.")
    lam: float = Field(1.0, ge=0, le=1, description="GAE lambda.")
    whiten: bool = Field(True, description="Whiten the advantages over the step's valid tokens.")


CORRECTION_MODES = ("none", "tis", "mis", "icepop")


class RolloutCorrection(BaseModel):
    """`algorithm.rollout_correction`: importance weights w = pi_train / pi_rollout between the trainer's
    log-probs (the weights it holds at the step) and the rollout engine's, applied with every loss
    (rlhf_core.algorithms.correction; verl's rollout correction). tis: w truncated at upper; mis: w, zero outside
    [lower, upper]; icepop: mis per token. level sequence: one weight per row, the product of its tokens' ratios
    (verl's sequence-level IS weight); level geometric: their geometric mean (verl's 'geometric' rejection level).
    rejected (mis, icepop): 'zero' keeps a rejected token in the loss's denominators with a term of 0 (IcePop),
    'drop' takes it out of the loss's token mask (verl's rejection sampling). With a correction on, every loss
    takes its ratio against the trainer's log-probs (decoupled)."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    mode: Literal["none", "tis", "mis", "icepop"] = Field(
        "none",
        description="none | tis (truncate at upper) | mis (mask outside [lower, upper]) | icepop (mis per token).",
    )
    level: Literal["token", "sequence", "geometric"] = Field(
        "token",
        description="Per-token weights, or one per sequence: the product of its token ratios (sequence, verl's "
        "sequence IS) or their geometric mean (geometric).",
    )
    rejected: Literal["zero", "drop"] = Field(
        "zero",
        description="mis/icepop: a rejected token's term is 0 and it stays in the loss's denominators (zero, "
        "IcePop), or it leaves the loss's token mask (drop, verl's rejection sampling).",
    )
    lower: Optional[float] = Field(None, gt=0, description="mis/icepop: lowest weight kept; None: 1 / upper.")
    upper: float = Field(2.0, gt=0, description="tis: truncation; mis/icepop: highest weight kept.")

    @model_validator(mode="after")
    def _consistent(self) -> RolloutCorrection:
        if self.mode == "icepop" and self.level != "token":
            raise ValueError("rollout_correction.mode 'icepop' masks per token: use level 'token' (or mode 'mis')")
        if self.rejected == "drop" and self.mode == "tis":
            raise ValueError("rollout_correction.rejected 'drop' drops the tokens mis/icepop reject; tis rejects none")
        if self.lower is not None and self.lower >= self.upper:
            raise ValueError(f"rollout_correction.lower ({self.lower}) must be below upper ({self.upper})")
        return self

    @property
    def enabled(self) -> bool:
        return self.mode != "none"

    @property
    def drops(self) -> bool:
        """mis / icepop with rejected 'drop': rejected tokens leave the loss's token mask."""
        return self.enabled and self.mode != "tis" and self.rejected == "drop"

    @property
    def lower_bound(self) -> float:
        return 1.0 / self.upper if self.lower is None else self.lower


FLAT_KEYS: dict[str, tuple[str, str]] = {
    "clip_eps": ("loss", "clip_eps"),
    "clip_eps_high": ("loss", "clip_eps_high"),
    "dual_clip": ("loss", "dual_clip"),
    "m2_threshold": ("loss", "m2_threshold"),
    "masking": ("loss", "masking"),
    "ratio_sq_threshold": ("loss", "ratio_sq_threshold"),
    "adv_scale": ("advantage", "scale"),
    "adv_eps": ("advantage", "eps"),
    "gamma": ("advantage", "gamma"),
    "lam": ("advantage", "lam"),
    "whiten_advantages": ("advantage", "whiten"),
}
"""The keys options were written under before they had classes (`algorithm.clip_eps`, ...): old key -> (kind,
option), i.e. `algorithm.<kind>_options.<option>`. A config that writes one still loads: the value moves to its
new home with a note (rlhf_core.config.AlgorithmConfig). A fixed list: options of new algorithms have no flat key."""


class FlatKeysMoved(dict):
    """Options moved from old flat keys into `algorithm.<kind>_options`; `flat`: option -> the old key, so that
    messages name what was written (registry.options_for)."""

    flat: dict[str, str]


def move_flat_keys(data: Any, default_names: Mapping[str, str]) -> Any:
    """An `algorithm:` mapping with its old flat option keys moved to their homes (a value there is replaced:
    an override by the old key beats the file's), with a one-line FutureWarning for each option that applies
    to the algorithm named (one that does not is left to options_for: refused, or left out at its default).
    default_names: the names of the loss and the advantage when `data` names none. Anything else is returned
    as it is."""
    if not isinstance(data, dict) or not data.keys() & FLAT_KEYS.keys():
        return data
    data = dict(data)
    for key in [k for k in data if k in FLAT_KEYS]:
        kind, option = FLAT_KEYS[key]
        home = data.get(f"{kind}_options")
        if isinstance(home, BaseModel):
            home = home.model_dump()
        if not isinstance(home, (dict, type(None))):
            continue  # not a mapping: the options' own error says so, and the key stays unknown
        if not isinstance(home, FlatKeysMoved):
            home = FlatKeysMoved(home or {})
            home.flat = {}
            data[f"{kind}_options"] = home
        home[option], home.flat[option] = data.pop(key), key
        try:
            applies = option in REGISTRIES[kind].get(data.get(kind, default_names[kind])).options.model_fields
        except ValueError:
            applies = False  # an unknown name: its error is the one to read
        if applies:
            warnings.warn(f"algorithm.{key} is now algorithm.{kind}_options.{option}", FutureWarning, stacklevel=2)
    return data
