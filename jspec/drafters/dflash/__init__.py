"""DFlash: one-pass block drafting from the target's hidden states (``jspec.drafters.dflash.drafter``)."""

from jspec.drafters.dflash.checkpoint import load_head, save_head
from jspec.drafters.dflash.config import DFlashConfig, config_from_hf, default_target_layer_ids
from jspec.drafters.dflash.drafter import DFlash
from jspec.drafters.dflash.head import DFlashHead, init_dflash_head

__all__ = ["DFlash", "DFlashConfig", "DFlashHead", "config_from_hf", "default_target_layer_ids", "init_dflash_head",
           "load_head", "save_head"]
