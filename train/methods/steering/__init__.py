"""The steering method."""
