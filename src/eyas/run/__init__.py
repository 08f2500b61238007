"""The run directory and its guarantees: the bottom layer.

An extraction run is a directory of sample files, per-rank journals, locks and `run.json`.
Everything that writes or reads those files lives here, so that the guarantee is kept in
one place: a sample is either fully committed (its file fsynced, renamed into place, and
its journal line, with checksums, appended and fsynced) or absent.

- `store`: sample files (the layout, headers, checksums, durable commits), `bytes_on_disk`;
- `journal`: the per-rank journals and the ledger of committed and retired samples;
- `lock`: one writer per run and rank, with its holder named inside;
- `manifest`: the checksummed manifests of checkpoints, drafters and exports;
- `runmeta`: `run.json` and its backup;
- `recovery`: what a resuming writer checks and adopts;
- `stream`: followers and retirement under `--max-store`;
- `fsutil`: durable file operations, sizes, free space.

May import: the standard library, torch, safetensors, numpy, xxhash. Nothing of eyas above
it. Nothing outside this package opens a sample file or a journal directly.
"""
