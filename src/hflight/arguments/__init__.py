"""The arguments of a run: ``TrainingArguments`` (a subclass of transformers') and what they become for Lightning.

``training_args`` (the dataclass, its checks and the Hydra schema), ``optimizers`` (``optim`` names -> optimizer
classes and keyword arguments), ``lightning_kwargs`` (the one mapping to ``lightning.Trainer`` keyword arguments:
precision, devices, loggers, callbacks), ``strategies`` (DDP/FSDP/DeepSpeed strategy objects from the ``ddp_*``/
``fsdp*``/``deepspeed`` fields), ``registry`` (hflight's backends in Lightning's registries), ``hardware`` (is the
requested accelerator there; which one ran), ``cluster`` (which launcher started the process, as Lightning detects
it: ranks, restarts, the job, SLURM's requeue signal), ``launcher_env`` (``accelerate launch``'s variables as the
fields they stand for).

May import: ``hflight.surface``, ``hflight._util``. Nothing of the run, the facade or the checkpoints.
"""
