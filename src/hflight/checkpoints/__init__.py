"""``checkpoint-N`` folders: what is in them, how they are written, checked and read back.

``names`` spells every file name a checkpoint folder can hold (nowhere else); ``forms`` holds the forms of the model
and optimizer states (one process/DDP, FSDP2 gathered and sharded, DeepSpeed), each detecting, naming, writing,
checking and restoring itself, and the list of them; ``parts`` is the table of a checkpoint's parts (weights,
optimizer, scheduler, scaler, RNG, trainer state, training arguments, callback states, EMA): each part's files,
write, check and load side by side. ``folders`` saves a checkpoint, removes and rotates them; ``job`` is one
checkpoint's write (files, checksums, fsyncs, manifest last, durable publication by rename), finished by the run's
writer (``asynchronous``: the loop's thread, or one background thread with ``save_async``); ``manifest`` records and
verifies each file's size and checksum and finds the last valid checkpoint; ``writelock`` keeps one writer per output
folder; ``weights`` checks and loads model weights; ``optim_state`` checks optimizer/scheduler/scaler states against
what they load into; ``sharded`` reads and writes a sharded run's state dicts and distributed checkpoints;
``resume`` resolves and checks the checkpoint a run resumes from.

May import: ``hflight.surface`` (the facade's surface, the weights protocol's discovery), ``hflight._util``. Never the
run, the facade or the arguments' Lightning mapping.
"""
