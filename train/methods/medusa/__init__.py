"""The medusa method."""
