"""Every file and folder name of a ``checkpoint-N`` folder, spelled here and nowhere else.

transformers' names (so that folders written by either trainer resume in both), accelerate's for a sharded run's
states, DeepSpeed's for its own checkpoint, torch's for a distributed checkpoint, and hflight's manifest. The other
modules (and the tests) import them; a new checkpoint form adds its names here and its class to
``hflight.checkpoints.forms``.
"""

from __future__ import annotations

import re

# ---- the folders ------------------------------------------------------------------------------------------------
PREFIX = "checkpoint"
#: a folder being written (``.tmp-checkpoint-N``), or an old one on its way out (``...replaced``, ``...deleting``)
TMP_PREFIX = ".tmp-"
REPLACED_SUFFIX = ".replaced"
DELETING_SUFFIX = ".deleting"
CHECKPOINT_RE = re.compile(rf"^{PREFIX}-(\d+)$")

# ---- hflight's -------------------------------------------------------------------------------------------------
MANIFEST_NAME = "checkpoint_manifest.json"

# ---- the training state (transformers' names) ------------------------------------------------------------------
TRAINER_STATE_NAME = "trainer_state.json"
#: the arguments, pickled, for transformers' tools (hflight never loads it)
TRAINING_ARGS_NAME = "training_args.bin"
OPTIMIZER_NAME, SCHEDULER_NAME, SCALER_NAME = "optimizer.pt", "scheduler.pt", "scaler.pt"
RNG_NAME = "rng_state.pth"
#: hflight's: where the training data was (``hflight.checkpoints.data_position``; transformers ignores it)
DATA_POSITION_NAME = "data_position.pt"
RNG_RE = re.compile(r"^rng_state(?:_(\d+))?\.pth$")


def rng_file_name(world_size: int, rank: int) -> str:
    """The RNG file of process ``rank`` of a run of ``world_size`` processes."""
    return RNG_NAME if world_size <= 1 else f"rng_state_{rank}.pth"


# ---- the model (transformers' names) ----------------------------------------------------------------------------
#: in transformers' order of preference: the first one present is the one loaded
SAFE_WEIGHTS_NAME = "model.safetensors"
WEIGHT_FILES = (SAFE_WEIGHTS_NAME, "model.safetensors.index.json", "pytorch_model.bin", "pytorch_model.bin.index.json")
#: written by ``save_pretrained`` beside the weights, so rewritten by a re-save
CONFIG_NAME = "config.json"
CONFIG_FILES = (CONFIG_NAME, "generation_config.json")
SHARD_RE = re.compile(r"^(?:model|pytorch_model)(?:-[\w.]+)?-\d{5}-of-\d{5}\.(?:safetensors|bin)$")
#: a PEFT model's adapters (PEFT's names: safetensors first), the first adapter's at the top, each other's in a
#: subfolder named after it
ADAPTER_WEIGHT_FILES = ("adapter_model.safetensors", "adapter_model.bin")
ADAPTER_CONFIG_NAME = "adapter_config.json"

# ---- a sharded run's states (accelerate's names; index 0: the Trainer's one model and optimizer) ---------------
FSDP_MODEL_FILE = "pytorch_model_fsdp.bin"
FSDP_MODEL_DIR = "pytorch_model_fsdp_0"
FSDP_OPTIMIZER_FILE = "optimizer.bin"
FSDP_OPTIMIZER_DIR = "optimizer_0"
#: a ``torch.distributed.checkpoint`` folder's metadata (written last, by the coordinating process) and its shards
DCP_METADATA = ".metadata"
DCP_SHARDS = "__*_*.distcp"
#: a file that one process of several writes into a checkpoint, with its rank in its name: its RNG state, its shard of
#: a distributed checkpoint, DeepSpeed's partitions of it (``hflight.checkpoints.storage.peers.owner``)
PROCESS_FILE_RE = re.compile(
    r"(?:^|/)(?:rng_state_(\d+)\.pth|__(\d+)_\d+\.distcp|(?:[A-Za-z0-9]+_)?zero_pp_rank_(\d+)_mp_rank_\d+_[A-Za-z_]+\.pt)$"
)

# ---- DeepSpeed's own checkpoint (``engine.save_checkpoint``) -----------------------------------------------------
#: the file naming the latest tag, the script that rebuilds whole fp32 weights, the tag folder's prefix
DEEPSPEED_LATEST = "latest"
DEEPSPEED_SCRIPT = "zero_to_fp32.py"
DEEPSPEED_TAG_PREFIX = "global_step"
DEEPSPEED_OPTIMIZER_FILES = "*_optim_states.pt"


def deepspeed_files_naming_parameters(rank: int) -> list[str]:
    """The files of a DeepSpeed tag folder process ``rank`` writes that name parameters: its model states (ZeRO 0-2:
    global rank 0's one; ZeRO-3: one per process) and its optimizer partition."""
    names = [f"zero_pp_rank_{rank}_mp_rank_00_model_states.pt", f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt",
             f"bf16_zero_pp_rank_{rank}_mp_rank_00_optim_states.pt"]  # fmt: skip
    return names + (["mp_rank_00_model_states.pt"] if rank == 0 else [])
