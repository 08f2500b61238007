"""Tiny targets: small random-initialised causal LMs of real transformers architectures.

`build_tiny_target` writes a directory that `AutoModelForCausalLM` and `AutoTokenizer`
load with the hub offline: config, weights (safetensors), a tokenizer and a chat template.
With no tokenizer to copy, a byte-level BPE is trained locally on offline text and given a
Llama-3-style (or ChatML, for qwen) chat template. With `like=`, the architecture family,
tokenizer and chat template of a real model directory (config and tokenizer files only)
are kept and the sizes scaled down, to rehearse the pipeline before spending GPU hours.
"""

from __future__ import annotations

import sysconfig
from dataclasses import dataclass
from pathlib import Path

import torch

from eyas.errors import UsageError

ARCHES = ("llama", "qwen3", "qwen2", "deepseek_v3", "kimi_k25")

SPECIAL_TOKENS = [
    "<|begin_of_text|>",
    "<|end_of_text|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eot_id|>",
    "<|im_start|>",
    "<|im_end|>",
]

# Llama-3 style: header per message, assistant content ends with <|eot_id|>.
LLAMA3_TEMPLATE = (
    "{{- bos_token }}"
    "{%- for message in messages %}"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] | trim + '<|eot_id|>' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}"
)

# ChatML (Qwen style): <|im_start|>role\ncontent<|im_end|>\n
CHATML_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

# Qwen3's chat format, as a tool-calling run is rehearsed with: ChatML turns; tools declared in
# the system turn as JSON lines inside <tools></tools>; each call as a JSON object inside
# <tool_call></tool_call>; tool results as a user turn of <tool_response> blocks; the reasoning
# of assistant turns after the last user message as <think>\n...\n</think>\n\n (earlier turns'
# reasoning is dropped); `enable_thinking=False` opens the generation prompt with an empty think.
QWEN3_SPECIAL_TOKENS = [
    "<think>",
    "</think>",
    "<tool_call>",
    "</tool_call>",
    "<tool_response>",
    "</tool_response>",
]
QWEN3_TEMPLATE = (
    "{%- set sys = messages[0]['content'] if messages and messages[0]['role'] == 'system' else none -%}"
    "{%- if tools -%}"
    "{{- '<|im_start|>system\\n' + (sys + '\\n\\n' if sys else '') + '# Tools\\n\\nYou may call functions. '"
    " + 'Their signatures, one JSON object a line:\\n<tools>' -}}"
    "{%- for t in tools -%}{{- '\\n' + (t | tojson) -}}{%- endfor -%}"
    '{{- \'\\n</tools>\\n\\nAnswer a call as a JSON object with "name" and "arguments" inside \''
    " + '<tool_call></tool_call>.<|im_end|>\\n' -}}"
    "{%- elif sys -%}{{- '<|im_start|>system\\n' + sys + '<|im_end|>\\n' -}}{%- endif -%}"
    "{%- set ns = namespace(last_user=-1) -%}"
    "{%- for m in messages -%}{%- if m['role'] == 'user' -%}{%- set ns.last_user = loop.index0 -%}{%- endif -%}{%- endfor -%}"
    "{%- for m in messages -%}"
    "{%- if m['role'] == 'system' and loop.first -%}"
    "{%- elif m['role'] in ('user', 'system') -%}{{- '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' -}}"
    "{%- elif m['role'] == 'assistant' -%}{{- '<|im_start|>assistant\\n' -}}"
    "{%- if loop.index0 > ns.last_user and m.get('reasoning_content') -%}"
    "{{- '<think>\\n' + (m['reasoning_content'] | trim) + '\\n</think>\\n\\n' -}}{%- endif -%}"
    "{{- m['content'] or '' -}}"
    "{%- for tc in m.get('tool_calls') or [] -%}"
    "{%- if not loop.first or m['content'] -%}{{- '\\n' -}}{%- endif -%}"
    "{%- set args = tc['function']['arguments'] -%}"
    "{{- '<tool_call>\\n{\"name\": \"' + tc['function']['name'] + '\", \"arguments\": '"
    " + (args if args is string else args | tojson) + '}\\n</tool_call>' -}}"
    "{%- endfor -%}{{- '<|im_end|>\\n' -}}"
    "{%- elif m['role'] == 'tool' -%}"
    "{%- if loop.first or messages[loop.index0 - 1]['role'] != 'tool' -%}{{- '<|im_start|>user' -}}{%- endif -%}"
    "{{- '\\n<tool_response>\\n' + m['content'] + '\\n</tool_response>' -}}"
    "{%- if loop.last or messages[loop.index0 + 1]['role'] != 'tool' -%}{{- '<|im_end|>\\n' -}}{%- endif -%}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}"
    "{%- if enable_thinking is defined and not enable_thinking -%}{{- '<think>\\n\\n</think>\\n\\n' -}}{%- endif -%}"
    "{%- endif -%}"
)


