"""The distillspec method."""
