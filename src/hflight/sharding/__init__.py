"""Models larger than one device: transformers' ``fsdp``/``fsdp_config`` and ``deepspeed`` arguments on Lightning's
sharding strategies.

- ``fsdp`` with ``fsdp_config["version"] = 2`` (transformers' default): :class:`~hflight.sharding.fsdp.FSDP2Strategy`,
  Lightning's ``ModelParallelStrategy`` with the model sharded by torch's ``fully_shard`` as accelerate shards it
  (the layers ``transformer_layer_cls_to_wrap``/``min_num_params`` name, then the whole model), on CUDA (NCCL) and on
  the CPU (gloo), over several processes or one a launcher started. FSDP1 (``version`` 1) stays Lightning's
  ``FSDPStrategy``, which runs on CUDA only. Both are planned in :mod:`hflight.sharding.plans` (one reading of the wrap
  policy, typed plans) and built by :mod:`hflight.sharding.registration`'s builders, which the arguments reach through
  ``hflight.arguments.registry.SHARDING`` once they checked ``fsdp_config``.
- ``deepspeed``: :class:`~hflight.sharding.deepspeed.HFDeepSpeedStrategy` (Lightning's ``DeepSpeedStrategy``, on CUDA
  and on DeepSpeed's CPU accelerator); what its config needs from the model and the run's length reaches it through
  the backend hook ``hf_run_planned``, never through a backend test in the loop.

What a sharded run writes into ``checkpoint-N`` is transformers' layout for the same settings
(``hflight.checkpoints.forms``), through hflight's one checkpoint writer: manifest, checksums, atomic publish.

May import: the run's backend hooks (``hflight.run.backend``), the arguments and the checkpoints (as ``ipu``/``ort``).
"""
