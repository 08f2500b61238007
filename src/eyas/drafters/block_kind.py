"""The kind side of a block drafter (`drafters.block_drafter`), shared by the kinds built on
it (DFlash, DSpark): building it from the target and a run, its anchors and block loss, and
drafting a block in `evaluate`. A kind subclasses `BlockKind` and adds its name, its serving
formats, and where its network differs (`first_slot`, `outputs`, `slot_loss`)."""

from __future__ import annotations

from types import SimpleNamespace

import torch
import torch.nn.functional as F

from eyas.drafters import decoder_fields
from eyas.drafters.block_drafter import DFlashConfig, DFlashDrafter, block_weights, choose_anchors
from eyas.drafters.blocks import layer_fields, load_weights
from eyas.drafters.formats import format_named
from eyas.drafters.loss import (
    LOSSES,
    Chain,
    Scores,
    add_targets,
    at_rows,
    by_rows,
    counted,
    head_rows,
    on_policy,
    sample_ids,
    take_rows,
    target_dist,
)
from eyas.errors import UsageError
from eyas.targets.weights import embed_weight, lm_head_weight


def choose_mask_token(model_dir: str, counts, trust_remote_code: bool = False) -> int:
    """The id whose embedding fills a block's masked positions: the highest-id special (added)
    token the training data never trains on and that is not the end, start or padding token;
    failing that, the vocabulary's last id if the data never trains on it."""
    from eyas.targets.target import load_tokenizer

    tok = load_tokenizer(model_dir, trust_remote_code)
    taken = {tok.eos_token_id, tok.bos_token_id, tok.pad_token_id}
    specials = sorted({*tok.all_special_ids, *tok.get_added_vocab().values()} - taken, reverse=True)
    for i in specials:
        if i < len(counts) and counts[i] == 0:
            return int(i)
    last = len(counts) - 1
    if counts[last] == 0:
        return last
    raise UsageError(
        f"{model_dir}: no special token the data leaves unused to serve as DFlash's mask"
    )


def speculators_block_fields(cfg: dict, cfg_file, anchor_drafts: bool) -> tuple[dict, list[int]]:
    """The block drafter config's fields of a speculators-format config.json (DFlash's,
    DSpark's) for a kind whose anchor slot drafts (`anchor_drafts`) or not, and the target
    layers it reads (HF indices); a field of a network eyas's block drafter does not have is
    refused in one line naming it."""
    sample = cfg.get("sample_from_anchor", anchor_drafts)
    if sample != anchor_drafts:
        raise UsageError(
            f"{cfg_file}: sample_from_anchor = {sample}: this kind's anchor slot "
            f"{'drafts' if anchor_drafts else 'holds the verified token'}; it cannot evaluate it"
        )
    if cfg.get("sliding_window_non_causal"):
        raise UsageError(
            f"{cfg_file}: sliding_window_non_causal: sliding-window layers, which eyas's block "
            "drafter does not have; it cannot evaluate this drafter"
        )
    layer = cfg["transformer_layer_config"]
    f = layer_fields(layer, cfg_file)
    ids = list(cfg["aux_hidden_state_layer_ids"])  # HF `hidden_states` indices
    return {
        **f,
        "num_hidden_layers": layer["num_hidden_layers"],
        "draft_vocab_size": cfg.get("draft_vocab_size") or f["vocab_size"],
        "target_layers": len(ids),
        "block_size": cfg["block_size"],
        "mask_token_id": cfg["mask_token_id"],
    }, ids


def whole_vocabulary(c) -> str | None:
    """Why SGLang would run another block drafter than `c`: its DFLASH and DSPARK models load
    no head of the drafter's and draft over the target's own, every id of its vocabulary.
    None for a drafter over the whole vocabulary (and for a training's config, whose
    vocabulary is not known before it starts)."""
    V, D = getattr(c, "vocab_size", None), getattr(c, "draft_vocab_size", None)
    if V is None or D is None or D == V:
        return None
    return (
        f"a draft vocabulary of {D:,} of the target's {V:,} ids: SGLang drafts a block over the "
        "target's whole head (it loads no head of the drafter's), so it would run another "
        "drafter than the one trained and evaluated. Train with --serve-with sglang (or "
        f"--draft-vocab-size {V}: the whole vocabulary), or export --format vllm"
    )


