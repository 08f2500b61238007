"""A vLLM KV connector that hands the captured hidden states of each request to eyas.

Loaded by vLLM inside its engine (`kv_connector_module_path`), never by eyas's own process.
vLLM's `extract_hidden_states` speculative method caches, per token, the hidden states of
the requested layers; this connector copies them out when a request finishes and writes
them to a staging file next to a lock file that stays locked until the file is complete.
The staging directory is scratch space outside the run: eyas reads each file, checks it
and commits it through the store's protocol, then deletes it.

On a GPU the stock connector's path is used (asynchronous copy on a side stream into
pinned memory, writes in a thread pool); on a CPU, where there are no streams or pinned
memory, the copy and the write happen synchronously.
"""

from __future__ import annotations

import os

import torch
from safetensors.torch import save_file
from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
    ExampleHiddenStatesConnector,
    extract_from_kv_cache,
)


class _Done:
    """Stands in for a CUDA event on a CPU: the copy is already complete."""

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass


class EyasHiddenStatesConnector(ExampleHiddenStatesConnector):
    def _submit_async_write(self, pending) -> None:
        if self._kv_cache is not None and self._kv_cache.is_cuda:
            return super()._submit_async_write(pending)
        if not self._is_tp_rank_zero:
            return
        blocks = torch.tensor(pending.block_ids, dtype=torch.long)
        bs = self._block_size
        slots = (torch.arange(bs)[None, :] + blocks[:, None] * bs).flatten()
        states = extract_from_kv_cache(self._kv_cache, slots, pending.token_ids.shape[0]).clone()
        lock_fd = self._lock_fds.pop(pending.req_id, None)
        try:
            os.makedirs(os.path.dirname(pending.filename), exist_ok=True)
            tmp = pending.filename + ".part"
            save_file({"hidden_states": states, "token_ids": pending.token_ids.clone()}, tmp)
            os.replace(tmp, pending.filename)
        finally:
            if lock_fd is not None:
                os.close(lock_fd)  # releases the lock: the reader may go on
        self._req_copy_events[pending.req_id] = _Done()