# Kimi-K2.5's chat format (a tiktoken tokenizer's special tokens, here in a small BPE): turns
# as <|im_ROLE|>ROLE<|im_middle|>...<|im_end|>; a default system prompt; an assistant turn is
# <think>reasoning</think>content, then its tool calls; turns before the last user turn keep
# an empty <think></think>; tools are declared per conversation; `thinking=False` opens the
# generation prompt with an empty <think></think>.
KIMI_SPECIAL_TOKENS = [
    "[BOS]",
    "[EOS]",
    "[PAD]",
    "<|im_end|>",
    "<|im_user|>",
    "<|im_assistant|>",
    "<|im_system|>",
    "<|im_middle|>",
    "<think>",
    "</think>",
    "<|tool_calls_section_begin|>",
    "<|tool_calls_section_end|>",
    "<|tool_call_begin|>",
    "<|tool_call_argument_begin|>",
    "<|tool_call_end|>",
    "<|media_start|>",
    "<|media_content|>",
    "<|media_end|>",
    "<|media_pad|>",
]
KIMI_TEMPLATE = (
    "{%- set ns = namespace(last_user=-1) -%}"
    "{%- for m in messages -%}{%- if m['role'] == 'user' -%}{%- set ns.last_user = loop.index0 -%}{%- endif -%}{%- endfor -%}"
    "{%- if tools -%}<|im_system|>tool_declare<|im_middle|>{{ tools | tojson }}<|im_end|>{%- endif -%}"
    "{%- if not messages or messages[0]['role'] != 'system' -%}"
    "<|im_system|>system<|im_middle|>You are Kimi, an AI assistant created by Moonshot AI.<|im_end|>"
    "{%- endif -%}"
    "{%- for m in messages -%}"
    "{%- if m['role'] == 'assistant' -%}"
    "<|im_assistant|>assistant<|im_middle|>"
    "{%- if loop.index0 > ns.last_user -%}<think>{{ m.get('reasoning_content') or '' }}</think>"
    "{%- else -%}<think></think>{%- endif -%}"
    "{{ m['content'] or '' }}"
    "{%- if m.get('tool_calls') -%}<|tool_calls_section_begin|>"
    "{%- for tc in m['tool_calls'] -%}<|tool_call_begin|>{{ tc['id'] }}<|tool_call_argument_begin|>"
    "{%- if tc['function']['arguments'] is string -%}{{ tc['function']['arguments'] }}"
    "{%- else -%}{{ tc['function']['arguments'] | tojson }}{%- endif -%}<|tool_call_end|>"
    "{%- endfor -%}<|tool_calls_section_end|>{%- endif -%}"
    "<|im_end|>"
    "{%- elif m['role'] == 'tool' -%}"
    "<|im_system|>tool<|im_middle|>## Return of {{ m.get('tool_call_id', '') }}\n{{ m['content'] }}<|im_end|>"
    "{%- else -%}"
    "<|im_{{ 'user' if m['role'] == 'user' else 'system' }}|>{{ m['role'] }}<|im_middle|>{{ m['content'] }}<|im_end|>"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|im_assistant|>assistant<|im_middle|>"
    "{%- if thinking is defined and not thinking -%}<think></think>{%- endif -%}{%- endif -%}"
)