def whole_ids(cfg, vocab_size: int) -> torch.Tensor:
    """Every id of the target's vocabulary, the draft vocabulary of a training for an engine
    that drafts over the target's whole head; another --draft-vocab-size is refused."""
    if cfg.draft_vocab_size not in (None, vocab_size):
        raise UsageError(
            f"--serve-with {cfg.options.serve_with} drafts over the target's whole vocabulary "
            f"({vocab_size:,} ids), not --draft-vocab-size {cfg.draft_vocab_size}: leave it out"
        )
    return torch.arange(vocab_size)


def dflash_format(c, info: dict, dtype, arch: str) -> dict:
    """The DFlash checkpoint format's config.json (z-lab's, which vLLM's `dflash` and SGLang's
    DFLASH and DSPARK load) of the block drafter config `c`, under the architecture `arch`."""
    from eyas import __version__

    return {
        "architectures": [arch],
        **decoder_fields(c, "qwen3", c.num_hidden_layers),
        "draft_vocab_size": c.draft_vocab_size,
        "target_hidden_size": c.hidden_size,
        # Both engines read DFlash's target_layer_ids as outputs of 0-based layers.
        "dflash_config": {
            "target_layer_ids": list(info["aux_layers"]),
            "block_size": c.block_size,
            "mask_token_id": c.mask_token_id,
            # vLLM: every layer a sliding window of W, still non-causal inside the block.
            **(
                {"use_swa": True, "swa_window_size": c.attention_window, "causal": False}
                if c.attention_window
                else {}
            ),
        },
        "torch_dtype": str(dtype).removeprefix("torch."),
        "eyas_version": __version__,
    }


def dflash_format_fields(cfg: dict, cfg_file) -> tuple[dict, list[int]]:
    """The block drafter config's fields of a DFlash-format config.json, and the target layers
    it reads (HF indices); an attention eyas's block drafter does not have is refused in one
    line naming its fields."""
    from eyas.targets.layers import hf_indices

    d = cfg.get("dflash_config") or {}
    windowed = [t for t in cfg.get("layer_types") or [] if t != "full_attention"]
    if d.get("causal") or windowed or (d.get("use_swa") and not d.get("swa_window_size")):
        said = {k: d[k] for k in ("causal", "use_swa", "swa_window_size") if k in d}
        raise UsageError(
            f"{cfg_file}: dflash_config {said}, layer_types {cfg.get('layer_types')}: an "
            "attention eyas's DFlash drafter does not have (a block that sees itself whole, "
            "one window or none on every layer)"
        )
    ids = d["target_layer_ids"]
    return {
        **layer_fields(cfg, cfg_file),
        "num_hidden_layers": cfg["num_hidden_layers"],
        "draft_vocab_size": cfg.get("draft_vocab_size") or cfg["vocab_size"],
        "target_layers": len(ids),
        "block_size": d["block_size"],
        "mask_token_id": d["mask_token_id"],
        "attention_window": d["swa_window_size"] if d.get("use_swa") else None,
    }, hf_indices(ids)


DPACE_ALPHA = 0.5  # D-PACE: a position's confidence q is smoothed to (1 - alpha) q + alpha


def dpace_weights(conf: list, counted: list, alpha: float = DPACE_ALPHA) -> list:
    """D-PACE's loss weight of each predicting position j of each block, from the drafter's
    probability q of the target's token at every position (lists over positions of (B, N)):
    the expected number of the block's drafts accepted from j on, sum over k >= j of the
    product of the smoothed confidences of positions 1..k, counted positions alone adding a
    term (an uncounted one passes with 1); zero where j is not counted."""
    m = torch.stack(counted, -1).float()  # (B, N, S')
    smooth = torch.where(m > 0, (1 - alpha) * torch.stack(conf, -1).float() + alpha, 1.0)
    reach = torch.cumprod(smooth, -1) * m
    return list((reach.flip(-1).cumsum(-1).flip(-1) * m).unbind(-1))


def export_tensors(state: dict, c, dtype) -> dict:
    """A block drafter's tensors as an export holds them: floats in `dtype`, d2t int64 and
    t2d bool (neither where the draft vocabulary is the whole vocabulary)."""
    out = {}
    for name, t in state.items():
        if name in ("d2t", "t2d") and c.draft_vocab_size == c.vocab_size:
            continue  # no map for the whole vocabulary
        t = t.to(dtype) if t.is_floating_point() else t
        out[name] = (t.bool() if name == "t2d" else t.long() if name == "d2t" else t).contiguous()
    return out


