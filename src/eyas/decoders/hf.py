"""eyas's own decoding with a transformers target: plain greedy and greedy speculative
decoding, chain of K drafts, as serving engines run EAGLE-3. The target's states at the
layers the drafter reads feed its proposer at every accepted position; the proposer
drafts K tokens, the target verifies them in one forward pass, and the longest matching
prefix plus one bonus token is kept.
"""

from __future__ import annotations

import copy
import time

import torch

from eyas.decoders.result import EvalResult
from eyas.host.ui import Reporter
from eyas.stop import StopSignals
from eyas.targets.layers import from_hf


class AuxTap:
    """Forward hooks on the target layers a drafter reads (given as HF `hidden_states`
    indices), their outputs concatenated: (1, n, len(layers) * H)."""

    def __init__(self, model, aux_hf: list[int]):
        layers = model.get_decoder().layers
        self.count = len(aux_hf)
        self.out: dict[int, torch.Tensor] = {}
        self.handles = [
            layers[i].register_forward_hook(self._keep(j)) for j, i in enumerate(from_hf(aux_hf))
        ]

    def _keep(self, j):
        def hook(_m, _i, o):
            self.out[j] = o[0] if isinstance(o, tuple) else o

        return hook

    def aux(self) -> torch.Tensor:
        return torch.cat([self.out[j] for j in range(self.count)], -1)  # (1, n, len * H)

    def remove(self):
        for h in self.handles:
            h.remove()


def _cache_kw(model, cache) -> dict:
    """transformers 5 names the argument `cache`; earlier releases `past_key_values`."""
    import inspect

    name = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    return {name: cache, "use_cache": True}


def _crop(cache, keep: int) -> None:
    drop = cache.get_seq_length() - keep
    if drop > 0:
        cache.crop(-drop)  # a negative length drops that many tokens, in every release


@torch.no_grad()
def greedy(model, prompt: list[int], max_new: int, eos: set[int]) -> list[int]:
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    kw = _cache_kw(model, cache)
    dev = model.device
    out = model(torch.tensor([prompt], device=dev), **kw)
    tok = int(out.logits[0, -1].argmax())
    gen = [tok]
    while len(gen) < max_new and tok not in eos:
        out = model(torch.tensor([[tok]], device=dev), **kw)
        tok = int(out.logits[0, -1].argmax())
        gen.append(tok)
    return gen


@torch.no_grad()
def speculative(
    model,
    tap: AuxTap,
    proposer,
    prompt: list[int],
    max_new: int,
    k: int,
    eos: set[int],
    res: EvalResult,
) -> list[int]:
    """Greedy speculative decoding of one prompt: each round the drafter's `proposer`
    drafts `k` tokens, the target verifies them in one forward, the longest matching prefix
    plus the target's own next token is kept, and the proposer is told what was kept with
    the target's states at the positions that produced it."""
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    kw = _cache_kw(model, cache)
    mine = [0, 0, 0]  # this prompt's rounds, accepted drafts, tokens emitted by those rounds
    res.per_prompt.append(mine)
    at = [0] * k  # this prompt's drafts accepted at each position
    res.positions.append(at)
    res.lengths.append(len(prompt))
    dev = model.device
    out = model(torch.tensor([prompt], device=dev), **kw)
    x_next = int(out.logits[0, -1].argmax())
    gen = [x_next]
    n_ctx = len(prompt)  # positions with target KV and states
    proposer.start(prompt, tap.aux(), x_next)
    while len(gen) < max_new and x_next not in eos:
        drafts = proposer.propose(x_next, k)
        out = model(torch.tensor([[x_next, *drafts]], device=dev), **kw)
        preds = out.logits[0].argmax(-1).tolist()  # (k+1,)
        new_aux = tap.aux()  # (1, k+1, len * H)
        n = 0
        while n < k and drafts[n] == preds[n]:
            n += 1
        res.rounds += 1
        res.drafted += k
        res.accepted += n
        mine[0] += 1
        mine[1] += n
        for j in range(k):
            res.per_position[j][1] += 1
            res.per_position[j][0] += int(j < n)
            at[j] += int(j < n)
        _crop(cache, n_ctx + 1 + n)
        new = drafts[:n] + [preds[n]]
        proposer.accept(new, new_aux[:, : n + 1])
        n_ctx += n + 1
        x_next = new[-1]
        for t in new:
            gen.append(t)
            mine[2] += 1  # emitted: what follows the reply's end is never shown or saved
            if t in eos or len(gen) >= max_new:
                x_next = t
                break
    return gen[:max_new]


def decode_one(
    model, tap, proposer, p, i, k, max_new_tokens, eos, res, tok, greedy_cache, model_key
):
    """One prompt, greedily and speculatively; both timed, and compared, into `res`."""
    key = (model_key, tuple(p), max_new_tokens)
    if greedy_cache is not None and key in greedy_cache:
        base, dt = greedy_cache[key]
    else:
        t0 = time.perf_counter()
        base = greedy(model, p, max_new_tokens, eos)
        dt = time.perf_counter() - t0
        if greedy_cache is not None:
            greedy_cache[key] = (base, dt)
    t1 = time.perf_counter()
    spec = speculative(model, tap, proposer, p, max_new_tokens, k, eos, res)
    t2 = time.perf_counter()
    res.base_seconds += dt
    res.spec_seconds += t2 - t1
    res.base_tokens += len(base)
    res.spec_tokens += len(spec)
    res.compare(i, spec, base, tok)


class _Stopped(Exception):
    """A signal came while a prompt decoded: that prompt is dropped, its partial counts too."""


def decode_all(
    model,
    tap,
    proposer,
    prompts: list[list[int]],
    res: EvalResult,
    *,
    k: int,
    max_new_tokens: int,
    eos: set[int],
    tok,
    greedy_cache: dict | None,
    model_key: str,
    precision: float | None,
    progress: bool,
) -> EvalResult:
    """Every prompt decoded into `res` (`decode_one`), with progress, until a signal (the
    prompt it came in is dropped, `res.stopped_by` says which) or until the 95% interval of
    tokens per forward is within +-`precision` (checked every 25 prompts from 50 on)."""

    def extra() -> str:
        if not res.rounds:
            return ""
        speed = res.spec_tokens / res.spec_seconds if res.spec_seconds else 0.0
        return (
            f"tokens/forward {res.tokens_per_forward:.2f}, acceptance {res.acceptance_length:.2f}, "
            f"{speed:.0f} tok/s speculative"
        )

    res.planned = len(prompts)
    with (
        StopSignals() as stop,
        Reporter("evaluate", len(prompts), unit="prompts", enabled=progress, extra=extra) as rep,
    ):
        for i, p in enumerate(prompts):
            before = copy.deepcopy(res)  # what a signal mid-prompt goes back to
            try:
                with stop.abandoning(_Stopped):
                    decode_one(
                        model,
                        tap,
                        proposer,
                        p,
                        i,
                        k,
                        max_new_tokens,
                        eos,
                        res,
                        tok,
                        greedy_cache,
                        model_key,
                    )
            except _Stopped:
                res = before
            if stop.requested:  # prompt i counts if it was decoded to its end
                res.prompts, res.stopped_by = i + (res is not before), stop.name
                break
            rep.advance()
            if precision and i + 1 >= 50 and (i + 1) % 25 == 0 and res.precise_to(precision):
                res.prompts = i + 1  # narrow enough: the rest would not change the figure
                break
    return res