# The hub's weight names of a wrapped target, where transformers' own save differs.
_HUB_NAMES = {
    "kimi_k25": [
        ("language_model.model.blocks.", "language_model.model.layers."),
        ("model.mm_projector.", "mm_projector."),
        ("vision_tower.encoder.patch_embed.", "vision_tower.patch_embed."),
    ]
}
# What vLLM's Kimi-K2.5 reads beside the weights: its media processor's settings.
_PREPROCESSOR = {
    "kimi_k25": {
        "media_proc_cfg": {
            "patch_size": 14,
            "merge_kernel_size": 2,
            "temporal_merge_kernel_size": 2,
            "image_mean": [0.5, 0.5, 0.5],
            "image_std": [0.5, 0.5, 0.5],
            "in_patch_limit": 256,
            "in_patch_limit_each_frame": 256,
            "in_patch_limit_video": 256,
            "patch_limit_on_one_side": 64,
            "fixed_output_tokens": None,
        }
    }
}
_HUB_ARCHITECTURES = {"kimi_k25": ["KimiK25ForConditionalGeneration"]}


@dataclass(frozen=True, kw_only=True)
class TinySizes:
    """Sizes of a tiny target; the defaults give distinct default aux layers [1, 3, 4]."""

    num_hidden_layers: int = 8
    """Decoder layers; at least 8 so that [1, n//2-1, n-4] are three distinct layers."""
    hidden_size: int = 64
    """Width H of the residual stream."""
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    intermediate_size: int = 128

    def __post_init__(self) -> None:
        if self.num_hidden_layers < 1 or self.hidden_size < 8:
            raise UsageError(
                f"tiny target too small: layers={self.num_hidden_layers} hidden={self.hidden_size}"
            )
        if self.hidden_size % self.num_attention_heads:
            raise UsageError(
                f"hidden size {self.hidden_size} is not divisible by {self.num_attention_heads} attention heads"
            )


def offline_corpus(extra: list[str] | None = None, max_chars: int = 400_000) -> list[str]:
    """Text that exists on every machine: Python standard library sources plus `extra`."""
    from eyas.demo_target.data import corpus_text, generate_conversations

    texts = list(extra or []) + corpus_text(generate_conversations(400, seed=1))
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    total = sum(map(len, texts))
    for name in (
        "this.py",
        "textwrap.py",
        "argparse.py",
        "json/__init__.py",
        "random.py",
        "string.py",
    ):
        p = stdlib / name
        if p.exists() and total < max_chars:
            t = p.read_text(encoding="utf-8", errors="replace")
            texts.append(t)
            total += len(t)
    return texts


