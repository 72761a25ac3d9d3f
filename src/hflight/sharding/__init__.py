"""Models larger than one device: transformers' ``fsdp``/``fsdp_config`` and ``deepspeed`` arguments on Lightning's
sharding strategies.

- ``fsdp`` with ``fsdp_config["version"] = 2`` (transformers' default): :class:`~hflight.sharding.fsdp.FSDP2Strategy`,
  Lightning's ``ModelParallelStrategy`` with the model sharded by torch's ``fully_shard`` as accelerate shards it
  (the layers ``transformer_layer_cls_to_wrap``/``min_num_params`` name, then the whole model), on CUDA (NCCL) and on
  the CPU (gloo). FSDP1 (``version`` 1) stays Lightning's ``FSDPStrategy``, which runs on CUDA only
  (``hflight.arguments.strategies``).
- ``deepspeed``: :class:`~hflight.sharding.deepspeed.HFDeepSpeedStrategy` (Lightning's ``DeepSpeedStrategy``, on CUDA
  and on DeepSpeed's CPU accelerator).

What a sharded run writes into ``checkpoint-N`` is transformers' layout for the same settings
(``hflight.checkpoints.sharded``), through hflight's one checkpoint writer: manifest, checksums, atomic publish.

May import: the run's backend hooks (``hflight.run.backend``), the arguments and the checkpoints (as ``ipu``/``ort``).
"""