def read_block_weights(model, raw: dict, cfg_file) -> None:
    """An export's tensors into a block drafter: d2t/t2d made for a whole vocabulary left
    without them; speculators' copy of the target's final norm (its training's, not the
    drafter's) left out; a missing embedding table said in one line."""
    state = {n: v.float() if v.is_floating_point() else v for n, v in raw.items()}
    state.pop("verifier_norm.weight", None)
    c = model.config
    if c.draft_vocab_size == c.vocab_size and "d2t" not in state:
        state["d2t"] = torch.zeros(c.vocab_size, dtype=torch.long)
        state["t2d"] = torch.ones(c.vocab_size, dtype=torch.bool)
    if "embed_tokens.weight" not in state:
        raise UsageError(
            f"{cfg_file.parent}/model.safetensors: no embed_tokens (the tool that saved it "
            "leaves the target's own table out): evaluate reads it from the target's --model"
        )
    if "lm_head.weight" not in state:
        raise UsageError(
            f"{cfg_file.parent}/model.safetensors: no lm_head; eyas evaluates a drafter that "
            "carries its head"
        )
    load_weights(model, state, f"{cfg_file.parent}/model.safetensors")


def until_miss(o) -> str:
    """What a training banner says of Spec-AUF (`--loss-until-miss`), where it is on."""
    return ", loss up to each block's first miss (Spec-AUF)" if o.loss_until_miss else ""


