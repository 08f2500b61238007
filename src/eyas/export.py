"""Stage 5, `export`: write a trained drafter in the formats serving engines load.

- `vllm`: the speculators format (`Eagle3Speculator`), decoder layer as `layers.0.*`.
- `sglang`: the EAGLE format (`LlamaForCausalLMEagle3`), decoder layer as `midlayer.*`.

Both carry `fc`, the layer, `norm`, `lm_head` [D, H], `d2t` (int64) and `t2d` (bool), and the
target's token embeddings copied exactly (never random ones). A draft vocabulary that is the
whole vocabulary (D = V) maps every id to itself: then `d2t` and `t2d` are left out, because
vLLM has no place for them and refuses to load a drafter that carries them.

Where the states are normalised (`norm_before_fc`, `norm_before_residual`, `norm_output`)
is written explicitly in the vLLM format, since loaders disagree on the defaults. SGLang's
EAGLE-3 model has none of the three (its residual is the raw fused state, its next step
reads the raw state, nothing norms the target states), so a drafter trained with any of
them is refused for `sglang` rather than written in a form SGLang would run differently.
`load_export` reads either format back in the architecture it declares, and refuses a field
that would change the architecture which it does not know.

Aux layer ids follow each engine's reading of `eagle_aux_hidden_state_layer_ids`:
- vLLM reads them as HF `hidden_states` indices (id k = input of decoder layer k), so the
  vLLM export carries [2, n//2, n-3] for the default layers;
- SGLang adds 1 to each id before capturing (id i = output of 0-based decoder layer i), so
  the SGLang export carries [1, n//2-1, n-4] for the same layers.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file

from . import __version__
from .run.fsutil import (
    DiskFullError,
    atomic_write_json,
    fsync_dir,
    is_disk_full,
    read_json,
)
from .run.manifest import ManifestError, check_manifest, write_manifest
from .training.checkpoint import save_safetensors
from .training.drafter import Drafter, DrafterConfig

FORMATS = ("vllm", "sglang")
MANIFEST = "eyas-manifest.json"  # the export's files and checksums, written last
_ARCHS = {"vllm": "Eagle3Speculator", "sglang": "LlamaForCausalLMEagle3"}
_LAYER_PREFIX = {"vllm": "layers.0.", "sglang": "midlayer."}
_SGLANG_LACKS = ("norm_before_fc", "norm_before_residual", "norm_output")
# Fields of an export's config that change the network; a loader that ignored one would run
# another drafter than the one trained. Their values that eyas's drafter can run:
_ARCH_FIELDS = {"fc_norm": (False, None), "norm_before_fc": (False, True, None),
                "norm_before_residual": (False, True, None), "norm_output": (False, True, None)}  # fmt: skip
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class ExportError(ValueError):
    pass


class ExportUsage(ExportError):
    """A flag that cannot work as given (exit 2); other ExportErrors are problems found (exit 1)."""


def trained_weights(train_dir: Path) -> tuple[dict, dict, dict]:
    """(state dict, drafter config dict, train.json) of a finished training directory, its
    final drafter checked against its manifest."""
    from .training.checkpoint import FINAL_MANIFEST, load_final

    train_dir = Path(train_dir)
    if not (train_dir / "train.json").is_file():
        raise ExportError(f"{train_dir}: not a training directory (no train.json)")
    info = read_json(train_dir / "train.json")
    final, cfg_path = train_dir / "drafter.safetensors", train_dir / "drafter_config.json"
    again = f"eyas train --resume --out {train_dir}"
    if (train_dir / FINAL_MANIFEST).is_file():
        try:
            state, cdict = load_final(train_dir)
        except ManifestError as exc:
            raise ExportError(
                f"{exc}; `{again}` writes it again from the last checkpoint"
            ) from None
        return state, cdict, info
    if not (final.is_file() and cfg_path.is_file()):
        raise ExportError(
            f"{train_dir}: no final drafter (training did not finish); finish it: {again}"
        )
    return (
        load_file(str(final)),
        read_json(cfg_path),
        info,
    )  # from before final drafters had manifests


def _llama_fields(c: DrafterConfig) -> dict:
    return {
        "model_type": "llama",
        "hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size,
        "num_hidden_layers": 1,
        "num_attention_heads": c.num_attention_heads,
        "num_key_value_heads": c.num_key_value_heads,
        "head_dim": c.head_dim,
        "hidden_act": c.hidden_act,
        "rms_norm_eps": c.rms_norm_eps,
        "rope_theta": c.rope_theta,
        "rope_scaling": None,
        "max_position_embeddings": c.max_position_embeddings,
        "vocab_size": c.vocab_size,
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": False,
    }


def export_config(
    fmt: str, c: DrafterConfig, aux_layers: list[int], target: dict, dtype: str, k: int
) -> dict:
    """The config.json of an export; `aux_layers` are outputs of 0-based decoder layers."""
    aux_hf = [i + 1 for i in aux_layers]
    if fmt == "vllm":
        return {
            "architectures": ["Eagle3Speculator"],
            "speculators_model_type": "eagle3",
            "speculators_version": "0.1.0",
            "draft_vocab_size": c.draft_vocab_size,
            "norm_before_residual": c.norm_before_residual,
            "norm_before_fc": c.norm_before_fc,
            "norm_output": c.norm_output,
            "fc_norm": False,
            "target_hidden_size": c.hidden_size,
            "eagle_aux_hidden_state_layer_ids": aux_hf,
            "transformer_layer_config": _llama_fields(c),
            "speculators_config": {
                "algorithm": "eagle3",
                "default_proposal_method": "greedy",
                "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": k}],
                "verifier": {
                    "name_or_path": target["path"],
                    "architectures": target["architectures"],
                },
            },
            "torch_dtype": dtype,
            "eyas_version": __version__,
        }
    return {
        "architectures": ["LlamaForCausalLMEagle3"],
        **_llama_fields(c),
        "draft_vocab_size": c.draft_vocab_size,
        "target_hidden_size": c.hidden_size,
        "norm_before_residual": False,  # what SGLang's model does; a drafter otherwise is refused
        "eagle_config": {
            "eagle_aux_hidden_state_layer_ids": list(aux_layers),
            "use_aux_hidden_state": True,
        },
        "torch_dtype": dtype,
        "eyas_version": __version__,
    }


def export(
    train_dir: str | Path,
    fmt: str,
    out: str | Path,
    *,
    dtype: str = "float32",
    speculative_tokens: int = 3,
    verifier: str | None = None,
    force: bool = False,
) -> Path:
    """Write `train_dir`'s drafter to `out`; `verifier` is the target's name or path as the
    serving machine knows it (default: the local path it was trained against).

    The export is written whole into a temp directory beside `out` and swapped into place,
    so `out` is always a complete export (the old one or the new one). A directory that
    holds anything but an earlier export is refused unless `force` (then it is replaced)."""
    if fmt not in FORMATS:
        raise ExportUsage(f"--format must be one of {', '.join(FORMATS)}, got {fmt!r}")
    if dtype not in _DTYPES:
        raise ExportUsage(f"--dtype must be one of {', '.join(_DTYPES)}, got {dtype!r}")
    state, cdict, info = trained_weights(Path(train_dir))
    c = DrafterConfig(**cdict)
    if fmt == "sglang" and (on := [k for k in _SGLANG_LACKS if getattr(c, k)]):
        raise ExportError(
            f"{train_dir}: the drafter was trained with {', '.join(on)}, which SGLang's EAGLE-3 "
            "model does not have: it would run another network than the one trained. Export "
            "--format vllm, or train with --no-" + " --no-".join(k.replace("_", "-") for k in on)
        )
    target_cfg = (
        read_json(Path(info["model_path"]) / "config.json")
        if (Path(info["model_path"]) / "config.json").is_file()
        else {}
    )
    target = {
        "path": verifier or info["model_path"],
        "architectures": target_cfg.get("architectures", []),
    }
    prefix = _LAYER_PREFIX[fmt]
    tensors = {}
    if c.draft_vocab_size == c.vocab_size:
        if state["d2t"].any():
            raise ExportError(
                f"{train_dir}: the draft vocabulary is the whole vocabulary but d2t is not zero"
            )
        state = {k: v for k, v in state.items() if k not in ("d2t", "t2d")}
    for name, t in state.items():
        if name.startswith("midlayer."):
            name = prefix + name.removeprefix("midlayer.")
        if t.is_floating_point():
            t = t.to(_DTYPES[dtype])
        elif name == "t2d":
            t = t.bool()
        elif name == "d2t":
            t = t.long()
        tensors[name] = t.contiguous()
    out = Path(out).absolute()
    _check_destination(out, force)
    _remove_stale_temp(out)
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        tmp.mkdir(parents=True)
        save_safetensors(tensors, tmp / "model.safetensors", metadata={"format": "pt"})
        atomic_write_json(
            tmp / "config.json",
            export_config(fmt, c, info["aux_layers"], target, dtype, speculative_tokens),
        )
        write_manifest(tmp, ["model.safetensors", "config.json"], MANIFEST, format=fmt,
                       rendering=info.get("rendering") or {})  # fmt: skip
        _swap_into_place(tmp, out)
    except BaseException as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        if is_disk_full(exc):
            raise DiskFullError(exc.errno, f"no space left writing the export to {out}") from exc
        raise
    return out


def is_export(path: Path) -> bool:
    """An earlier export (eyas's, or any EAGLE-3 drafter directory of the two formats)."""
    if (path / MANIFEST).is_file():
        return True
    try:
        arch = (read_json(path / "config.json").get("architectures") or [None])[0]
    except (OSError, ValueError, AttributeError):
        return False
    return arch in _ARCHS.values()


def _check_destination(out: Path, force: bool) -> None:
    if out.exists() and not out.is_dir():
        raise ExportUsage(f"--out {out} is a file, not a directory")
    if out.is_dir() and any(out.iterdir()) and not is_export(out) and not force:
        raise ExportUsage(f"--out {out} holds files that are not an earlier export; choose another "
                          "--out, or pass --force to replace the directory and everything in it")  # fmt: skip


def _remove_stale_temp(out: Path) -> None:
    """Temp directories of exports to `out` whose process is gone (killed mid-export)."""
    for p in out.parent.glob(f".{out.name}.tmp-*"):
        pid = p.name.rsplit("-", 1)[-1]
        if pid.isdigit() and not Path(f"/proc/{pid}").exists():
            shutil.rmtree(p, ignore_errors=True)


def _swap_into_place(tmp: Path, out: Path) -> None:
    """Make `tmp` be `out` in one step: a rename, or an exchange (renameat2) with the old
    export, which is then removed. Where the exchange is not supported, two renames."""
    if not out.exists():
        os.rename(tmp, out)
    elif _exchange(tmp, out):
        shutil.rmtree(tmp, ignore_errors=True)  # tmp now holds the old export
    else:
        old = out.with_name(f".{out.name}.old-{os.getpid()}")
        os.rename(out, old)
        os.rename(tmp, out)
        shutil.rmtree(old, ignore_errors=True)
    fsync_dir(out.parent)


def _exchange(a: Path, b: Path) -> bool:
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    if not hasattr(libc, "renameat2"):
        return False
    at_fdcwd, rename_exchange = -100, 2
    return (
        libc.renameat2(at_fdcwd, str(a).encode(), at_fdcwd, str(b).encode(), rename_exchange) == 0
    )


def export_rendering(path: str | Path) -> dict:
    """How the data an eyas export was trained on was rendered (`tokenizer_fingerprint`,
    `chat_template_kwargs`); {} for an export that does not say (another tool's, or older)."""
    m = Path(path) / MANIFEST
    try:
        return dict(read_json(m).get("rendering") or {}) if m.is_file() else {}
    except (OSError, ValueError, AttributeError):
        return {}


def load_export(path: str | Path) -> tuple[Drafter, list[int]]:
    """A Drafter from an export directory of either format, and its aux layer ids (HF convention)."""
    path = Path(path)
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise ExportError(f"{path}: no config.json (not an exported drafter)")
    if (path / MANIFEST).is_file():  # eyas's own export: every file as it was written
        try:
            m = check_manifest(path, MANIFEST)
        except ManifestError as exc:
            raise ExportError(f"{exc}; export the drafter again") from None
    else:
        m = {}
    cfg = json.loads(cfg_file.read_text())
    arch = (cfg.get("architectures") or ["?"])[0]
    if m and _ARCHS.get(m.get("format")) != arch:
        raise ExportError(
            f"{path}: {MANIFEST} says {m.get('format')!r} but config.json is {arch!r}"
        )
    if arch == "Eagle3Speculator":
        layer, aux = cfg["transformer_layer_config"], cfg["eagle_aux_hidden_state_layer_ids"]
        prefix = "layers.0."
        # vLLM's defaults for fields a speculators config leaves out
        norms = {"norm_before_residual": cfg.get("norm_before_residual", True),
                 "norm_before_fc": cfg.get("norm_before_fc", False),
                 "norm_output": cfg.get("norm_output", False)}  # fmt: skip
        for key, allowed in _ARCH_FIELDS.items():
            if cfg.get(key) not in allowed:
                raise ExportError(f"{cfg_file}: {key} = {cfg.get(key)!r} is an architecture eyas's "
                                  "drafter does not have; it cannot evaluate this export")  # fmt: skip
    elif arch == "LlamaForCausalLMEagle3":  # SGLang's ids: outputs of 0-based layers
        layer, prefix = cfg, "midlayer."
        aux = [i + 1 for i in cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"]]
        norms = {"norm_before_residual": False}  # what SGLang's model does whatever is written
    else:
        raise ExportError(f"{cfg_file}: unknown architecture {arch!r}")
    if layer.get("num_hidden_layers", 1) != 1:
        raise ExportError(f"{cfg_file}: {layer['num_hidden_layers']} decoder layers; eyas's EAGLE-3 "
                          "drafter has one, so it cannot evaluate this export")  # fmt: skip
    c = DrafterConfig(
        hidden_size=layer["hidden_size"], intermediate_size=layer["intermediate_size"],
        num_attention_heads=layer["num_attention_heads"], num_key_value_heads=layer["num_key_value_heads"],
        head_dim=layer["head_dim"], vocab_size=layer["vocab_size"], draft_vocab_size=cfg["draft_vocab_size"],
        rms_norm_eps=layer["rms_norm_eps"], rope_theta=layer["rope_theta"],
        max_position_embeddings=layer["max_position_embeddings"], hidden_act=layer["hidden_act"],
        **norms,
    )  # fmt: skip
    drafter = Drafter(c)
    raw = load_file(str(path / "model.safetensors"))
    state = {
        ("midlayer." + k.removeprefix(prefix) if k.startswith(prefix) else k): v
        for k, v in raw.items()
    }
    state = {k: v.float() if v.is_floating_point() else v for k, v in state.items()}
    if c.draft_vocab_size == c.vocab_size and "d2t" not in state:  # the identity, left out
        state["d2t"] = torch.zeros(c.vocab_size, dtype=torch.long)
        state["t2d"] = torch.ones(c.vocab_size, dtype=torch.bool)
    missing, unexpected = drafter.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise ExportError(f"{path}/model.safetensors: missing {missing}, unexpected {unexpected}")
    return drafter.eval(), list(aux)
