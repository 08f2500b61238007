"""Facts about a target that every backend shares: its config, fingerprint, aux-layer
defaults, final norm, batch plan and the dtype it computes in.

Nothing here loads weights: a run's intent (`run.json`) is written from these facts
before a backend spends minutes loading a large model.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import torch

from eyas.errors import UsageError
from eyas.run.fsutil import read_json

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class ModelDirError(UsageError):
    """A model path that is not a usable model directory (a usage error, exit 2)."""


def check_model_dir(path: str | Path, *, tokenizer: bool = False, weights: bool = False) -> Path:
    """The directory, or a ModelDirError saying plainly what is missing."""
    p = Path(path)
    if not p.exists():
        raise ModelDirError(f"no model directory at {p}")
    if not p.is_dir():
        raise ModelDirError(f"{p} is a file, not a model directory")
    if not (p / "config.json").is_file():
        raise ModelDirError(f"{p} has no config.json (not a transformers model directory)")
    tokenizer_files = (
        "tokenizer.json",
        "tokenizer.model",
        "tiktoken.model",
        "vocab.json",
        "tokenizer_config.json",
    )
    if tokenizer and not any((p / f).is_file() for f in tokenizer_files):
        raise ModelDirError(f"{p} has no tokenizer (tokenizer.json or tokenizer.model)")
    if weights and not any(p.glob("*.safetensors")):
        raise ModelDirError(f"{p} has no safetensors weights")
    return p


@dataclass(frozen=True)
class TargetFacts:
    model_type: str
    num_hidden_layers: int
    hidden_size: int
    vocab_size: int
    rms_norm_eps: float
    architectures: tuple[str, ...]
    max_positions: int | None = None
    """The context the target was made for (max_position_embeddings), where it says."""


def past_context(model_dir: str | Path, lengths, what: str) -> str | None:
    """One line where some of `lengths` (tokens per sample) run past the target's context:
    how many, and what follows; None where none does or the target does not say."""
    ctx = target_facts(model_dir).max_positions
    over = [n for n in lengths if ctx and n > ctx]
    if not over:
        return None
    return (
        f"{len(over)} of {len(lengths)} {what} are longer than the target's context "
        f"(max_position_embeddings {ctx}; the longest {max(over)} tokens): their states past "
        f"position {ctx} are the target's beyond what it was made for, not what it serves. "
        f"prepare with --max-length {ctx} to cut them"
    )


def target_facts(model_dir: str | Path) -> TargetFacts:
    """Sizes from config.json alone (a multimodal config's text part where it has one)."""
    cfg = read_json(check_model_dir(model_dir) / "config.json")
    text = cfg.get("text_config") if "hidden_size" not in cfg else None
    c = text if isinstance(text, dict) else cfg
    try:
        return TargetFacts(
            str(c.get("model_type", cfg.get("model_type", "?"))),
            int(c["num_hidden_layers"]),
            int(c["hidden_size"]),
            int(c["vocab_size"]),
            float(c.get("rms_norm_eps", 1e-6)),
            tuple(cfg.get("architectures") or ()),
            int(c["max_position_embeddings"]) if c.get("max_position_embeddings") else None,
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise ModelDirError(
            f"{model_dir}/config.json lacks a usable {exc} (need num_hidden_layers, hidden_size, vocab_size)"
        ) from None


# Where a wrapper's checkpoint keeps its language model, as the causal LM's own names: the
# hub layout of Kimi-K2.5 and LLaVA-style wrappers (`language_model.model.*`,
# `language_model.lm_head`), transformers' own multimodal layout (`model.language_model.*`),
# and what transformers' Kimi-K2.5 class saves: its conversion renames the vision tower's
# `blocks` to `layers`, so undoing it on save names the decoder layers `blocks` too.
TEXT_KEY_MAPPING = {
    r"^language_model\.model\.blocks\.": "model.layers.",
    r"^language_model\.model\.": "model.",
    r"^language_model\.lm_head\.": "lm_head.",
    r"^model\.language_model\.": "model.",
}


def _quantization(cfg: dict) -> str | None:
    text = cfg.get("text_config") if isinstance(cfg.get("text_config"), dict) else {}
    q = text.get("quantization_config") or cfg.get("quantization_config")
    if not isinstance(q, dict):
        return None
    return " ".join(str(q[k]) for k in ("quant_method", "format") if q.get(k)) or "quantized"


def check_transformers_can_run(model_dir: str | Path, device: str) -> None:
    """Refuse, before anything is written, a checkpoint transformers cannot run here."""
    raw = read_json(Path(model_dir) / "config.json")
    if (q := _quantization(raw)) and not str(device).startswith(("cuda", "multi")):
        raise ModelDirError(
            f"{model_dir} is quantized ({q}); transformers cannot run it on this machine. "
            "Extract with --backend vllm, which runs such checkpoints"
        )


def load_causal_lm(
    model_dir: str | Path, dtype: torch.dtype, trust_remote_code: bool = False, **kw
):
    """The target's causal language model, for running text through it. A plain causal LM
    loads as it is; a wrapper whose language model sits in a `text_config` (Kimi-K2.5 and
    other `*ForConditionalGeneration` families) loads its language model only, from the
    checkpoint's own names, never the vision tower's weights; its states equal the
    wrapper's own language-model forward. Anything else is a ModelDirError in one line."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    raw = read_json(Path(model_dir) / "config.json")
    arch = (raw.get("architectures") or [raw.get("model_type", "?")])[0]
    check_transformers_can_run(model_dir, "cuda" if torch.cuda.is_available() else "cpu")
    try:
        cfg = AutoConfig.from_pretrained(
            model_dir, local_files_only=True, trust_remote_code=trust_remote_code
        )
    except (ValueError, KeyError) as exc:
        raise ModelDirError(
            f"{model_dir}: transformers does not know architecture {arch} ({exc})"
        ) from None
    args = dict(dtype=dtype, trust_remote_code=trust_remote_code, local_files_only=True, **kw)
    if type(cfg) not in MODEL_FOR_CAUSAL_LM_MAPPING and not getattr(cfg, "auto_map", None):
        text = cfg.get_text_config() if hasattr(cfg, "get_text_config") else None
        if text is None or text is cfg or type(text) not in MODEL_FOR_CAUSAL_LM_MAPPING:
            raise ModelDirError(
                f"{model_dir}: eyas cannot run architecture {arch}: it is neither a causal "
                "language model nor a wrapper around one (a text_config)"
            )
        args.update(config=text, key_mapping=TEXT_KEY_MAPPING)
    try:
        model, info = AutoModelForCausalLM.from_pretrained(
            model_dir, output_loading_info=True, **args
        )
    except ValueError as exc:
        if "Unrecognized configuration class" in str(exc):
            raise ModelDirError(
                f"{model_dir}: eyas cannot run architecture {arch} with transformers"
            ) from None
        raise
    # A tensor the checkpoint lacks is left at its random initialisation: such a target
    # runs, and every state it gives is wrong in a way no checksum can see. A wrapper's
    # checkpoint also holds its vision tower, which the language model does not take.
    unexpected = [] if "key_mapping" in args else sorted(info.get("unexpected_keys") or [])
    _refuse_incomplete(
        model_dir,
        sorted(info.get("missing_keys") or []),
        unexpected,
        [str(m[0]) for m in info.get("mismatched_keys") or []],
    )
    return model


def _refuse_incomplete(model_dir, missing: list, unexpected: list, mismatched: list) -> None:
    parts = []
    for what, names in (
        ("missing", missing),
        ("not taken by the model", unexpected),
        ("of the wrong shape", mismatched),
    ):
        if names:
            more = f" and {len(names) - 3} more" if len(names) > 3 else ""
            parts.append(f"{len(names)} tensor(s) {what} ({', '.join(names[:3])}{more})")
    if parts:
        raise ModelDirError(
            f"{model_dir}: the checkpoint does not fill the model: {'; '.join(parts)}. "
            "A target with weights left random gives wrong states; refusing it"
        )


def check_layers_present(model_dir: str | Path) -> None:
    """Refuse, from the shards' headers alone, a checkpoint in which a decoder layer, the
    embeddings or the final norm has no tensor under any name eyas loads (a wrapper saved
    under names the loader does not map): cheap, before anything is written, for every
    backend. The loaders check tensor by tensor once they load."""
    import re

    from eyas.targets.weights import weight_map

    f = target_facts(model_dir)
    names = list(weight_map(model_dir))
    for pat, rep in TEXT_KEY_MAPPING.items():
        names = [re.sub(pat, rep, n) for n in names]
    have = {m.group(1) for n in names if (m := re.match(r"model\.layers\.(\d+)\.", n))}
    missing = [f"model.layers.{i}" for i in range(f.num_hidden_layers) if str(i) not in have]
    for part in ("model.embed_tokens.", "model.norm."):
        if not any(n.startswith(part) for n in names):
            missing.append(part.rstrip("."))
    if missing:
        _refuse_incomplete(model_dir, missing, [], [])


def text_config(model_dir: str | Path, trust_remote_code: bool = False):
    """The transformers config of the target's language model (a wrapper's text part)."""
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(
        model_dir, local_files_only=True, trust_remote_code=trust_remote_code
    )
    return cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg


def default_aux_layers(n_layers: int) -> tuple[int, int, int]:
    """[1, n//2-1, n-4] as outputs of 0-based decoder layers (the EAGLE-3 default)."""
    from eyas.targets.layers import default_eagle3

    return default_eagle3(n_layers)


def model_fingerprint(model_dir: str | Path) -> str:
    """Hash of the config and the weight layout (names, shapes, dtypes, sizes), not the weights."""
    from eyas.targets.weights import weight_layout

    d = Path(model_dir)
    cfg = read_json(d / "config.json")
    for k in ("transformers_version", "_name_or_path", "torch_dtype", "dtype"):
        cfg.pop(k, None)
    h = hashlib.sha256(json.dumps(cfg, sort_keys=True).encode())
    h.update(json.dumps(weight_layout(d), sort_keys=True).encode())
    return h.hexdigest()[:16]


def require_target(model_dir: str | Path, meta: dict, made: str, then: str) -> None:
    """The one check that `model_dir` holds the target a run (`meta`, of `made`) was
    extracted with: its weights there and its fingerprint the run's; else a usage error
    saying both fingerprints and `then`, what to do."""
    check_model_dir(model_dir, weights=True)
    if (fp := model_fingerprint(model_dir)) != meta["model_fingerprint"]:
        raise UsageError(
            f"model changed: {model_dir} has fingerprint {fp}, {made} was made with "
            f"{meta['model_fingerprint']}; {then}"
        )


def resolve_device(device: str) -> str:
    return ("cuda" if torch.cuda.is_available() else "cpu") if device == "auto" else device


def resolve_dtype(dtype: str, device: str) -> torch.dtype:
    """`auto` is bfloat16 on a GPU and float32 on a CPU (which has no fast bfloat16)."""
    if dtype != "auto":
        return DTYPES[dtype]
    return torch.float32 if resolve_device(device) == "cpu" else torch.bfloat16


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The Llama/Qwen/DeepSeek RMSNorm exactly as transformers computes it: in float32,
    cast back to the input dtype before the weight multiplies."""
    dtype = x.dtype
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(dtype)


# Families whose final norm is `rms_norm` above (weight times normalised input).
PLAIN_RMSNORM = {
    "llama",
    "mistral",
    "qwen2",
    "qwen3",
    "qwen2_moe",
    "qwen3_moe",
    "deepseek_v3",
    "deepseek_v2",
    "kimi_k2",
    "glm4_moe",
    "mixtral",
}


def plan_batches(lengths, indices: list[int], batch_tokens: int) -> list[list[int]]:
    """Pack samples of similar length so that batch_size x longest <= batch_tokens.

    Deterministic in its inputs; a sample longer than the budget gets a batch of its own.
    """
    order = sorted(indices, key=lambda i: (lengths[i], i))
    batches, cur, longest = [], [], 0
    for i in order:
        n = lengths[i]
        if cur and max(longest, n) * (len(cur) + 1) > batch_tokens:
            batches.append(cur)
            cur, longest = [], 0
        cur.append(i)
        longest = max(longest, n)
    if cur:
        batches.append(cur)
    return batches


def load_tokenizer(model: str, trust_remote_code: bool = False, chat_template: str | None = None):
    """The model's tokenizer: a fast one, or one that is Python code (then with the flag).
    `chat_template`, where given, is the text of a Jinja template used instead of the
    tokenizer's own (it is then part of the tokenizer's fingerprint)."""
    tok = _load_tokenizer(model, trust_remote_code)
    if chat_template is not None:
        tok.chat_template = chat_template
    return tok


class NoChatTemplate(ModelDirError):
    """Conversations given for a target whose tokenizer has no chat template (exit 2)."""


def read_chat_template(path: str | Path | None) -> str | None:
    """The text of a `--chat-template` file (None for None); a usage error if unreadable."""
    if path is None:
        return None
    p = Path(path)
    if not p.is_file():
        raise ModelDirError(f"--chat-template {p}: no such file (give a Jinja chat template)")
    try:
        text = p.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ModelDirError(f"--chat-template {p}: cannot be read ({exc})") from None
    if not text.strip():
        raise ModelDirError(f"--chat-template {p} is empty")
    return text


def require_chat_template(tokenizer, model: str, conversations: int, of: int, what: str) -> None:
    """Refuse, once and before any work, `conversations` (of `of` records of `what`) for a
    target whose tokenizer has no chat template, naming the two ways out."""
    if conversations and not tokenizer.chat_template:
        raise NoChatTemplate(
            f"{model} has no chat template (a base checkpoint?), and {conversations} of {of} "
            f"records of {what} are conversations, which need one to be rendered: give them as "
            'plain text ({"text": ...} records), or give a Jinja template with --chat-template FILE'
        )


def _load_tokenizer(model: str, trust_remote_code: bool):
    from transformers import AutoTokenizer

    check_model_dir(model, tokenizer=True)
    try:
        return AutoTokenizer.from_pretrained(
            model, local_files_only=True, trust_remote_code=trust_remote_code
        )
    except (ValueError, OSError) as exc:
        code = _tokenizer_code(model)
        if not trust_remote_code and (code or "trust_remote_code" in str(exc)):
            raise ModelDirError(
                f"{model}: its tokenizer is Python code shipped with the model"
                f"{f' ({code})' if code else ''}; let it run with --trust-remote-code"
            ) from None
        raise
    except Exception as exc:  # the shipped code does not load (an import this transformers lacks)
        code = _tokenizer_code(model)
        if not (trust_remote_code and code):
            raise
        import transformers

        raise UsageError(
            f"{model}: its tokenizer code ({code}) does not load with transformers "
            f"{transformers.__version__}: {type(exc).__name__}: {exc}"
        ) from None


def _tokenizer_code(model: str) -> str | None:
    """The tokenizer class a model directory ships as code (tokenizer_config.json's auto_map)."""
    try:
        auto = json.loads((Path(model) / "tokenizer_config.json").read_text()).get("auto_map", {})
    except (OSError, ValueError, AttributeError):
        return None
    ref = auto.get("AutoTokenizer") if isinstance(auto, dict) else None
    if isinstance(ref, list):
        ref = next((r for r in ref if r), None)
    return ref if isinstance(ref, str) else None
