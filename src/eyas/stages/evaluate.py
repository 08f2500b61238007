"""Stage 6, `evaluate`: real speculative decoding of the target with an exported drafter.

The prompts are read and rendered as the drafter's training data was, the export and the
tokens it drafts a round are checked, and a judge (`--engine`, `JUDGES`) decodes every
prompt greedily and speculatively: eyas's own decoder (`eyas.decoders.hf`) or vLLM. The
output is compared token for token with plain greedy decoding of the target (lossless), and
both are timed; several drafters are judged on the same prompts, with paired differences.
"""

from __future__ import annotations

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
from eyas.decoders.hf import AuxTap, decode_all
from eyas.decoders.result import EvalResult
from eyas.errors import ProblemError, UsageError
from eyas.host.ui import still_working
from eyas.stages.card import record_evaluation
from eyas.stages.config import EvaluateConfig  # its defaults, written once, are the functions' too
from eyas.stages.eval_report import render_inputs, render_paired, render_result, stopped_line
from eyas.stages.export import (
    drafts_per_round,
    export_kind,
    export_rendering,
    load_export,
    vllm_speculative_config,
)
from eyas.targets.target import load_tokenizer, read_chat_template, require_chat_template


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
        raise UsageError(
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


class PromptsRefused(ProblemError):
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


@dataclass
class _Inputs:
    """What a judge decodes, checked before any model loads: the prompts as read, the
    target's tokenizer, the prompts rendered and tokenized, the tokens drafted a round and
    what is judged (for the report)."""

    asked: PromptSet
    tok: object
    prompts: list[list[int]]
    k: int
    judged: dict

    def result(self, **extra) -> EvalResult:
        return EvalResult(
            prompts=len(self.prompts),
            per_position=[[0, 0] for _ in range(self.k)],
            inputs=self.asked.to_dict(),
            drafter=self.judged,
            **extra,
        )


def _inputs(
    model_dir: str,
    drafter_dir: str,
    data: str,
    k: int | None,
    limit: int | None,
    max_error_rate: float,
    trust_remote_code: bool,
    chat_template_kwargs: dict | None,
    chat_template: str | None,
) -> _Inputs:
    from eyas.targets.target import check_model_dir, target_facts

    check_model_dir(model_dir, tokenizer=True, weights=True)
    asked = read_prompts(Path(data), limit, max_error_rate)  # before minutes of loading the model
    tok, template_kwargs = _tokenizer_for(
        model_dir, drafter_dir, trust_remote_code, chat_template_kwargs, chat_template, asked, data
    )
    if not Path(drafter_dir).is_dir():
        raise FileNotFoundError(f"{drafter_dir}: no such exported drafter directory")
    k, judged = draft_length(drafter_dir, k)
    if ctx := target_facts(model_dir).max_positions:
        judged["target_context"] = ctx  # the report says what runs past it
    return _Inputs(asked, tok, render_prompts(tok, asked.prompts, template_kwargs), k, judged)


def _device(device: str) -> torch.device:
    from eyas.targets.target import resolve_device

    try:
        dev = torch.device(resolve_device(device))
    except RuntimeError:
        raise UsageError(
            f"--device {device}: not a device; give auto, cpu, cuda or cuda:K"
        ) from None
    if dev.type not in ("cpu", "cuda"):
        raise UsageError(f"--device {device}: evaluate runs on cpu or cuda")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise UsageError(f"--device {device}: this machine has no GPU that torch can use")
    return dev


def _target(model_dir: str, dev, trust_remote_code: bool, cache: dict | None, progress: bool):
    """The target in float32 on `dev`, from `cache` where it was loaded before."""
    from eyas.targets.target import load_causal_lm

    key = (str(model_dir), str(dev))
    model = cache.get(key) if cache is not None else None
    if model is None:
        with still_working("loading the target", enabled=progress):
            model = load_causal_lm(model_dir, torch.float32, trust_remote_code).eval().to(dev)
        if cache is not None:
            cache[key] = model
    if dev.type == "cpu":
        from eyas.host.cpu import configure_threads

        configure_threads(model.config.hidden_size)
    return model


def _drafter(drafter_dir: str, model, model_dir: str, dev):
    """The export's drafter on `dev` and the target layers it reads; refused where it was
    made for a target of another width or vocabulary."""
    drafter, aux_hf = load_export(drafter_dir, model_dir)
    drafter.to(dev)
    d, t = drafter.config, model.config
    if d.hidden_size != t.hidden_size or d.vocab_size != t.vocab_size:
        raise UsageError(
            f"{drafter_dir}: drafter (H={d.hidden_size}, V={d.vocab_size}) does not "
            f"fit target {model_dir} (H={t.hidden_size}, V={t.vocab_size})"
        )
    return drafter, aux_hf


def evaluate(
    model_dir: str,
    drafter_dir: str,
    data: str,
    *,
    k: int | None = None,
    max_new_tokens: int = EvaluateConfig.max_new_tokens,
    limit: int | None = EvaluateConfig.limit,
    precision: float | None = EvaluateConfig.precision,
    trust_remote_code: bool = False,
    progress: bool = True,
    greedy_cache: dict | None = None,
    target_cache: dict | None = None,
    device: str = EvaluateConfig.device,
    chat_template_kwargs: dict | None = None,
    chat_template: str | None = None,
    max_error_rate: float = EvaluateConfig.max_error_rate,
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
    dev = _device(device)  # a usage error, before anything is read
    got = _inputs(
        model_dir,
        drafter_dir,
        data,
        k,
        limit,
        max_error_rate,
        trust_remote_code,
        chat_template_kwargs,
        chat_template,
    )
    model = _target(model_dir, dev, trust_remote_code, target_cache, progress)
    drafter, aux_hf = _drafter(drafter_dir, model, model_dir, dev)
    eos = {got.tok.eos_token_id} | set(_as_list(model.config.eos_token_id))
    eos.discard(None)
    tap = AuxTap(model, aux_hf)
    try:
        return decode_all(
            model,
            tap,
            export_kind(drafter_dir).proposer(drafter, aux_hf),
            got.prompts,
            got.result(categories=[p.category for p in got.asked.prompts]),
            k=got.k,
            max_new_tokens=max_new_tokens,
            eos=eos,
            tok=got.tok,
            greedy_cache=greedy_cache,
            model_key=str(model_dir),
            precision=precision,
            progress=progress,
        )
    finally:
        tap.remove()


def paired_difference(a: EvalResult, b: EvalResult, n: int = 2000, seed: int = 0) -> dict:
    """`b` against `a` on the same prompts (the first ones both decoded): tokens per forward
    of each, their difference and its 95% interval with the prompts resampled alike for both
    (a paired bootstrap: a prompt that is easy for one is easy for the other)."""
    import numpy as np

    m = min(len(a.per_prompt), len(b.per_prompt))
    grouped = bool(a.groups or b.groups)  # vLLM's totals per length bucket: no prompt to resample
    x = np.array(a.per_prompt[:m], dtype=np.float64).reshape(-1, 3)
    y = np.array(b.per_prompt[:m], dtype=np.float64).reshape(-1, 3)
    tpf = lambda r: r[..., 2].sum(-1) / np.maximum(r[..., 0].sum(-1), 1)  # noqa: E731
    out = {
        "a": a.drafter.get("path"),
        "b": b.drafter.get("path"),
        "prompts": min(a.prompts, b.prompts) if grouped else m,
        "tokens_per_forward": [round(float(tpf(x)), 3), round(float(tpf(y)), 3)],
        "difference": round(float(tpf(y) - tpf(x)), 3),
        "difference_ci95": None,
    }
    if m >= 2 and not grouped:
        idx = np.random.default_rng(seed).integers(0, m, (n, m))
        d = tpf(y[idx]) - tpf(x[idx])
        out["difference_ci95"] = [round(float(v), 3) for v in np.percentile(d, [2.5, 97.5])]
    return out


def evaluate_vllm(
    model_dir: str,
    drafter_dir: str,
    data: str,
    *,
    k: int | None = None,
    max_new_tokens: int = EvaluateConfig.max_new_tokens,
    limit: int | None = EvaluateConfig.limit,
    tensor_parallel_size: int = EvaluateConfig.tensor_parallel_size,
    trust_remote_code: bool = False,
    progress: bool = True,
    chat_template_kwargs: dict | None = None,
    chat_template: str | None = None,
    max_error_rate: float = EvaluateConfig.max_error_rate,
) -> EvalResult:
    """The same measurement with vLLM as the judge (`eyas.decoders.vllm`): greedy generation
    without and with the exported drafter, vLLM's own speculative-decoding counters for
    acceptance, and a token-for-token comparison of the two outputs."""
    from eyas.decoders.vllm import judge_with_vllm

    got = _inputs(
        model_dir,
        drafter_dir,
        data,
        k,
        limit,
        max_error_rate,
        trust_remote_code,
        chat_template_kwargs,
        chat_template,
    )
    load_export(drafter_dir, model_dir)  # a clear error for a directory that is not an export
    return judge_with_vllm(
        model_dir,
        got.prompts,
        vllm_speculative_config(drafter_dir, got.k),
        got.result(),
        got.tok,
        k=got.k,
        max_new_tokens=max_new_tokens,
        tensor_parallel_size=tensor_parallel_size,
        trust_remote_code=trust_remote_code,
        progress=progress,
    )


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
    return {
        "precision": None if several else (cfg.precision or None),
        "device": cfg.device,
        "greedy_cache": {},
        "target_cache": {},
    }


JUDGES = {
    "hf": Judge(run=evaluate, paired=True, options=_hf_options),
    "vllm": Judge(
        run=evaluate_vllm,
        paired=False,
        options=lambda cfg, _several: {"tensor_parallel_size": cfg.tensor_parallel_size},
    ),
}


@dataclass(frozen=True)
class EvaluateSummary:
    """Every drafter's evaluation (`EvalResult`, its engine's), in the order given, and each
    one's paired difference with the first."""

    engine: str
    data: str
    asked: int
    results: list[EvalResult]
    pairs: list[dict]

    def dicts(self) -> list[dict]:
        return [{"engine": self.engine, **r.to_dict()} for r in self.results]

    def to_json(self) -> dict:
        ds = self.dicts()
        return ds[0] if self.asked == 1 else {"drafters": ds, "paired": self.pairs}

    @property
    def lossless(self) -> bool:
        return not any(r.mismatches for r in self.results)

    def stopped(self) -> str | None:
        """Where a judge stopped early (by a signal), or None."""
        return stopped_line(self.dicts(), self.asked)

    def render(self) -> str:
        """The inputs used, each drafter's result, the paired differences: as text."""
        import io

        from rich.console import Console

        out = Console(file=io.StringIO(), record=True, width=100, soft_wrap=True)
        ds = self.dicts()
        render_inputs(out, ds[0], self.data)
        for d in ds:
            render_result(out, d)
        render_paired(out, self.pairs)
        return out.export_text().rstrip("\n")


def judge(cfg: EvaluateConfig) -> EvaluateSummary:
    """Every drafter judged by `cfg.engine` on the same prompts (the target's greedy pass
    shared where the judge can), in order, until one is stopped; and each one's paired
    difference with the first. UsageError for drafters the judge cannot compare."""
    model, drafters, data = cfg.model, list(cfg.drafters), cfg.data
    j = JUDGES[cfg.engine]
    if len(drafters) > 1 and not j.paired:
        paired = ", ".join(n for n, o in JUDGES.items() if o.paired)
        raise UsageError(
            f"several --drafter are compared prompt by prompt, which --engine {cfg.engine}'s "
            f"run totals cannot do: give them with --engine {paired}, or one at a time"
        )
    if len(set(drafters)) < len(drafters):
        raise UsageError("the same --drafter is given twice")
    kw = dict(
        k=cfg.draft_tokens,
        max_new_tokens=cfg.max_new_tokens,
        limit=cfg.limit or None,
        trust_remote_code=cfg.trust_remote_code,
        max_error_rate=cfg.max_error_rate,
        chat_template_kwargs=cfg.chat_template_kwargs,
        chat_template=cfg.chat_template,
        **j.options(cfg, len(drafters) > 1),
    )
    results = []
    for dr in drafters:
        results.append(j.run(model, dr, data, **kw))
        # An eyas export's card says what was measured of it (a stopped run is not recorded).
        record_evaluation(Path(dr), results[-1].to_dict(), data, cfg.engine)
        if results[-1].stopped_by:
            break
    pairs = [paired_difference(results[0], r) for r in results[1:]]
    return EvaluateSummary(cfg.engine, data, len(drafters), results, pairs)