class BlockKind:
    """What every block drafter kind does alike; see `drafters.DrafterKind`."""

    position_name = "block position"  # what the metrics' positions are called
    demo_options: dict = {}  # `eyas demo` trains the defaults
    config_class, model_class = DFlashConfig, DFlashDrafter
    # The first block slot that predicts: 1, slot j predicting the token at anchor + j (the
    # anchor's own slot holds the verified token and predicts nothing).
    first_slot = 1

    def build(self, cfg, meta: dict, model_dir: str, draft_ids: torch.Tensor):
        from eyas.data.dataset import PreparedDataset
        from eyas.targets.target import text_config

        if "topk" in str(meta.get("layout", "")):
            raise UsageError(
                "a DFlash drafter trains on the target's final states: extract with --target last"
            )
        t = text_config(model_dir)
        if self.serving[format_named(cfg.options.serve_with)].whole_vocabulary:
            draft_ids = whole_ids(cfg, t.vocab_size)
        H, heads = t.hidden_size, t.num_attention_heads
        kv = getattr(t, "num_key_value_heads", None) or heads
        ds = PreparedDataset.open(meta["dataset_path"], check=False)
        c = self.config_class(
            **self.own_config(cfg, t, len(draft_ids)),
            hidden_size=H,
            intermediate_size=cfg.intermediate_size or getattr(t, "intermediate_size", 4 * H),
            num_attention_heads=heads,
            num_key_value_heads=kv if heads % kv == 0 else heads,
            head_dim=getattr(t, "head_dim", None) or H // heads,
            vocab_size=t.vocab_size,
            draft_vocab_size=len(draft_ids),
            target_layers=len(meta["aux_layers"]),
            attention_window=cfg.attention_window,
            mask_token_id=choose_mask_token(
                model_dir, ds.vocab_counts(), bool(meta.get("trust_remote_code_required"))
            ),
            rms_norm_eps=getattr(t, "rms_norm_eps", 1e-6),
            rope_theta=float(
                ((getattr(t, "rope_parameters", None) or {}).get("rope_theta"))
                or getattr(t, "rope_theta", 10000.0)
                or 10000.0
            ),
            max_position_embeddings=getattr(t, "max_position_embeddings", 4096),
            hidden_act=getattr(t, "hidden_act", "silu"),
        )
        torch.manual_seed(cfg.seed)
        model = self.model_class(c)
        model.embed_tokens.weight.data.copy_(embed_weight(model_dir).float())
        head = lm_head_weight(model_dir).float()
        model.lm_head.weight.data.copy_(head[draft_ids])
        model.set_draft_vocab(draft_ids)
        return model, head

    def unservable(self, cfg) -> str | None:
        own = self.own_config(cfg, None, None)  # what the drafter's config will say
        trained = SimpleNamespace(attention_window=cfg.attention_window, **own)
        return self.serving[format_named(cfg.options.serve_with)].refuses(trained)

    def own_config(self, cfg, target_config, draft_vocab: int) -> dict:
        """The drafter config's fields that come from the kind's own options."""
        return {
            "num_hidden_layers": cfg.options.drafter_layers,
            "block_size": cfg.options.block_size,
        }

    def config_dict(self, model: DFlashDrafter) -> dict:
        return model.config.to_dict()

    def from_config(self, cdict: dict) -> DFlashDrafter:
        return self.model_class(self.config_class(**cdict))

    def describe(self, cfg) -> str:
        window = f", attention window {cfg.attention_window}" if cfg.attention_window else ""
        o = cfg.options
        return (
            f"DFlash, blocks of {o.block_size}, {o.drafter_layers} layer(s){window}{until_miss(o)}"
        )

    def positions(self, cfg) -> int:
        return cfg.options.block_size - self.first_slot

    def prepare_batch(self, model: DFlashDrafter, batch: dict, lm_head, cfg=None) -> None:
        add_targets(batch, model, lm_head)
        stride = cfg.options.anchor_stride if cfg is not None else 1
        key = batch.get("_key")
        phase = int(key) % stride if key is not None else 0
        batch["anchors"] = choose_anchors(
            batch["loss_mask"], batch["valid"], stride, phase, batch.get("segments")
        )

    def _masks(self, batch: dict, S: int) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        """Per predicting block slot (the n-th predicting the token at a+n, n = 1, 2, ...):
        (position a+n-1 of the target's distribution, scored, loss mask), each (B, N)."""
        a = batch["anchors"]
        T = batch["input_ids"].shape[1]
        m = batch["valid"] & batch["loss_mask"]
        seg = batch.get("segments")  # packed rows: a block never predicts the next sample
        out = []
        for n in range(1, S - self.first_slot + 1):
            at = (a + n).clamp(max=T - 1)
            scored = (a >= 0) & (a + n < T) & m.gather(1, at)
            if seg is not None:
                scored = scored & (seg.gather(1, at) == seg.gather(1, a.clamp(min=0)))
            src = (a + n - 1).clamp(min=0, max=T - 1)
            out.append((src, scored, scored & batch["in_vocab"].gather(1, src)))
        return out

    def counts(self, batch: dict, cfg) -> list[float]:
        ids = self._sample_ids(batch, cfg)
        return [counted(lm, ids) for _, _, lm in self._masks(batch, cfg.options.block_size)]

    def _sample_ids(self, batch: dict, cfg) -> torch.Tensor | None:
        """The sample of each block's anchor (B, N), where the loss is averaged per sample."""
        if cfg.loss_average != "sequence":
            return None
        return sample_ids(batch).gather(1, batch["anchors"].clamp(min=0))

    def outputs(self, model: DFlashDrafter, batch: dict) -> dict:
        """The training forward's outputs: the states the head reads (B, N, S', H) of the S'
        predicting block slots (the head never reads the anchor's own slot, a quarter of a
        block of 4), and `head(states, i, rows)`, the i-th predicting slot's logits of those
        rows of blocks (the loss applies it a part of the blocks at a time)."""
        a = batch["anchors"]
        B, N, S = *a.shape, model.config.block_size
        blocks = model.training_blocks(
            batch["input_ids"], batch["aux"], a, batch.get("segments"), batch.get("positions")
        )
        h = model.block_states(*blocks, self.first_slot).view(B, N, S - self.first_slot, -1)
        return {"states": h, "head": lambda xs, _i, _rows: model.lm_head(xs)}

    def slot_loss(self, out: dict, slot: int, s: Scores, lmask, chain: Chain, i: int, cfg, rows):
        """The loss (B, r) of block slot `slot`, the i-th predicting one (`out`'s i-th), at
        the blocks `rows`, from the drafter's logits there and the target's distribution
        (`s`)."""
        if cfg.loss == "opd":
            right, since = at_rows(chain.all_right, rows), at_rows(chain.since(i), rows)
            return on_policy(s.logq, s.logp, right, since)
        return s.loss(cfg.loss, lmask)

    def loss(self, model: DFlashDrafter, batch: dict, cfg, norm):
        o, S = cfg.options, model.config.block_size
        out = self.outputs(model, batch)
        dids = model.draft_ids
        ids = self._sample_ids(batch, cfg)
        chain = Chain(batch["anchors"], ids)
        B, N = batch["anchors"].shape
        rows = head_rows(B, N, dids.numel(), LOSSES[cfg.loss].per_position)
        target, head = target_dist(batch), out["head"]
        dpace = o.position_weights == "dpace"
        confidence = None
        if dpace:  # the drafter's probability of the target's token (its draft index)
            index = torch.zeros(len(model.t2d), dtype=torch.long, device=dids.device)
            index[dids] = torch.arange(len(dids), device=dids.device)
        decay = block_weights(S - self.first_slot + 1, o.block_decay).tolist()
        until_miss = o.loss_until_miss and model.training
        held = torch.ones_like(batch["anchors"], dtype=torch.bool)  # all earlier slots right
        slots = []
        for i, (src, scored, lmask) in enumerate(self._masks(batch, S)):
            slot = self.first_slot + i
            want = batch["tgt_top"].gather(1, src)  # (B, N)
            every = lmask  # what the batch's counts hold
            if until_miss:
                lmask = lmask & held

            def per_rows(logits, sl, slot=slot, i=i, src=src, lmask=lmask):
                s = Scores(logits, target, lambda x: take_rows(x, src, sl))  # (B, r, D)
                return self.slot_loss(out, slot, s, at_rows(lmask, sl), chain, i, cfg, sl)

            if dpace:

                def confidence(logits, sl, want=want):
                    probs = F.softmax(logits.float(), -1)
                    return probs.gather(-1, index[at_rows(want, sl)][..., None]).squeeze(-1)

            per, arg, conf = by_rows(
                out["states"][:, :, i],
                lambda xs, sl, i=i: head(xs, i, sl),
                per_rows,
                rows,
                confidence,
                live=lmask,  # a row outside the mask adds nothing to the loss
            )  # (B, N)
            right = dids[arg] == want
            held = held & right
            n = norm[i] if norm is not None else counted(lmask, ids)
            chain.add(i, per, lmask, scored, right, None if dpace else decay[i], n, every)
            slots.append((per, lmask, conf, n, every))
        if dpace:  # the weights need every position's confidence
            weights = dpace_weights([s[2] for s in slots], [s[1] for s in slots])
            for (per, lmask, _, n, every), w in zip(slots, weights, strict=True):
                chain.add_loss(per, lmask, w, n, every)
        return chain.result()

    def proposer(self, model: DFlashDrafter, target_layers_hf: list[int]) -> BlockProposer:
        return BlockProposer(model, target_layers_hf)

    def trained_drafts(self, model: DFlashDrafter, input_ids, states, at: int, k: int) -> list[int]:
        # the block anchored at `at`: x_at, then MASKs at at+1 .. at+S-1
        first = self.first_slot
        logits = model.forward_blocks(input_ids, states, torch.tensor([[at]]))[0, 0]
        return model.draft_ids[logits[first : first + k].argmax(-1)].tolist()


