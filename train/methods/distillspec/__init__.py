"""The distillspec method: its settings (config.py), its LightningModule (module.py),
its finish step (finish.py)."""
