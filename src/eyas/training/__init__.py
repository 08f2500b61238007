"""Training the EAGLE-3 drafter.

- `drafter`: the model; `ttt_attention`: its training-time-test attention; `loss`: the
  TTT loss;
- `train_data`: the training reader and a finished run as a data source; `follow`: a run
  followed as it is extracted;
- `trainer`: the optimizer step, evaluation and checkpoints; `checkpoint`: checkpoints and
  the final drafter on disk;
- `train`: the loop that ties them together (`eyas train`).

May import: `eyas.run`, `eyas.host`, `eyas.targets` and `eyas.data`. Never the stages above.
"""