class BlockProposer:
    """DFlash in `evaluate`: the context keys/values of every position with target states,
    a block [next token, MASK...] drafted in one pass, the context extended by the positions
    the target verified."""

    def __init__(self, model: DFlashDrafter, target_layers_hf: list[int]):
        self.m, self.target_layers_hf = model, target_layers_hf

    def _kv(self, states: torch.Tensor, start: int):
        pos = torch.arange(start, start + states.shape[1], device=states.device)[None]
        return self.m.context_kv(self.m.context(states), pos)

    def start(self, prompt: list[int], states: torch.Tensor, next_token: int) -> None:
        self.kv, self.n = self._kv(states, 0), states.shape[1]

    def propose(self, next_token: int, k: int) -> list[int]:
        if k > (most := self.m.drafts_per_block()):
            raise UsageError(
                f"a block of {self.m.config.block_size} drafts {most} tokens a round, not {k}: "
                f"give --draft-tokens {most} or fewer"
            )
        return self.m.draft_block(self.kv, self.n, next_token)[:k]

    def accept(self, tokens: list[int], states: torch.Tensor) -> None:
        new = self._kv(states, self.n)
        self.kv = [
            (torch.cat([k, nk], 2), torch.cat([v, nv], 2))
            for (k, v), (nk, nv) in zip(self.kv, new, strict=True)
        ]
        self.n += states.shape[1]
