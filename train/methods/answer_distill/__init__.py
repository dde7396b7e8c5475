"""The answer distill method: its settings (config.py) and its LightningModule (module.py)."""
