"""The eagle3 method: its settings (config.py), its LightningModule (module.py),
its finish step (finish.py)."""
