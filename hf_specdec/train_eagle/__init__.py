"""Trains EAGLE heads from the target itself: `hf_specdec.train_eagle_head` and `hf-specdec train-eagle`.

The training set is self-distilled (`data`): the target continues prompts (a file, or the built-in set of
`hf_specdec.train_eagle.prompts`), then one teacher-forced pass over each sequence records the hidden states the head
reads and the target's next-token argmax at every position. Entry p of the head reads the target's feature at p
and the token at p + 1 and learns (a) the target's argmax at p + 1 (cross-entropy) and (b) to reproduce what its
own input would be at p + 1 (the target's feature for EAGLE-1/2, `fc` of the target's states for EAGLE-3), which
is what chain drafting feeds back. With `num_unroll > 1` the head also trains on its own outputs, as chain drafting
runs it (`loop`). A run starts from a new head or fine-tunes a trained one (`head`). Data order is a pure function
of (seed, step), so a run resumed from a checkpoint equals an uninterrupted one. The output loads with
`EagleSpeculator.from_pretrained`.

    data.py  the training set: build it in resumable parts, soft labels, prompt files
    head.py  the head a run starts from (new, or one to fine-tune, checked first) and writing a trained head
    loop.py  the loss, the training loop, checkpoints and resuming
    cli.py   `hf-specdec train-eagle`
"""

from .cli import add_arguments, cmd_train_eagle
from .data import (
    TRAINING_PARTS_DIR,
    TRAINING_SET_NAME,
    TrainingSet,
    add_soft_labels,
    build_in_parts,
    build_training_set,
    default_layers,
    read_prompts,
    teacher_top_k,
    tokenize_prompts,
)
from .head import (
    check_init_from_is_not_out,
    check_new_head_options,
    head_config_for,
    head_to_fine_tune_config,
    new_head,
    save_head,
)
from .loop import CHECKPOINT_NAME, TrainResult, eagle_loss, train_eagle_head

__all__ = [
    "CHECKPOINT_NAME", "TRAINING_PARTS_DIR", "TRAINING_SET_NAME", "TrainResult", "TrainingSet", "add_arguments",
    "add_soft_labels", "build_in_parts", "build_training_set", "check_init_from_is_not_out",
    "check_new_head_options", "cmd_train_eagle", "default_layers", "eagle_loss", "head_config_for",
    "head_to_fine_tune_config", "new_head", "read_prompts", "save_head", "teacher_top_k", "tokenize_prompts",
    "train_eagle_head",
]
