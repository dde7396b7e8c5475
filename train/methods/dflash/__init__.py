"""DFlash: a drafter that proposes a whole block in one forward (docs/dflash.md)."""
