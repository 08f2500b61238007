"""Stage 6, `evaluate`: real speculative decoding with the HF target and an exported drafter.

Greedy, chain of K drafts, as serving engines run EAGLE-3: the target's aux hidden states
of every accepted position feed the drafter's prefix (one key/value entry per position),
the drafter proposes K tokens, the target verifies them in one forward pass, the longest
matching prefix plus one bonus token is kept. The output is compared token for token with
plain greedy decoding of the target (lossless), and both are timed.
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from eyas.data.chat import chat_text
from eyas.data.records import (
    REASONS,
    RecordError,
    iter_records,
    parse_record,
    prompt_of,
    read_conversation,
)
from eyas.errors import UsageError
from eyas.host.ui import Reporter, still_working
from eyas.stages.config import EvaluateConfig as _D  # the defaults, written once
from eyas.stages.export import (
    drafts_per_round,
    export_kind,
    export_rendering,
    load_export,
    vllm_speculative_config,
)
from eyas.stop import StopSignals
from eyas.targets.layers import from_hf
from eyas.targets.target import load_tokenizer, read_chat_template, require_chat_template

LENGTH_BUCKETS = (0, 512, 2048, 4096, 8192, 16384)
"""Lower edges, in prompt tokens, of the context-length buckets every evaluation reports."""


def _bucket_name(lo: int, hi: int | None) -> str:
    k = lambda n: f"{n // 1024}K" if n >= 1024 else str(n)  # noqa: E731
    return f"< {k(hi)}" if lo == 0 else (f">= {k(lo)}" if hi is None else f"{k(lo)}-{k(hi)}")


@dataclass
class EvalResult:
    prompts: int = 0
    rounds: int = 0
    drafted: int = 0
    accepted: int = 0
    per_position: list[list[int]] = field(default_factory=list)  # [accepted, drafted] per position
    per_prompt: list[list[int]] = field(
        default_factory=list
    )  # [rounds, accepted, emitted] per prompt
    spec_tokens: int = 0
    spec_seconds: float = 0.0
    base_tokens: int = 0
    base_seconds: float = 0.0
    mismatches: list[dict] = field(default_factory=list)
    categories: list[str | None] = field(
        default_factory=list
    )  # per prompt, where the data names one
    stopped_by: str | None = None  # a signal's name: a partial result over the prompts done
    planned: int = 0  # the prompts asked for
    drafter: dict = field(default_factory=dict)  # what was judged: path, kind, drafts a round
    lengths: list[int] = field(default_factory=list)  # per prompt, its length in tokens
    positions: list[list[int]] = field(default_factory=list)  # per prompt, accepted per position
    inputs: dict = field(default_factory=dict)  # records read, used, left out and why

    def compare(self, prompt: int, spec: list[int], base: list[int], tok) -> None:
        """Record where speculative decoding's output first differs from greedy's, if it does."""
        if spec != base:
            first = next(
                (j for j, (a, b) in enumerate(zip(spec, base, strict=False)) if a != b),
                min(len(spec), len(base)),
            )
            self.mismatches.append(
                {
                    "prompt": prompt,
                    "first_difference_at": first,
                    "greedy": tok.decode(base),
                    "speculative": tok.decode(spec),
                }
            )

    @property
    def acceptance_length(self) -> float:
        """Engine-style acceptance length: 1 + accepted drafts per round, counting drafts the
        target accepted after the reply's end too (vLLM's and SGLang's counters' figure)."""
        return 1 + self.accepted / self.rounds if self.rounds else 0.0

    @property
    def tokens_per_forward(self) -> float:
        """Tokens emitted per verifying target forward, cut where the reply ends (end of
        sequence or the token limit): what speculative decoding saves. The headline."""
        return sum(p[2] for p in self.per_prompt) / self.rounds if self.rounds else 0.0

    def precise_to(self, half_width: float) -> bool:
        ci = self.intervals(500)["tokens_per_forward"]
        return ci is not None and (ci[1] - ci[0]) / 2 <= half_width

    def intervals(self, n: int = 2000, seed: int = 0) -> dict:
        """95% bootstrap intervals over prompts for both figures (prompts resampled whole:
        the rounds of one prompt are not independent)."""
        import numpy as np

        a = np.array(self.per_prompt, dtype=np.float64).reshape(-1, 3)
        a = a[a[:, 0] > 0]
        if len(a) < 2:
            return {"acceptance_length": None, "tokens_per_forward": None}
        idx = np.random.default_rng(seed).integers(0, len(a), (n, len(a)))
        rounds = a[idx, 0].sum(1)
        acc = 1 + a[idx, 1].sum(1) / rounds
        tpf = a[idx, 2].sum(1) / rounds
        q = lambda x: [round(float(v), 3) for v in np.percentile(x, [2.5, 97.5])]  # noqa: E731
        return {"acceptance_length": q(acc), "tokens_per_forward": q(tpf)}

    def by_category(self) -> dict[str, dict]:
        """Tokens per forward and acceptance length of each category's prompts, with
        intervals: a drafter that helps code and not roleplay shows it here."""
        groups: dict[str, list[list[int]]] = {}
        for cat, row in zip(self.categories, self.per_prompt, strict=False):
            if cat is not None:
                groups.setdefault(cat, []).append(row)
        out = {}
        for cat, rows in sorted(groups.items()):
            sub = EvalResult(
                prompts=len(rows),
                per_prompt=rows,
                rounds=sum(r[0] for r in rows),
                accepted=sum(r[1] for r in rows),
            )
            ci = sub.intervals()
            out[cat] = {
                "prompts": len(rows),
                "tokens_per_forward": round(sub.tokens_per_forward, 3),
                "tokens_per_forward_ci95": ci["tokens_per_forward"],
                "acceptance_length": round(sub.acceptance_length, 3),
                "acceptance_length_ci95": ci["acceptance_length"],
            }
        return out

    def by_length(self) -> dict[str, dict]:
        """Tokens per forward, acceptance length and per-position acceptance of the prompts
        in each context-length bucket (LENGTH_BUCKETS; empty ones left out), with intervals:
        a drafter that holds at short context and not at long shows it here."""
        if not self.lengths or len(self.lengths) != len(self.per_prompt):
            return {}
        out = {}
        for lo, hi in zip(LENGTH_BUCKETS, LENGTH_BUCKETS[1:] + (None,), strict=True):
            pick = [i for i, n in enumerate(self.lengths) if n >= lo and (hi is None or n < hi)]
            if not pick:
                continue
            rows = [self.per_prompt[i] for i in pick]
            sub = EvalResult(
                prompts=len(rows),
                per_prompt=rows,
                rounds=sum(r[0] for r in rows),
                accepted=sum(r[1] for r in rows),
            )
            ci = sub.intervals()
            pos = [sum(self.positions[i][j] for i in pick) for j in range(len(self.per_position))]
            out[_bucket_name(lo, hi)] = {
                "prompts": len(rows),
                "mean_prompt_tokens": round(sum(self.lengths[i] for i in pick) / len(pick)),
                "tokens_per_forward": round(sub.tokens_per_forward, 3),
                "tokens_per_forward_ci95": ci["tokens_per_forward"],
                "acceptance_length": round(sub.acceptance_length, 3),
                "acceptance_length_ci95": ci["acceptance_length"],
                "per_position_acceptance": [
                    round(a / sub.rounds, 3) if sub.rounds else None for a in pos
                ],
            }
        return out

    def to_dict(self) -> dict:
        ci = self.intervals()
        return {
            **({"drafter": self.drafter} if self.drafter else {}),
            "prompts": self.prompts,
            "rounds": self.rounds,
            "draft_tokens": self.drafted,
            "accepted": self.accepted,
            "tokens_per_forward": round(self.tokens_per_forward, 3),
            "tokens_per_forward_ci95": ci["tokens_per_forward"],
            "acceptance_length": round(self.acceptance_length, 3),
            "acceptance_length_ci95": ci["acceptance_length"],
            "per_position_acceptance": [
                round(a / d, 3) if d else None for a, d in self.per_position
            ],
            "spec_tokens_per_s": round(self.spec_tokens / self.spec_seconds, 1)
            if self.spec_seconds
            else 0.0,
            "greedy_tokens_per_s": round(self.base_tokens / self.base_seconds, 1)
            if self.base_seconds
            else 0.0,
            "speedup": round(
                (self.spec_tokens / self.spec_seconds) / (self.base_tokens / self.base_seconds), 3
            )
            if self.spec_seconds and self.base_seconds and self.base_tokens
            else None,
            "lossless": not self.mismatches,
            "mismatches": self.mismatches,
            **(
                {"partial": True, "stopped_by": self.stopped_by, "prompts_planned": self.planned}
                if self.stopped_by
                else {}
            ),
            **(
                {"by_category": self.by_category()}
                if any(c is not None for c in self.categories)
                else {}
            ),
            **({"by_length": self.by_length()} if self.lengths else {}),
            **(
                {
                    "per_prompt": [
                        {"prompt_tokens": n, "rounds": r[0], "accepted": r[1], "emitted": r[2]}
                        for n, r in zip(self.lengths, self.per_prompt, strict=False)
                    ]
                }
                if self.lengths
                else {}
            ),
            **({"inputs": self.inputs} if self.inputs else {}),
        }


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


@dataclass(frozen=True)
class Prompt:
    messages: list[dict]
    category: str | None = None
    tools: list | None = None
    form: str = "openai"
    """The record's form (records.Conversation.form): `text` is continued as it is, and so is
    `prompt` for a target without a chat template."""
    text: str | None = None
    """The text of a `text` record."""

    def raw(self, tokenizer) -> str | None:
        """The text to tokenize as it is, or None where the chat template renders it."""
        if self.form == "text":
            return self.text
        if self.form == "prompt" and not tokenizer.chat_template:
            return self.messages[0]["content"]
        return None


@dataclass
class PromptSet:
    """The prompts of a file, and what was left out of it and why."""

    prompts: list[Prompt]
    records: int
    """Records read (up to the one that filled `limit`)."""
    skipped: dict[str, list[int]] = field(default_factory=dict)
    """Per reason code, the lines (JSON elements) of the records left out."""
    raw_text: int = 0
    """Prompts tokenized as they are, without a chat template (set once the tokenizer is known)."""

    def summary(self) -> str:
        """One line: kept, left out and why (each reason with its first lines)."""
        out = f"{len(self.prompts)} of {self.records} records used as prompts"
        if self.skipped:
            parts = [
                f"{len(lines)} {REASONS.get(code, code)} (line{'s' if len(lines) > 1 else ''} "
                f"{', '.join(map(str, lines[:3]))}{', ...' if len(lines) > 3 else ''})"
                for code, lines in sorted(self.skipped.items())
            ]
            out += "; left out: " + "; ".join(parts)
        return out

    def __iter__(self):
        return iter(self.prompts)

    def __len__(self) -> int:
        return len(self.prompts)

    def to_dict(self) -> dict:
        return {
            "records": self.records,
            "used": len(self.prompts),
            "raw_text": self.raw_text,
            "skipped": {
                code: {
                    "count": len(lines),
                    "reason": REASONS.get(code, code),
                    "first_lines": lines[:5],
                }
                for code, lines in sorted(self.skipped.items())
            },
        }


def read_prompts(path: Path, limit: int | None, max_error_rate: float = 1.0) -> PromptSet:
    """The prompts of `path`, checked before any model loads: a record whose last turn is
    the user's is a prompt as it is, as is `{"prompt": "..."}`; a conversation is cut before
    its last assistant turn; a `{"text": ...}` record is continued as it is. A `category` field is kept for the per-category figures, the
    record's `tools` for the chat template. Records that cannot be prompts are counted by
    reason; more than `max_error_rate` of them is an error, as in `prepare`."""
    path = Path(path)
    if path.is_dir():
        raise FileNotFoundError(
            f"--data {path} is a directory; give a JSONL file of prompts or conversations"
        )
    if not path.is_file():
        raise FileNotFoundError(f"--data {path}: no such file")
    got = PromptSet([], 0)
    for rec in iter_records(path):
        got.records += 1
        try:
            obj = parse_record(rec)
            conv = read_conversation(obj, prompt=True)
            if conv.form != "text":
                conv = prompt_of(conv)
        except RecordError as exc:
            got.skipped.setdefault(exc.code, []).append(rec.line)
            continue
        cat = obj.get("category")
        got.prompts.append(
            Prompt(
                conv.messages,
                str(cat) if cat is not None else None,
                conv.tools,
                conv.form,
                conv.text,
            )
        )
        if limit and len(got.prompts) >= limit:
            break
    if not got.prompts:
        raise ValueError(
            f"{path}: no usable prompts ({got.summary() if got.records else 'the file is empty'}); "
            'give records with a last user turn, {"prompt": ...} or conversations with an assistant turn'
        )
    left = sum(len(v) for v in got.skipped.values())
    if left > max_error_rate * got.records:
        raise PromptsRefused(
            f"{path}: {got.summary()}: more than --max-error-rate {max_error_rate:g} "
            f"({left / got.records:.1%}); fix the records or raise --max-error-rate"
        )
    return got


def _tokenizer_for(
    model_dir: str,
    drafter_dir: str,
    trust_remote_code: bool,
    template_kwargs: dict | None,
    chat_template: str | None,
    asked: PromptSet,
    data: str,
) -> tuple[object, dict | None]:
    """The target's tokenizer, refused when the drafter's training data was made with
    another one; and the template variables to render with (given, or the data's). The chat
    template is the `chat_template` file's where given, else the one the training data was
    prepared with (`prepare --chat-template`), else the tokenizer's own; conversations for a
    target with none of them are refused here, before the model loads."""
    from eyas.data.dataset import TokenizerMismatch, tokenizer_fingerprint

    made = export_rendering(drafter_dir)
    template = read_chat_template(chat_template) or made.get("chat_template")
    tok = load_tokenizer(model_dir, trust_remote_code, template)
    chats = sum(p.raw(tok) is None for p in asked.prompts)
    require_chat_template(tok, model_dir, chats, len(asked.prompts), f"--data {data}")
    asked.raw_text = len(asked.prompts) - chats
    want, got = made.get("tokenizer_fingerprint"), tokenizer_fingerprint(tok)
    if want and want != got:
        raise TokenizerMismatch(
            f"{drafter_dir} was trained on data made with another tokenizer or chat template "
            f"(fingerprint {want}) than {model_dir}'s (fingerprint {got}): it would be judged on "
            "prompts it never saw the like of. Give the target it was trained for, and no "
            "--chat-template or the one its data was prepared with"
        )
    return tok, template_kwargs if template_kwargs is not None else made.get("chat_template_kwargs")


class DraftLengthRefused(UsageError):
    """More draft tokens a round asked for than the export drafts (a usage error, exit 2)."""


def draft_length(drafter_dir: str, k: int | None) -> tuple[int, dict]:
    """The tokens to draft a round (`k`, else what the export serves) and what is judged (its
    path, kind and drafts a round, for the report); more than a block drafts is refused."""
    served = drafts_per_round(drafter_dir, k)
    if k is not None and k > served:
        raise DraftLengthRefused(
            f"--draft-tokens {k}: {drafter_dir} drafts {served} tokens a round "
            f"(its block); give --draft-tokens {served} or fewer"
        )
    k = k or served
    longest = export_rendering(drafter_dir).get("longest_sample")
    return k, {
        "path": str(Path(drafter_dir).resolve()),
        "kind": export_kind(drafter_dir).name,
        "draft_tokens": k,
        "serves": served,
        **({"longest_training_sample": longest} if longest else {}),
    }


class PromptsRefused(ValueError):
    """Too many records of --data cannot be prompts (exit 1, before the model loads)."""


def render_prompts(
    tokenizer, prompts: list[Prompt], template_kwargs: dict | None = None
) -> list[list[int]]:
    """Each prompt rendered as `prepare` renders a conversation (the record's tools, the
    dataset's template variables), with a generation prompt, and tokenized as `prepare` does;
    raw text (`Prompt.raw`) tokenized as `prepare` tokenizes a text record."""
    out = []
    for p in prompts:
        text = p.raw(tokenizer)
        if text is None:
            text = chat_text(
                tokenizer,
                p.messages,
                tools=p.tools,
                template_kwargs=template_kwargs,
                generation_prompt=True,
            )
        out.append(tokenizer(text, add_special_tokens=False)["input_ids"])
    return out


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


def evaluate(
    model_dir: str,
    drafter_dir: str,
    data: str,
    *,
    k: int | None = None,
    max_new_tokens: int = _D.max_new_tokens,
    limit: int | None = _D.limit,
    precision: float | None = _D.precision,
    trust_remote_code: bool = False,
    progress: bool = True,
    greedy_cache: dict | None = None,
    target_cache: dict | None = None,
    device: str = _D.device,
    chat_template_kwargs: dict | None = None,
    chat_template: str | None = None,
    max_error_rate: float = _D.max_error_rate,
) -> EvalResult:
    """Speculative against greedy decoding over the prompts of `data` (at most `limit`),
    stopping early once the 95% interval of tokens per forward is within +-`precision`
    (checked every 25 prompts from 50 on; None: every prompt). `greedy_cache` keeps plain
    greedy decoding's output and time per prompt across calls with the same target (it
    does not depend on the drafter), so comparing drafters decodes each prompt greedily once;
    `target_cache` keeps the loaded target across such calls.
    `device`: `auto` (the first GPU where there is one), `cpu`, `cuda` or `cuda:K`; target
    and drafter both run there, in float32. Prompts are rendered as the drafter's training
    data was (its template variables unless `chat_template_kwargs` is given), and a target
    whose tokenizer is not the one that data was made with is refused."""
    from eyas.targets.target import check_model_dir, load_causal_lm, resolve_device

    check_model_dir(model_dir, tokenizer=True, weights=True)
    asked = read_prompts(Path(data), limit, max_error_rate)  # before minutes of loading the model
    tok, template_kwargs = _tokenizer_for(
        model_dir, drafter_dir, trust_remote_code, chat_template_kwargs, chat_template, asked, data
    )
    try:
        dev = torch.device(resolve_device(device))
    except RuntimeError:
        raise ValueError(
            f"--device {device}: not a device; give auto, cpu, cuda or cuda:K"
        ) from None
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"--device {device}: evaluate runs on cpu or cuda")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device {device}: this machine has no GPU that torch can use")
    if not Path(drafter_dir).is_dir():  # before minutes of loading the model
        raise FileNotFoundError(f"{drafter_dir}: no such exported drafter directory")
    k, judged = draft_length(drafter_dir, k)
    key = (str(model_dir), str(dev))
    if target_cache is not None and key in target_cache:
        model = target_cache[key]
    else:
        with still_working("loading the target", enabled=progress):
            model = load_causal_lm(model_dir, torch.float32, trust_remote_code).eval().to(dev)
        if target_cache is not None:
            target_cache[key] = model
    if dev.type == "cpu":
        from eyas.host.cpu import configure_threads

        configure_threads(model.config.hidden_size)
    drafter, aux_hf = load_export(drafter_dir)
    drafter.to(dev)
    if (
        drafter.config.hidden_size != model.config.hidden_size
        or drafter.config.vocab_size != model.config.vocab_size
    ):
        raise ValueError(
            f"{drafter_dir}: drafter (H={drafter.config.hidden_size}, V={drafter.config.vocab_size}) does not "
            f"fit target {model_dir} (H={model.config.hidden_size}, V={model.config.vocab_size})"
        )
    eos = {tok.eos_token_id} | set(_as_list(model.config.eos_token_id))
    eos.discard(None)
    prompts = render_prompts(tok, asked.prompts, template_kwargs)
    res = EvalResult(
        prompts=len(prompts),
        per_position=[[0, 0] for _ in range(k)],
        categories=[p.category for p in asked.prompts],
        inputs=asked.to_dict(),
        drafter=judged,
    )
    tap = AuxTap(model, aux_hf)
    proposer = export_kind(drafter_dir).proposer(drafter, aux_hf)

    def extra() -> str:
        if not res.rounds:
            return ""
        speed = res.spec_tokens / res.spec_seconds if res.spec_seconds else 0.0
        return (
            f"tokens/forward {res.tokens_per_forward:.2f}, acceptance {res.acceptance_length:.2f}, "
            f"{speed:.0f} tok/s speculative"
        )

    rep = Reporter("evaluate", len(prompts), unit="prompts", enabled=progress, extra=extra)
    res.planned = len(prompts)
    try:
        with StopSignals() as stop, rep:
            for i, p in enumerate(prompts):
                before = copy.deepcopy(res)  # what a signal mid-prompt goes back to
                try:
                    with stop.abandoning(_Stopped):
                        _decode_one(
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
                            str(model_dir),
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
    finally:
        tap.remove()
    return res


def paired_difference(a: EvalResult, b: EvalResult, n: int = 2000, seed: int = 0) -> dict:
    """`b` against `a` on the same prompts (the first ones both decoded): tokens per forward
    of each, their difference and its 95% interval with the prompts resampled alike for both
    (a paired bootstrap: a prompt that is easy for one is easy for the other)."""
    import numpy as np

    m = min(len(a.per_prompt), len(b.per_prompt))
    x = np.array(a.per_prompt[:m], dtype=np.float64).reshape(-1, 3)
    y = np.array(b.per_prompt[:m], dtype=np.float64).reshape(-1, 3)
    tpf = lambda r: r[..., 2].sum(-1) / np.maximum(r[..., 0].sum(-1), 1)  # noqa: E731
    out = {
        "a": a.drafter.get("path"),
        "b": b.drafter.get("path"),
        "prompts": m,
        "tokens_per_forward": [round(float(tpf(x)), 3), round(float(tpf(y)), 3)],
        "difference": round(float(tpf(y) - tpf(x)), 3),
        "difference_ci95": None,
    }
    if m >= 2:
        idx = np.random.default_rng(seed).integers(0, m, (n, m))
        d = tpf(y[idx]) - tpf(x[idx])
        out["difference_ci95"] = [round(float(v), 3) for v in np.percentile(d, [2.5, 97.5])]
    return out


class _Stopped(Exception):
    """A signal came while a prompt decoded: that prompt is dropped, its partial counts too."""


def _decode_one(
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


def evaluate_vllm(
    model_dir: str,
    drafter_dir: str,
    data: str,
    *,
    k: int | None = None,
    max_new_tokens: int = _D.max_new_tokens,
    limit: int | None = _D.limit,
    tensor_parallel_size: int = _D.tensor_parallel_size,
    trust_remote_code: bool = False,
    progress: bool = True,
    chat_template_kwargs: dict | None = None,
    chat_template: str | None = None,
    max_error_rate: float = _D.max_error_rate,
) -> EvalResult:
    """The same measurement with vLLM as the judge: greedy generation without and with the
    exported drafter (EAGLE-3, chain of `k`), vLLM's own speculative-decoding counters for
    acceptance, and a token-for-token comparison of the two outputs."""
    import gc

    import torch

    from eyas.host.ui import console
    from eyas.run.store import Layout
    from eyas.targets.backends import BackendSpec, backend_module

    engine_kwargs, import_vllm = (
        backend_module("vllm").engine_kwargs,
        backend_module("vllm").import_vllm,
    )
    from eyas.targets.target import check_model_dir, resolve_dtype

    check_model_dir(model_dir, tokenizer=True, weights=True)
    asked = read_prompts(Path(data), limit, max_error_rate)
    if not Path(drafter_dir).is_dir():
        raise FileNotFoundError(f"{drafter_dir}: no such exported drafter directory")
    load_export(drafter_dir)  # a clear error for a directory that is not an export
    k, judged = draft_length(drafter_dir, k)
    tok, template_kwargs = _tokenizer_for(
        model_dir, drafter_dir, trust_remote_code, chat_template_kwargs, chat_template, asked, data
    )
    import_vllm()
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    prompts = render_prompts(tok, asked.prompts, template_kwargs)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = resolve_dtype("auto", device)
    spec = BackendSpec(
        model=model_dir,
        aux_layers=(),
        device=device,
        dtype=dtype,
        store_dtype=dtype,
        layout=Layout(),
        tensor_parallel_size=tensor_parallel_size,
        trust_remote_code=trust_remote_code,
        max_model_len=max(len(p) for p in prompts) + max_new_tokens + k + 8,
    )
    params = SamplingParams(temperature=0.0, max_tokens=max_new_tokens)
    inputs = [TokensPrompt(prompt_token_ids=p) for p in prompts]
    res = EvalResult(
        prompts=len(prompts),
        per_position=[[0, 0] for _ in range(k)],
        inputs=asked.to_dict(),
        drafter=judged,
    )

    def run(speculative: dict | None) -> tuple[list[list[int]], float, object]:
        if progress:
            console.print(
                f"evaluate (vllm): {'with' if speculative else 'without'} the drafter, "
                f"{len(prompts)} prompts",
                markup=False,
                highlight=False,
            )
        try:
            llm = LLM(
                **{**engine_kwargs(spec), "disable_log_stats": speculative is None},
                **({"speculative_config": speculative} if speculative else {}),
            )
        except RuntimeError as exc:  # vLLM's own cause is in its log, above on stderr
            what = "the target with the drafter" if speculative else "the target"
            raise ValueError(
                f"vLLM could not start {what} (its log above says why): {exc}"
            ) from None
        t0 = time.perf_counter()
        outs = llm.generate(inputs, params, use_tqdm=False)
        seconds = time.perf_counter() - t0
        metrics = llm.get_metrics() if speculative else []
        del llm
        gc.collect()  # shuts the engine down before the next one starts
        return [list(o.outputs[0].token_ids) for o in outs], seconds, metrics

    base, res.base_seconds, _ = run(None)
    spec_out, res.spec_seconds, metrics = run(vllm_speculative_config(drafter_dir, k))
    for m in metrics:
        if m.name == "vllm:spec_decode_num_drafts":
            res.rounds += m.value
        elif m.name == "vllm:spec_decode_num_draft_tokens":
            res.drafted += m.value
        elif m.name == "vllm:spec_decode_num_accepted_tokens":
            res.accepted += m.value
        elif m.name == "vllm:spec_decode_num_accepted_tokens_per_pos":
            for j, v in enumerate(m.values[:k]):
                res.per_position[j][0] += v
    for j in range(k):
        res.per_position[j][1] = res.rounds
    res.base_tokens = sum(len(x) for x in base)
    res.spec_tokens = sum(len(x) for x in spec_out)
    # vLLM's counters are totals over the run, not per prompt: one row, so no interval. What
    # it emitted after each prompt's first token is its output, already cut at the reply's end.
    res.per_prompt = [[res.rounds, res.accepted, sum(max(len(x) - 1, 0) for x in spec_out)]]
    for i, (a, b) in enumerate(zip(spec_out, base, strict=True)):
        res.compare(i, a, b, tok)
    return res


def _as_list(x) -> list:
    return list(x) if isinstance(x, (list, tuple)) else [x]


# ------------------------------------------------------------------ the judges (--engine)


@dataclass(frozen=True)
class Judge:
    """One way of judging drafters, named by `--engine`: the function that judges one, whether
    it can judge several prompt by prompt (paired differences need per-prompt figures), and
    the options of `EvaluateConfig` it takes."""

    run: object  # (model, drafter, data, **options) -> EvalResult
    paired: bool
    options: object  # (cfg, several drafters) -> dict of keyword arguments for `run`


def _hf_options(cfg, several: bool) -> dict:
    # several drafters: every prompt for each, so that they are judged on the same ones
    return {"precision": None if several else (cfg.precision or None), "device": cfg.device,
            "greedy_cache": {}, "target_cache": {}}  # fmt: skip


JUDGES = {
    "hf": Judge(run=evaluate, paired=True, options=_hf_options),
    "vllm": Judge(run=evaluate_vllm, paired=False,
                  options=lambda cfg, _several: {"tensor_parallel_size": cfg.tensor_parallel_size}),
}  # fmt: skip


def judge(
    cfg, model: str, drafters: list[str], data: str, chat_template_kwargs: dict | None = None
) -> tuple[list[EvalResult], list[dict]]:
    """Every drafter judged by `cfg.engine` on the same prompts (the target's greedy pass
    shared where the judge can), in order, until one is stopped; and each one's paired
    difference with the first. UsageError for drafters the judge cannot compare."""
    j = JUDGES[cfg.engine]
    if len(drafters) > 1 and not j.paired:
        paired = ", ".join(n for n, o in JUDGES.items() if o.paired)
        raise UsageError(
            f"several --drafter are compared prompt by prompt, which --engine {cfg.engine}'s "
            f"run totals cannot do: give them with --engine {paired}, or one at a time"
        )
    if len(set(drafters)) < len(drafters):
        raise UsageError("the same --drafter is given twice")
    kw = dict(k=cfg.draft_tokens, max_new_tokens=cfg.max_new_tokens, limit=cfg.limit or None,
              trust_remote_code=cfg.trust_remote_code, max_error_rate=cfg.max_error_rate,
              chat_template_kwargs=chat_template_kwargs, chat_template=cfg.chat_template,
              **j.options(cfg, len(drafters) > 1))  # fmt: skip
    results = []
    for dr in drafters:
        results.append(j.run(model, dr, data, **kw))
        if results[-1].stopped_by:
            break
    return results, [paired_difference(results[0], r) for r in results[1:]]
