"""The pretrain method: its settings (config.py) and its LightningModule (module.py)."""
