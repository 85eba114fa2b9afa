"""Training draft heads with the functions they draft with (API).

``objective``: the loss of a hidden-state head (EAGLE-3, MTP) through the drafter's own
``run_rows`` / ``head_logits``, with the training-time test over several draft steps;
``dflash_objective``: DFlash's anchored blocks through its own context write and block forward;
``trainer``:
optax, one jitted step with the frozen target's features computed on the fly, checkpoints;
``data``: corpora this machine has offline and the reduced draft vocabulary. A finished EAGLE-3
head is written in the HF layout by ``jspec.drafters.eagle3.save_head``, a DFlash draft in the
published one by ``jspec.drafters.dflash.save_head``. ``scripts/train_draft.py``
is the command line.
"""

from jspec.training.data import (
    chat_prompts, draft_vocabulary, self_generated, stdlib_functions, stdlib_source, transform_prompts, windows,
)
from jspec.training import dflash_objective
from jspec.training.dflash_objective import dflash_loss_fn
from jspec.training.objective import loss_fn, step_logits, step_losses, trainable_params, with_params
from jspec.training.trainer import TrainConfig, TrainState, init_state, restore_state, save_state, train, train_step

__all__ = [
    "TrainConfig", "TrainState", "chat_prompts", "dflash_loss_fn", "dflash_objective", "draft_vocabulary", "init_state", "loss_fn", "restore_state",
    "save_state", "self_generated", "stdlib_functions", "stdlib_source", "step_logits", "step_losses", "train",
    "train_step", "trainable_params", "transform_prompts", "windows", "with_params",
]
