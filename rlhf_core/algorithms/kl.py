"""Per-token KL estimators between the policy and a frozen reference (Schulman, "Approximating KL
divergence", 2020). Tokens are sampled from (roughly) the policy, so each estimator's expectation is
KL(π_θ ‖ π_ref); k1 is unbiased but can be negative, k2 and k3 are non-negative and have lower variance.
"""

from __future__ import annotations

import torch

KL_ESTIMATORS = ("k1", "k2", "k3")

# exp(±20) is ~5e8: large enough never to matter for sane inputs, small enough never to overflow.
_LOG_RATIO_CLAMP = 20.0


def kl_penalty(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, kind: str = "k3") -> torch.Tensor:
    """Per-token KL estimate.

    logprobs, ref_logprobs: FloatTensor [..., L] (same shape). Returns FloatTensor [..., L].
    "k1": logp − ref
    "k2": ½ (logp − ref)²
    "k3": exp(ref − logp) − (ref − logp) − 1, with ref − logp clamped to [−20, 20]. The clamp covers
          both occurrences, so k3 stays ≥ 0 and its gradient is 0 (never of the wrong sign) beyond it.
    """
    diff = logprobs - ref_logprobs
    if kind == "k1":
        return diff
    if kind == "k2":
        return 0.5 * diff.square()
    if kind == "k3":
        log_ratio = (-diff).clamp(-_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP)
        return torch.exp(log_ratio) - log_ratio - 1.0
    raise ValueError(f"unknown KL estimator {kind!r}; expected one of {KL_ESTIMATORS}")