def train_tokenizer(texts: list[str], vocab_size: int = 2048, template: str = LLAMA3_TEMPLATE):
    """A byte-level BPE trained on `texts`, wrapped as a transformers fast tokenizer; with
    Kimi's template, Kimi's special tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    kimi, qwen3 = template == KIMI_TEMPLATE, template == QWEN3_TEMPLATE
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=KIMI_SPECIAL_TOKENS
        if kimi
        else SPECIAL_TOKENS + (QWEN3_SPECIAL_TOKENS if qwen3 else []),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    chatml = template in (CHATML_TEMPLATE, QWEN3_TEMPLATE)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="[BOS]" if kimi else "<|begin_of_text|>",
        eos_token="<|im_end|>" if chatml or kimi else "<|eot_id|>",
        pad_token="[PAD]" if kimi else "<|end_of_text|>",
    )
    fast.chat_template = template
    return fast


def _arch_config(arch: str, vocab_size: int, sizes: TinySizes, tokenizer):
    from transformers import AutoConfig

    common = dict(
        vocab_size=vocab_size,
        hidden_size=sizes.hidden_size,
        intermediate_size=sizes.intermediate_size,
        num_hidden_layers=sizes.num_hidden_layers,
        num_attention_heads=sizes.num_attention_heads,
        num_key_value_heads=sizes.num_key_value_heads,
        max_position_embeddings=4096,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
    )
    if arch == "llama":
        return AutoConfig.for_model("llama", **common)
    if arch in ("qwen3", "qwen2"):
        return AutoConfig.for_model(
            arch, head_dim=sizes.hidden_size // sizes.num_attention_heads, **common
        )
    if arch == "deepseek_v3":
        h = sizes.hidden_size
        common.pop("num_key_value_heads")
        return AutoConfig.for_model(
            "deepseek_v3",
            num_key_value_heads=sizes.num_attention_heads,
            moe_intermediate_size=max(8, sizes.intermediate_size // 4),
            n_routed_experts=4,
            num_experts_per_tok=2,
            n_shared_experts=1,
            n_group=1,
            topk_group=1,
            topk_method="noaux_tc",  # as DeepSeek-V3 / Kimi-K2 configs say; vLLM reads it
            scoring_func="sigmoid",
            first_k_dense_replace=1,
            # DeepSeek-V3's and Kimi-K2's MLA widths: a latent of 512 plus 64 rope dims (576,
            # the one MLA head size vLLM's CPU kernels take); the per-head parts stay tiny.
            kv_lora_rank=512,
            qk_rope_head_dim=64,
            q_lora_rank=max(8, h // 2),
            qk_nope_head_dim=8,
            v_head_dim=h // sizes.num_attention_heads,
            # YaRN as in Kimi-K2's config (factor 32, betas 1, mscales 1, theta 50000), over
            # this model's shorter context.
            rope_parameters={
                "rope_type": "yarn",
                "rope_theta": 50000.0,
                "factor": 32.0,
                "original_max_position_embeddings": common["max_position_embeddings"] // 32,
                "beta_fast": 1.0,
                "beta_slow": 1.0,
                "mscale": 1.0,
                "mscale_all_dim": 1.0,
            },
            **common,
        )
    if arch == "kimi_k25":
        text = _arch_config("deepseek_v3", vocab_size, sizes, tokenizer)
        return _wrapper_config("kimi_k25", text, tokenizer)
    raise UsageError(f"unknown architecture {arch!r}; choose one of {', '.join(ARCHES)}")


def _wrapper_config(model_type: str, text, tokenizer, top: dict | None = None):
    """A wrapper config (Kimi-K2.5's): the language model `text`, a tiny vision tower."""
    from transformers import AutoConfig

    top = dict(top or {})
    for k in (
        "model_type",
        "text_config",
        "vision_config",
        "architectures",
        "auto_map",
        "quantization_config",
        "transformers_version",
        "dtype",
        "torch_dtype",
    ):
        top.pop(k, None)
    media = (
        tokenizer.convert_tokens_to_ids("<|media_pad|>")
        if hasattr(tokenizer, "convert_tokens_to_ids")
        else None
    )
    if isinstance(media, int) and media >= 0:
        top.update(image_token_id=media, video_token_id=media)
    vision = dict(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        pos_emb_height=8,
        pos_emb_width=8,
        pos_emb_time=2,
    )
    return AutoConfig.for_model(
        model_type,
        **{
            "tie_word_embeddings": False,
            **top,
            "text_config": text.to_dict(),
            "vision_config": vision,
            "projection_hidden_size": 32,
        },
    )


# Keys that set a model's size; scaled down by `_like_config`. Everything else is kept.
_SIZE_KEYS = {
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "moe_intermediate_size",
    "shared_expert_intermediate_size",
    "n_routed_experts",
    "num_experts",
    "num_local_experts",
    "num_experts_per_tok",
    "kv_lora_rank",
    "q_lora_rank",
    "qk_rope_head_dim",
    "qk_nope_head_dim",
    "v_head_dim",
    "n_group",
    "topk_group",
    "first_k_dense_replace",
    "max_window_layers",
    "layer_types",
    "mlp_only_layers",
    "decoder_sparse_step",
}


def _like_config(like: Path, sizes: TinySizes, vocab_size: int, tokenizer=None):
    from transformers import AutoConfig

    from eyas.run.fsutil import read_json

    raw = read_json(like / "config.json")
    if isinstance(raw.get("text_config"), dict) and "vision_config" in raw:  # a wrapper (Kimi-K2.5)
        text = _like_text(dict(raw["text_config"]), sizes, vocab_size)
        return _wrapper_config(raw["model_type"], text, tokenizer, raw)
    src = AutoConfig.from_pretrained(like, local_files_only=True)
    return _like_text(src.to_dict(), sizes, vocab_size)


def _like_text(src_dict: dict, sizes: TinySizes, vocab_size: int):
    """A causal LM config of `src_dict`'s family, its sizes scaled down, the rest kept."""
    from transformers import AutoConfig

    if src_dict.get("model_type") == "kimi_k2":  # Kimi-K2's text model is DeepSeek-V3's
        src_dict["model_type"] = "deepseek_v3"
    d = {k: v for k, v in src_dict.items() if k not in _SIZE_KEYS}
    d.pop("quantization_config", None)
    d.pop("auto_map", None)
    d.pop("architectures", None)
    d["vocab_size"] = max(vocab_size, int(src_dict.get("vocab_size") or 0))
    arch = d.pop("model_type")
    try:
        tiny = _arch_config(arch, d["vocab_size"], sizes, _TokIds(d))
    except ValueError:
        tiny = None
    if tiny is None:  # an architecture we have no preset for: scale the generic fields
        d.update(
            hidden_size=sizes.hidden_size,
            intermediate_size=sizes.intermediate_size,
            num_hidden_layers=sizes.num_hidden_layers,
            num_attention_heads=sizes.num_attention_heads,
            num_key_value_heads=sizes.num_key_value_heads,
            head_dim=sizes.hidden_size // sizes.num_attention_heads,
        )
        return AutoConfig.for_model(arch, **d)
    keep = {
        k: v
        for k, v in d.items()
        if k not in tiny.to_dict()
        or k
        in (
            "rope_parameters",
            "rope_theta",
            "rms_norm_eps",
            "tie_word_embeddings",
            "bos_token_id",
            "eos_token_id",
            "pad_token_id",
            "hidden_act",
            "routed_scaling_factor",
            "max_position_embeddings",
            "norm_topk_prob",
            "scoring_func",
            "topk_method",
        )
    }
    for k, v in keep.items():
        setattr(tiny, k, v)
    return tiny


class _TokIds:
    """Token ids taken from a source config, standing in for a tokenizer."""

    def __init__(self, d: dict):
        self.bos_token_id = d.get("bos_token_id")
        self.eos_token_id = d.get("eos_token_id")
        self.pad_token_id = d.get("pad_token_id")


def build_tiny_target(
    out: Path,
    arch: str = "llama",
    *,
    like: Path | None = None,
    sizes: TinySizes | None = None,
    seed: int = 0,
    tokenizer=None,
    trust_remote_code: bool = False,
    base: bool = False,
) -> Path:
    """Write a tiny random target to `out` and return it; float32 weights. `base`: a base
    checkpoint's twin, whose tokenizer has no chat template."""
    from transformers import AutoModelForCausalLM

    sizes = sizes or TinySizes()
    out = Path(out)
    if like is not None:
        like = Path(like)
        if not (like / "config.json").exists():
            raise FileNotFoundError(f"--like {like}: no config.json there")
        from eyas.targets.target import load_tokenizer

        tokenizer = load_tokenizer(str(like), trust_remote_code)
        if not tokenizer.chat_template and not base:
            raise UsageError(
                f"--like {like}: the tokenizer has no chat template (a base "
                "checkpoint: pass --base)"
            )
        config = _like_config(like, sizes, len(tokenizer), tokenizer)
        if _quantization_of(like):
            print(
                f"note: the twin leaves out {like}'s quantization config ({_quantization_of(like)}): "
                "its weights are float32",
                flush=True,
            )
    else:
        if arch not in ARCHES:
            raise UsageError(f"unknown architecture {arch!r}; choose one of {', '.join(ARCHES)}")
        if tokenizer is None:
            template = {
                "qwen3": QWEN3_TEMPLATE,
                "qwen2": CHATML_TEMPLATE,
                "kimi_k25": KIMI_TEMPLATE,
            }.get(arch, LLAMA3_TEMPLATE)
            tokenizer = train_tokenizer(offline_corpus(), template=template)
        config = _arch_config(arch, len(tokenizer), sizes, tokenizer)
    torch.manual_seed(seed)
    wrapped = hasattr(config, "text_config") and hasattr(config, "vision_config")
    if wrapped:
        from transformers import AutoModelForImageTextToText

        model = AutoModelForImageTextToText.from_config(config, dtype=torch.float32)
    else:
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.eval()
    if base:
        tokenizer.chat_template = None
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    if wrapped:
        _as_on_the_hub(out, config.model_type, like)
    return out


def _quantization_of(like: Path) -> str | None:
    from eyas.run.fsutil import read_json
    from eyas.targets.target import _quantization

    return _quantization(read_json(like / "config.json"))


def _compare_names(out: Path, like: Path) -> None:
    """Say which of the twin's weight names the real checkpoint's index does not have (layer
    numbers aside): quantized experts, say, are named otherwise in the real one."""
    import re

    from eyas.targets.weights import weight_map

    shape = lambda names: {re.sub(r"\.\d+\.", ".N.", n) for n in names}  # noqa: E731
    ours, real = shape(weight_map(out)), shape(weight_map(like))
    extra = sorted(ours - real)
    if extra:
        print(
            f"note: {len(extra)} of the twin's weight names are not in {like}'s index "
            f"(e.g. {', '.join(extra[:3])})",
            flush=True,
        )
    else:
        print(f"the twin's weight names are all in {like}'s index", flush=True)


def _as_on_the_hub(out: Path, model_type: str, like: Path | None) -> None:
    """Give a saved wrapper the real checkpoint's weight names and architectures (transformers'
    own save names some tensors otherwise), so every tool reads it as it reads the real one."""
    import json

    from safetensors.torch import load_file, save_file

    from eyas.run.fsutil import read_json

    renames = _HUB_NAMES.get(model_type, [])
    for shard in sorted(out.glob("*.safetensors")):
        tensors = load_file(str(shard))
        renamed = {}
        for k, v in tensors.items():
            for a, b in renames:
                k = k.replace(a, b)
            renamed[k] = v
        save_file(renamed, str(shard), metadata={"format": "pt"})
    index = out / "model.safetensors.index.json"
    if index.exists():
        idx = read_json(index)
        wm = {}
        for k, v in idx["weight_map"].items():
            for a, b in renames:
                k = k.replace(a, b)
            wm[k] = v
        idx["weight_map"] = wm
        index.write_text(json.dumps(idx, indent=2))
    pre = like / "preprocessor_config.json" if like is not None else None
    if pre is not None and pre.exists():
        (out / pre.name).write_bytes(pre.read_bytes())
    elif model_type in _PREPROCESSOR:
        (out / "preprocessor_config.json").write_text(
            json.dumps(_PREPROCESSOR[model_type], indent=2)
        )
    if like is not None and (like / "model.safetensors.index.json").is_file():
        _compare_names(out, like)
    cfg = read_json(out / "config.json")
    src = read_json(like / "config.json") if like is not None else {}
    cfg["architectures"] = src.get("architectures") or _HUB_ARCHITECTURES.get(
        model_type, cfg["architectures"]
    )
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
