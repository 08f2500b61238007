"""EAGLE-3, the chain drafter: one decoder layer over the target's three fused states,
unrolled over training-time-test steps (`model`, `attention`, `drafters.loss`), exported in
vLLM's speculators format and SGLang's EAGLE format, drafting one token per drafter pass."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from types import SimpleNamespace
from typing import NamedTuple

import torch

from eyas.drafters import decoder_fields
from eyas.drafters.blocks import layer_fields, load_weights
from eyas.drafters.eagle3.model import Drafter, DrafterConfig
from eyas.drafters.eagle3.serving import SERVING, SGLANG_LACKS, WINDOW
from eyas.drafters.formats import SGLANG, VLLM, Format, format_named
from eyas.drafters.loss import add_targets, counted, loss_masks, sample_ids, ttt_loss
from eyas.errors import ProblemError, UsageError
from eyas.targets.weights import embed_weight, final_norm_weight, layer_weights, lm_head_weight

_ARCHS = ("Eagle3Speculator", "LlamaForCausalLMEagle3")  # vLLM's, SGLang's
# Fields of a speculators config that change the network, and the values eyas's drafter runs.
_ARCH_FIELDS = {
    "fc_norm": (False, None),
    "norm_before_fc": (False, True, None),
    "norm_before_residual": (False, True, None),
    "norm_output": (False, True, None),
}


class _Files(NamedTuple):
    """An EAGLE-3 export's files in one format: the decoder layer's tensor prefix, and the
    config.json of (config, aux layers as 0-based layer outputs, target, dtype name, drafts)."""

    prefix: str
    config: Callable[[DrafterConfig, list[int], dict, str, int], dict]


def _llama_fields(c: DrafterConfig) -> dict:
    return {**decoder_fields(c, "llama", 1), "mlp_bias": False}


def _vllm_config(c: DrafterConfig, aux_layers: list[int], target: dict, dtype: str, k: int) -> dict:
    from eyas import __version__
    from eyas.targets.layers import hf_indices

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
        "eagle_aux_hidden_state_layer_ids": hf_indices(aux_layers),
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


def _sglang_config(
    c: DrafterConfig, aux_layers: list[int], target: dict, dtype: str, k: int
) -> dict:
    from eyas import __version__
    from eyas.targets.layers import sglang_ids

    return {
        "architectures": ["LlamaForCausalLMEagle3"],
        **_llama_fields(c),
        "draft_vocab_size": c.draft_vocab_size,
        "target_hidden_size": c.hidden_size,
        "norm_before_residual": False,  # what SGLang's model does; a drafter otherwise is refused
        "eagle_config": {
            "eagle_aux_hidden_state_layer_ids": sglang_ids(aux_layers),
            "use_aux_hidden_state": True,
        },
        **({WINDOW: c.attention_window} if c.attention_window else {}),
        "torch_dtype": dtype,
        "eyas_version": __version__,
    }


class Eagle3:
    name = "eagle3"
    position_name = "TTT step"  # what the metrics' positions are called
    # `eyas demo`'s recipe: 5 TTT steps, the target's head trained on (docs/recipe.md)
    demo_options = {"ttt_steps": 5, "head_init": "target"}
    serving = {
        VLLM: replace(SERVING[VLLM], writer=_Files("layers.0.", _vllm_config)),
        SGLANG: replace(SERVING[SGLANG], writer=_Files("midlayer.", _sglang_config)),
    }

    def unservable(self, cfg) -> str | None:
        trained = SimpleNamespace(
            attention_window=cfg.attention_window,
            **{n: getattr(cfg.options, n) for n in SGLANG_LACKS},
        )
        return self.serving[format_named(cfg.options.serve_with)].refuses(trained)

    def drafts_per_round(self, export_config: dict, tokens: int) -> int:
        return tokens  # a chain drafts as many as it is asked

    # ---------------------------------------------------------------- training

    def build(self, cfg, meta: dict, model_dir: str, draft_ids: torch.Tensor):
        """Drafter sized from the target, with its frozen embeddings; the target's lm_head
        too (None when the run stores the target's top-K: the loss needs no head then)."""
        from eyas.targets.target import resolve_device, text_config

        o = cfg.options
        if o.attention == "flex" and not resolve_device(cfg.device).startswith("cuda"):
            raise UsageError(
                "--attention flex trains on a GPU only (no backward pass on a CPU); use chunked"
            )
        over = {"intermediate_size": cfg.intermediate_size} if cfg.intermediate_size else {}
        norms = {k: getattr(o, k) for k in SGLANG_LACKS}
        dcfg = DrafterConfig.from_target(
            text_config(model_dir),
            len(draft_ids),
            **over,
            **norms,
            attention_window=cfg.attention_window,
            target_layers=len(meta["aux_layers"]),
        )
        torch.manual_seed(cfg.seed)
        drafter = Drafter(dcfg)
        drafter.attention = o.attention
        drafter.embed_tokens.weight.data.copy_(embed_weight(model_dir).float())
        drafter.set_draft_vocab(draft_ids)
        topk = "topk" in str(meta.get("layout", ""))
        from_target = o.head_init.startswith("target")
        head = lm_head_weight(model_dir).float() if from_target or not topk else None
        if from_target:
            # The drafter's last state stands in for the target's pre-norm state, so the
            # target's head rows (and final norm) are where the drafter's should start.
            drafter.lm_head.weight.data.copy_(head[draft_ids])  # (D, H)
            if not dcfg.norm_output:
                # With norm_output the normed state is the next step's input too, so the
                # norm starts at one, as every other norm of the drafter does.
                drafter.norm.weight.data.copy_(final_norm_weight(model_dir).float())  # (H,)
            drafter.lm_head.weight.requires_grad_(o.head_init != "target-frozen")
        if o.layer_init == "target":
            start_from_target_layer(
                drafter, model_dir, text_config(model_dir).num_hidden_layers - 1
            )
        return drafter, None if topk else head

    def config_dict(self, model: Drafter) -> dict:
        return model.config.to_dict()

    def from_config(self, cdict: dict) -> Drafter:
        return Drafter(DrafterConfig(**cdict))

    def describe(self, cfg) -> str:
        window = f", attention window {cfg.attention_window}" if cfg.attention_window else ""
        return f"EAGLE-3, {cfg.options.ttt_steps} TTT steps{window}"

    def positions(self, cfg) -> int:
        """Predictions per root that the loss and the metrics count: the TTT steps."""
        return cfg.options.ttt_steps

    def prepare_batch(self, model: Drafter, batch: dict, lm_head, cfg=None) -> None:
        """The target's view (soft labels, argmax) added before the loss and its counts."""
        add_targets(batch, model, lm_head)

    def counts(self, batch: dict, cfg) -> list[float]:
        ids = sample_ids(batch) if cfg.loss_average == "sequence" else None
        return [counted(lm, ids) for _, lm in loss_masks(batch, cfg.options.ttt_steps)]

    def loss(self, model: Drafter, batch: dict, cfg, norm):
        return ttt_loss(
            model,
            batch,
            cfg.options.ttt_steps,
            cfg.options.step_decay,
            norm,
            cfg.loss,
            cfg.loss_average,
            cfg.options.align_topk,
        )

    # ---------------------------------------------------------------- export

    def export(
        self, fmt: Format, state: dict, cdict: dict, info: dict, target: dict, dtype, k: int
    ):
        c = DrafterConfig(**cdict)
        served = self.serving[fmt]
        if why := served.refuses(c):
            raise UsageError(why)
        if c.target_layers != 3:
            raise UsageError(
                f"the drafter reads {c.target_layers} target layers; vLLM's and SGLang's EAGLE-3 "
                "models read three: extract with three --aux-layers to serve it"
            )
        if c.draft_vocab_size == c.vocab_size:
            if state["d2t"].any():
                raise ProblemError(
                    "the draft vocabulary is the whole vocabulary but d2t is not zero"
                )
            state = {n: v for n, v in state.items() if n not in ("d2t", "t2d")}  # vLLM refuses them
        tensors = {}
        for name, t in state.items():
            if name.startswith("midlayer."):
                name = served.writer.prefix + name.removeprefix("midlayer.")
            if t.is_floating_point():
                t = t.to(dtype)
            elif name == "t2d":
                t = t.bool()
            elif name == "d2t":
                t = t.long()
            tensors[name] = t.contiguous()
        dtype_name = str(dtype).removeprefix("torch.")
        return tensors, served.writer.config(c, info["aux_layers"], target, dtype_name, k)

    def reads_export(self, cfg: dict) -> bool:
        # vLLM keys on the speculators type, whatever the architecture is called (speculators'
        # own save_pretrained writes Eagle3DraftModel).
        return (cfg.get("architectures") or [None])[0] in _ARCHS or cfg.get(
            "speculators_model_type"
        ) == "eagle3"

    def load_export(self, cfg: dict, raw: dict, cfg_file) -> tuple[Drafter, list[int]]:
        arch = (cfg.get("architectures") or ["?"])[0]
        if arch == "Eagle3Speculator" or cfg.get("speculators_model_type") == "eagle3":
            layer, aux = cfg["transformer_layer_config"], cfg["eagle_aux_hidden_state_layer_ids"]
            prefix = "layers.0."
            # vLLM's defaults for fields a speculators config leaves out
            norms = {
                "norm_before_residual": cfg.get("norm_before_residual", True),
                "norm_before_fc": cfg.get("norm_before_fc", False),
                "norm_output": cfg.get("norm_output", False),
            }
            for key, allowed in _ARCH_FIELDS.items():
                if cfg.get(key) not in allowed:
                    raise UsageError(
                        f"{cfg_file}: {key} = {cfg.get(key)!r} is an architecture eyas's "
                        "drafter does not have; it cannot evaluate this export"
                    )
        else:  # SGLang's ids: outputs of 0-based layers
            layer, prefix = cfg, "midlayer."
            aux = [i + 1 for i in cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"]]
            norms = {
                "norm_before_residual": False,  # what SGLang's model does whatever is written
                "attention_window": cfg.get(WINDOW),
            }
        if layer.get("num_hidden_layers", 1) != 1:
            raise UsageError(
                f"{cfg_file}: {layer['num_hidden_layers']} decoder layers; eyas's EAGLE-3 "
                "drafter has one, so it cannot evaluate this export"
            )
        c = DrafterConfig(
            **layer_fields(layer, cfg_file),
            draft_vocab_size=cfg.get("draft_vocab_size") or layer["vocab_size"],
            target_layers=len(aux),
            **norms,
        )
        drafter = Drafter(c)
        state = {
            ("midlayer." + n.removeprefix(prefix) if n.startswith(prefix) else n): v
            for n, v in raw.items()
        }
        state = {n: v.float() if v.is_floating_point() else v for n, v in state.items()}
        if c.draft_vocab_size == c.vocab_size and "d2t" not in state:  # the identity, left out
            state["d2t"] = torch.zeros(c.vocab_size, dtype=torch.long)
            state["t2d"] = torch.ones(c.vocab_size, dtype=torch.bool)
        load_weights(drafter, state, f"{cfg_file.parent}/model.safetensors")
        return drafter.eval(), list(aux)

    def proposer(self, model: Drafter, target_layers_hf: list[int]) -> ChainProposer:
        return ChainProposer(model, target_layers_hf)

    def trained_drafts(self, model: Drafter, input_ids, states, at: int, k: int) -> list[int]:
        # root at-1 pairs its state with x_at; TTT step i there predicts x_{at+1+i}
        steps = model.forward_ttt(input_ids, states, k)
        return [int(model.draft_ids[logits[0, at - 1].argmax()]) for logits, _ in steps]


def start_from_target_layer(drafter: Drafter, model_dir, index: int) -> None:
    """--layer-init target: the drafter's decoder layer starts as the target's layer `index`.
    Its q/k/v read [embedding, state] side by side: the state's half takes the target's
    projections, the embedding's half keeps its random start; the state's norm (hidden_norm)
    takes the target's input norm; o_proj, the MLP and the post-attention norm are copied."""
    w = layer_weights(model_dir, index)
    layer, H = drafter.midlayer, drafter.config.hidden_size
    copies = {
        "self_attn.o_proj": layer.self_attn.o_proj.weight,
        "mlp.gate_proj": layer.mlp.gate_proj.weight,
        "mlp.up_proj": layer.mlp.up_proj.weight,
        "mlp.down_proj": layer.mlp.down_proj.weight,
        "input_layernorm": layer.hidden_norm.weight,
        "post_attention_layernorm": layer.post_attention_layernorm.weight,
    }
    halves = {
        f"self_attn.{n}": getattr(layer.self_attn, n).weight.detach()[:, H:]
        for n in ("q_proj", "k_proj", "v_proj")
    }
    for name, dest in (copies | halves).items():
        if tuple(w[name].shape) != tuple(dest.shape):
            raise UsageError(
                f"--layer-init target: the target's layer {index} {name} is {tuple(w[name].shape)}, "
                f"the drafter's {tuple(dest.shape)} (a target whose layers are not Llama-style, or "
                "--intermediate-size): train with --layer-init random"
            )
        with torch.no_grad():
            dest.copy_(w[name].float())


class ChainProposer:
    """EAGLE-3 in `evaluate`: a key/value prefix built from the target's states (root t pairs
    the fused state f_t with the next token x_{t+1}), a chain of K drafts from the last root,
    and one prefix entry per token the target keeps."""

    def __init__(self, drafter: Drafter, target_layers_hf: list[int]):
        self.d, self.target_layers_hf = drafter, target_layers_hf

    def start(self, prompt: list[int], states: torch.Tensor, next_token: int) -> None:
        dev = states.device
        self.pk, self.pv = self.d.prefix_kv(
            torch.tensor([prompt[1:] + [next_token]], device=dev), states, 0
        )
        self.last, self.n = states[:, -1:], len(prompt)  # n: positions with target states

    def propose(self, next_token: int, k: int) -> list[int]:
        return self.d.draft(self.pk, self.pv, next_token, self.last, root=self.n - 1, k=k)

    def accept(self, tokens: list[int], states: torch.Tensor) -> None:
        """`tokens` the target kept (the accepted drafts and its own next token), `states`
        (1, len(tokens), 3H) the target's states at the positions that produced them."""
        kv = self.d.prefix_kv(torch.tensor([tokens], device=states.device), states, self.n)
        self.pk, self.pv = torch.cat([self.pk, kv[0]], 2), torch.cat([self.pv, kv[1]], 2)
        self.last = states[:, -1:]
        self.n += len(tokens)


KIND = Eagle3()
