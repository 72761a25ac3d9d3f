"""``checkpoint-N`` folders: what is in them, how they are written, checked and read back.

``parts`` is the table of a checkpoint's parts (weights, optimizer, scheduler, scaler, RNG, trainer state, training
arguments, callback states, EMA): each part's file names, write, check and load side by side. ``folders`` writes a
checkpoint atomically (temporary folder, manifest last, rename), removes and rotates them; ``manifest`` records and
verifies each file's size and checksum and finds the last valid checkpoint; ``writelock`` keeps one writer per output
folder; ``weights`` checks and loads model weights; ``optim_state`` checks optimizer/scheduler/scaler states against
what they load into; ``resume`` resolves and checks the checkpoint a run resumes from.

May import: ``hflight.surface`` (the facade's surface, the weights protocol's discovery), ``hflight._util``. Never the
run, the facade or the arguments' Lightning mapping.
"""
