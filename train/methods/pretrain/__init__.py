"""The pretrain method."""
