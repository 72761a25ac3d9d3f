"""How a checkpoint's files reach the local disk: the tensor files' writers (``torch_file``, ``safetensors_file``,
through ``direct_file``), the small files' durable writes (``files``), the writer's share of the machine
(``resources``) and ``save_async``'s isolated child (``writer_process``, ``writer_child``). What a checkpoint holds is
the business of ``hflight.checkpoints``' other modules; where a finished checkpoint lives (this disk, or an object
store as well) is ``hflight.checkpoints.storage``'s."""
