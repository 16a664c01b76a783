"""A verl-style reward function for `reward.functions` (see docs/rewards.md).

verl's signature: called once per row with the row's data source, the decoded completion and the ground
truth (verl's `reward_model.ground_truth` column, else the answer text); returns a float, or a dict with
'score' and extra values, logged as reward/<label>/<key> for the keys listed in the function's `metrics`.

    reward.functions:
      - {path: examples/rewards/verl_style.py, name: compute_score, label: verl_score, metrics: [length]}
"""


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    """1.0 when the first word of the completion is the ground truth, 0.1 when it appears later, else 0."""
    words = solution_str.split()
    if words and words[0] == str(ground_truth).strip():
        score = 1.0
    elif str(ground_truth).strip() in words:
        score = 0.1
    else:
        score = 0.0
    return {"score": score, "length": float(len(words))}
