"""verl's reward interface: compute_score(data_source, solution_str, ground_truth, extra_info), per completion."""

from __future__ import annotations


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    """1.0 for the exact answer; partial credit per matching character, as a dict for one data source (verl
    reads its "score")."""
    assert isinstance(extra_info, dict) and "index" in extra_info
    if data_source == "reverse/partial":
        return {
            "score": sum(a == b for a, b in zip(solution_str.strip(), ground_truth)) / len(ground_truth),
            "acc": solution_str.strip() == ground_truth,
        }
    return float(solution_str.strip() == ground_truth)


def wrong_signature(solution_str, answer):
    """Takes verl's solution_str but not the rest of what verl passes."""
    return 0.0


def no_score(data_source, solution_str, ground_truth, extra_info=None):
    """A dict without verl's "score" key: verl's reader raises KeyError on it."""
    return {"acc": solution_str.strip() == ground_truth}


def with_prediction(data_source, solution_str, ground_truth, extra_info=None):
    """verl's dict with the parsed prediction beside the score (a string: no metric can log it) and a numpy flag."""
    import numpy as np

    return {"score": float(solution_str.strip() == ground_truth), "pred": solution_str.strip(), "hit": np.bool_(True)}
