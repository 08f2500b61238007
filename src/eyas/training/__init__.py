"""Training a drafter of any kind: what does not depend on the kind.

- `config`: `TrainConfig`, every training option with its help and default;
- `train_data`: the training reader and a finished run as a data source; `follow`: a run
  followed as it is extracted;
- `trainer`: the optimizer step, evaluation and checkpoints (the kind's loss asked of the
  kind); `muon`: the Muon optimizer; `checkpoint`: checkpoints and the final drafter on disk.

The loop that ties them together is the `train` stage (`eyas.stages.train`).

May import: `eyas.run`, `eyas.host`, `eyas.targets`, `eyas.data` and `eyas.drafters`. Never
the stages above.
"""
