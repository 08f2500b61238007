"""vLLM as the judge: the target generates greedily without and with an exported drafter,
and vLLM's own speculative-decoding counters give the acceptance. The prompts come rendered
and tokenized (`eyas.stages.evaluate`); both outputs are compared token for token. The
counters are totals, so the drafter's engine runs one context-length bucket at a time and
reads them after each: every bucket gets its own figures, without an interval."""

from __future__ import annotations

import gc
import time
from itertools import zip_longest

from eyas.decoders.result import EvalResult, length_bucket
from eyas.errors import ProblemError
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


def _generate(spec: BackendSpec, inputs, params, speculative: dict | None, groups, progress: bool):
    """One engine's greedy outputs (in the order of `inputs`), its seconds and, with a
    drafter, its counters after each group of `groups` (lists of indices into `inputs`),
    generated one group after another; the engine is shut down before the next one starts."""
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
        raise ProblemError(f"vLLM could not start {what} (its log above says why): {exc}") from None
    outs, counters = [None] * len(inputs), []
    t0 = time.perf_counter()
    for g in groups:
        for i, o in zip(
            g, llm.generate([inputs[i] for i in g], params, use_tqdm=False), strict=True
        ):
            outs[i] = list(o.outputs[0].token_ids)
        if speculative:
            counters.append(_counters(llm.get_metrics()))
    seconds = time.perf_counter() - t0
    del llm
    gc.collect()
    return outs, seconds, counters


def _counters(metrics) -> dict:
    """The speculative-decoding counters of one reading (totals since the engine started)."""
    out = {}
    for m in metrics:
        if m.name in _COUNTERS:
            out[m.name] = out.get(m.name, 0) + m.value
        elif m.name == _PER_POSITION:  # accepted per draft position, a vector
            out[m.name] = [
                a + b for a, b in zip_longest(out.get(m.name, []), m.values, fillvalue=0)
            ]
    return out


def _count(
    res: EvalResult, group: list[int], now: dict, before: dict, emitted: int, k: int
) -> None:
    """One group's counts (the counters' growth from `before` to `now`) as a row of `res`."""
    grew = {n: now.get(n, 0) - before.get(n, 0) for n in _COUNTERS}
    for name, total in _COUNTERS.items():
        setattr(res, total, getattr(res, total) + grew[name])
    now_at, had = now.get(_PER_POSITION, [])[:k], before.get(_PER_POSITION, [])[:k]
    at = [a - b for a, b in zip_longest(now_at, had, fillvalue=0)]
    at += [0] * (k - len(at))
    for j in range(k):
        res.per_position[j][0] += at[j]
        res.per_position[j][1] = res.rounds
    res.per_prompt.append(
        [grew["vllm:spec_decode_num_drafts"], grew["vllm:spec_decode_num_accepted_tokens"], emitted]
    )
    res.positions.append(at)
    res.groups.append(group)


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
    buckets: dict[int, list[int]] = {}
    for i, p in enumerate(prompts):
        buckets.setdefault(length_bucket(len(p)), []).append(i)
    groups = [buckets[b] for b in sorted(buckets)]
    base, res.base_seconds, _ = _generate(
        spec, inputs, params, None, [range(len(inputs))], progress
    )
    spec_out, res.spec_seconds, counters = _generate(
        spec, inputs, params, speculative, groups, progress
    )
    res.base_tokens = sum(len(x) for x in base)
    res.spec_tokens = sum(len(x) for x in spec_out)
    res.lengths = [len(p) for p in prompts]
    # A group's rows: what vLLM emitted after each prompt's first token is its output, already
    # cut at the reply's end.
    for g, now, before in zip(groups, counters, [{}, *counters], strict=False):
        _count(res, g, now, before, sum(max(len(spec_out[i]) - 1, 0) for i in g), k)
    for i, (a, b) in enumerate(zip(spec_out, base, strict=True)):
        res.compare(i, a, b, tok)
    return res


__all__ = ["judge_with_vllm"]
