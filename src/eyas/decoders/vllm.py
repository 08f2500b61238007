"""vLLM as the judge: the target generates greedily without and with an exported drafter,
and vLLM's own speculative-decoding counters give the acceptance. The prompts come rendered
and tokenized (`eyas.stages.evaluate`); both outputs are compared token for token."""

from __future__ import annotations

import gc
import time

from eyas.decoders.result import EvalResult
from eyas.host.ui import console
from eyas.run.store import Layout
from eyas.targets.backends import BackendSpec, backend_module
from eyas.targets.target import resolve_dtype

# vLLM's counter -> the EvalResult total it adds to
_COUNTERS = {
    "vllm:spec_decode_num_drafts": "rounds",
    "vllm:spec_decode_num_draft_tokens": "drafted",
    "vllm:spec_decode_num_accepted_tokens": "accepted",
}
_PER_POSITION = "vllm:spec_decode_num_accepted_tokens_per_pos"


def _engine_spec(model_dir: str, prompts, max_new_tokens: int, k: int, tp: int, trust: bool):
    import torch

    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = resolve_dtype("auto", device)
    return BackendSpec(
        model=model_dir,
        aux_layers=(),
        device=device,
        dtype=dtype,
        store_dtype=dtype,
        layout=Layout(),
        tensor_parallel_size=tp,
        trust_remote_code=trust,
        max_model_len=max(len(p) for p in prompts) + max_new_tokens + k + 8,
    )


def _generate(spec: BackendSpec, inputs, params, speculative: dict | None, progress: bool):
    """One engine's greedy outputs, its seconds, and its metrics (with a drafter); the engine
    is shut down before the next one starts."""
    backend = backend_module("vllm")
    backend.import_vllm()
    from vllm import LLM

    if progress:
        console.print(
            f"evaluate (vllm): {'with' if speculative else 'without'} the drafter, "
            f"{len(inputs)} prompts",
            markup=False,
            highlight=False,
        )
    try:
        llm = LLM(
            **{**backend.engine_kwargs(spec), "disable_log_stats": speculative is None},
            **({"speculative_config": speculative} if speculative else {}),
        )
    except RuntimeError as exc:  # vLLM's own cause is in its log, above on stderr
        what = "the target with the drafter" if speculative else "the target"
        raise ValueError(f"vLLM could not start {what} (its log above says why): {exc}") from None
    t0 = time.perf_counter()
    outs = llm.generate(inputs, params, use_tqdm=False)
    seconds = time.perf_counter() - t0
    metrics = llm.get_metrics() if speculative else []
    del llm
    gc.collect()
    return [list(o.outputs[0].token_ids) for o in outs], seconds, metrics


def _count(res: EvalResult, metrics, k: int) -> None:
    for m in metrics:
        if m.name in _COUNTERS:
            setattr(res, _COUNTERS[m.name], getattr(res, _COUNTERS[m.name]) + m.value)
        elif m.name == _PER_POSITION:
            for j, v in enumerate(m.values[:k]):
                res.per_position[j][0] += v
    for j in range(k):
        res.per_position[j][1] = res.rounds


def judge_with_vllm(
    model_dir: str,
    prompts: list[list[int]],
    speculative: dict,
    res: EvalResult,
    tok,
    *,
    k: int,
    max_new_tokens: int,
    tensor_parallel_size: int,
    trust_remote_code: bool,
    progress: bool,
) -> EvalResult:
    """`prompts` generated greedily by vLLM without and with `speculative` (its
    `speculative_config`), timed, counted into `res` and compared token for token."""
    backend_module("vllm").import_vllm()
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    spec = _engine_spec(
        model_dir, prompts, max_new_tokens, k, tensor_parallel_size, trust_remote_code
    )
    params = SamplingParams(temperature=0.0, max_tokens=max_new_tokens)
    inputs = [TokensPrompt(prompt_token_ids=p) for p in prompts]
    base, res.base_seconds, _ = _generate(spec, inputs, params, None, progress)
    spec_out, res.spec_seconds, metrics = _generate(spec, inputs, params, speculative, progress)
    _count(res, metrics, k)
    res.base_tokens = sum(len(x) for x in base)
    res.spec_tokens = sum(len(x) for x in spec_out)
    # vLLM's counters are totals over the run, not per prompt: one row, so no interval. What
    # it emitted after each prompt's first token is its output, already cut at the reply's end.
    res.per_prompt = [[res.rounds, res.accepted, sum(max(len(x) - 1, 0) for x in spec_out)]]
    for i, (a, b) in enumerate(zip(spec_out, base, strict=True)):
        res.compare(i, a, b, tok)
    return res


__all__ = ["judge_with_vllm"]
