"""The answer_distill method."""
