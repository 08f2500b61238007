"""eyas against the peer users would pick instead: vLLM's speculators 0.9, same data.

    python bench/peer.py --real REAL --work WORK --conversations 300,1000 --seeds 0,1 \
        [--eyas NAME='train options' ...] [--peer peer-eyas-schedule,peer-own-defaults] \
        [--holdout RUN | --holdout-conversations 200] [--jobs 2] [--prompts 80]

For each size N, the first N ShareGPT conversations that open with a user turn (file order)
are prepared (`--max-length 448`, draft vocabulary 32,000, prepare's default; the figures
before 2026-12-07 used 8,192) and extracted once (or `--run`
gives an extraction); then, for every seed, EAGLE-3 drafters are trained on it and judged
together:

- **eyas**: `eyas train --epochs 3 --seed S` with what eyas chooses (an EAGLE-3 drafter of 3
  TTT steps), and any other configuration given by `--eyas NAME=OPTIONS` (another kind's with
  `--kind`).
- **the peer**: speculators 0.9's own `Eagle3DraftModel` as its CLI builds it (Muon with
  AdamW, `norm_before_fc`, `norm_before_residual`, `norm_output`, the target's head frozen),
  its KL loss, TTT alignment, packed collation, step decay 1.0 and grad clip 1.0, in a
  virtual environment of its own (`--venv`; made on first use from the package registry; on
  a CPU its Muon orthogonalises in float32, as eyas's does). It trains on the same samples
  with the first eyas configuration's split and batch plan (batch by batch), in two ways:
  `peer-eyas-schedule` (eyas's learning rate for both optimizers, its warm-up and cosine)
  and `peer-own-defaults` (speculators 0.9.0's own: lr 1e-3 for both, linear schedule with
  1% warm-up down to zero). The target's stored last state is post-norm, so the peer's
  verifier norm is the identity. Its weights are moved into eyas's drafter, checked against
  speculators' own logits, and exported by eyas.
- **one judge**: validation accuracy per TTT step with eyas's metric on the same held-out
  samples (and on every sample of `--holdout`, another extraction, or of the
  `--holdout-conversations` ShareGPT conversations after the largest size, prepared and
  extracted alike), then `eyas evaluate`
  (hf) on MT-Bench's first turns, K drafts, greedy, the prompts cut into `--jobs` slices
  judged at once (bench/judging.py; every drafter of a slice in one process, greedy
  decoding kept in REAL/greedy and done once per prompt across calls).

Trainings run `--jobs` at a time, each on one CPU thread, and are reused when finished; so
are judged drafters (WORK/nN/judged). `--judge-finished` trains nothing: it judges the
trainings of the same command line that have finished (another call may still be training
the rest), so that a long comparison's figures are kept as its trainings end, not only when
the last one has; the full call then reuses them. The table at the end gives, per size, each
configuration's mean over seeds, each seed, and against the anchor (the better of the
peer's configurations) the ratio and the paired difference with its 95% interval over
prompts (resampled alike for every seed). A benchmark, not a test; where speculators cannot
be installed it says why and exits 0 without figures.
"""

from __future__ import annotations

import argparse
import json
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

from judging import one_thread_env as one_thread

REPO = Path(__file__).resolve().parent.parent
SPECULATORS = ("speculators==0.9.0", "hs-connectors==0.9.0")
# What speculators imports on a CPU (its declared torchvision/torchaudio would replace a CPU
# torch, and its GPU extras have no use here); transformers as it pins it.
PEER_DEPS = ("torch==2.13.0", "transformers==5.19.0", "loguru", "pydantic", "pydantic-settings",
             "click", "psutil", "tqdm", "safetensors", "rich", "typer", "numpy", "huggingface-hub",
             "httpx", "aiohttp", "protobuf", "datasets<=5.1.0", "openai", "xxhash", "jinja2")  # fmt: skip


class Skip(Exception):
    """The peer cannot run here; the message says why."""


# ------------------------------------------------------------------ the peer's environment


def ensure_venv(venv: Path) -> Path:
    """The peer's python, its environment made on first use."""
    py = venv / "bin" / "python"
    check = [str(py), "-c", "import speculators.models.eagle3, speculators.train.optimizers"]
    if py.is_file() and subprocess.run(check, capture_output=True).returncode == 0:
        return py
    print(
        f"making the peer's environment in {venv} (speculators 0.9 and what it imports)", flush=True
    )
    steps = [
        [sys.executable, "-m", "venv", str(venv)],
        [str(py), "-m", "pip", "install", "-q", *PEER_DEPS],
        [str(py), "-m", "pip", "install", "-q", "--no-deps", *SPECULATORS],
    ]
    for cmd in steps:
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode != 0:
            tail = (r.stderr.strip().splitlines() or ["no output"])[-1]
            raise Skip(f"cannot install the peer ({shlex.join(cmd[-3:])}): {tail}")
    r = subprocess.run(check, capture_output=True, text=True)
    if r.returncode != 0:
        raise Skip(f"speculators does not import: {(r.stderr.strip().splitlines() or ['?'])[-1]}")
    return py


# ------------------------------------------------------------------ the data


def build_run(
    real: Path, n: int, work: Path, max_length: int, draft_vocab: int, skip: int = 0
) -> Path:
    """An extraction of the first `n` ShareGPT records (after `skip`) that open with a user
    turn and hold an assistant turn, in file order: prepared at `max_length` with a draft
    vocabulary of `draft_vocab`, extracted with the hf backend; reused when finished."""
    sys.path.insert(0, str(REPO / "bench"))
    from real_target import pick_conversations

    from eyas.run.runmeta import read_run_meta
    from eyas.stages.extract import ExtractConfig, extract
    from eyas.stages.prepare import PrepareConfig, prepare

    w = work / (f"n{n}" if not skip else f"n{n}-from{skip}")
    run = w / "run"
    if (run / "run.json").is_file() and (w / "extracted").is_file():
        made = json.loads((w / "ds" / "dataset.json").read_text()).get("draft_vocab_size")
        if made != draft_vocab:
            raise SystemExit(
                f"{w} was prepared with a draft vocabulary of {made}, not {draft_vocab}: pass "
                f"--draft-vocab {made} to use it, or another --work"
            )
        print(f"data: reusing {run} ({read_run_meta(run)['samples']} samples)", flush=True)
        return run
    w.mkdir(parents=True, exist_ok=True)
    recs = pick_conversations(real / "sharegpt.jsonl", n + skip, seed=None)[skip:]
    data = w / "conversations.jsonl"
    data.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in recs))
    p = prepare(PrepareConfig(model=str(real / "model"), data=(str(data),), out=str(w / "ds"),
                              max_length=max_length, draft_vocab_size=draft_vocab, max_error_rate=1.0,
                              force=True, progress=False))  # fmt: skip
    left = ", ".join(f"{v} {k}" for k, v in p.reasons.items())
    print(f"data: {len(recs)} conversations, {p.samples} samples ({p.tokens:,} tokens) kept"
          + (f"; left out: {left}" if left else ""), flush=True)  # fmt: skip
    t0 = time.monotonic()
    if (run / "run.json").is_file():
        extract(resume=str(run))
    else:
        extract(ExtractConfig(model=str(real / "model"), data=str(w / "ds"), out=str(run),
                              store_dtype="bfloat16", min_free="1G", progress=False))  # fmt: skip
    (w / "extracted").write_text(f"{time.monotonic() - t0:.0f} s\n")
    return run


# ------------------------------------------------------------------ eyas's side


def batch_plan(run: Path, train_dir: Path) -> dict:
    """eyas's training of `train_dir`, batch by batch: samples, split, lr per step."""
    from eyas.data.dataset import PreparedDataset
    from eyas.drafters.block_kind import choose_mask_token
    from eyas.run.runmeta import read_run_meta
    from eyas.training.train_data import epoch_batches, plan_batches, split_samples, usable_samples
    from eyas.training.trainer import draft_vocab_for, lr_at, warmup_for

    cfg = json.loads((train_dir / "train.json").read_text())["config"]
    if cfg["grad_accum"] != 1 or cfg["pack"]:
        raise SystemExit("bench/peer.py replays trainings with --grad-accum 1 and no --pack")
    meta = read_run_meta(run)
    entries, _ = usable_samples(run, meta["hidden_size"], lambda m: None)
    train_idx, val_idx = split_samples(sorted(entries), cfg["val_fraction"])
    lengths = {i: e["tokens"] for i, e in entries.items()}
    epochs = [epoch_batches(lengths, train_idx, cfg["batch_tokens"], cfg["seed"], e)
              for e in range(cfg["epochs"])]  # fmt: skip
    total = sum(len(b) for b in epochs)
    warm = warmup_for(cfg["warmup_steps"], total)
    lrs = [lr_at(s, cfg["lr"], cfg["min_lr_ratio"], warm, total) for s in range(total)]
    ds = PreparedDataset.open(meta["dataset_path"], check=False)
    draft_ids = ds.draft_vocab(draft_vocab_for(cfg["draft_vocab_size"], meta)).tolist()
    mask = cfg.get("mask_token_id")
    if cfg.get("kind", "eagle3") != "eagle3" and mask is None:  # as eyas's block kinds choose it
        mask = choose_mask_token(meta["model_path"], ds.vocab_counts())
    return {"run": str(run), "model": meta["model_path"], "aux_layers_hf": meta["aux_layers_hf"],
            "epochs": epochs, "val": plan_batches(lengths, val_idx, cfg["batch_tokens"]),
            "lrs": lrs, "ttt_steps": cfg.get("ttt_steps", 3), "draft_ids": draft_ids, "eyas": cfg,
            "mask_token_id": mask}  # fmt: skip


def val_accuracy(export: Path, run: Path, plan: dict) -> dict:
    """eyas's validation summary of the exported drafter over the plan's held-out batches:
    per TTT step for EAGLE-3, per predicting block position for the block kinds."""
    from recipe import scored, screen_config

    from eyas.training.checkpoint import read_export

    kind, drafter, _ = read_export(export, plan["model"])  # (a table left out: the target's)
    how = screen_config(kind.name, plan["ttt_steps"], drafter)
    return scored(drafter, kind, how, run, plan["val"], plan["model"])


# ------------------------------------------------------------------ the peer's side (its venv)


def cpu_muon() -> None:
    """torch's Muon orthogonalises in bfloat16, which a CPU without fast bfloat16 runs about
    50x slower than the rest of a step; on a CPU the peer's Muon runs the same iteration in
    float32, as eyas's does (on a GPU both keep bfloat16)."""
    import torch

    if not torch.cuda.is_available():
        import torch.optim._muon as torch_muon

        from eyas.training.muon import orthogonalise

        torch_muon._zeropower_via_newtonschulz = lambda g, _coeffs, steps, eps: orthogonalise(
            g, steps, eps
        )


def vocab_maps(model_dir: str, draft_ids: list[int]):
    """(t2d, d2t) of a draft vocabulary, as speculators takes them."""
    import torch
    from transformers import AutoConfig

    ids = torch.tensor(draft_ids)
    t2d = torch.zeros(AutoConfig.from_pretrained(model_dir).vocab_size, dtype=torch.bool)
    t2d[ids] = True
    return t2d, ids - torch.arange(len(ids))


def peer_eagle3(model_dir: str, draft_ids: list[int], aux_layers_hf: list[int], ttt_steps: int,
                norms: bool, attn: str = "sdpa"):  # fmt: skip
    """speculators' EAGLE-3 drafter as its CLI builds it by default (one llama layer, its
    attention in a sliding window of 2,048, wider than any sample here), in float32, training;
    the verifier norm the identity (eyas stores the target's post-norm last state)."""
    import torch
    from speculators.models.eagle3 import Eagle3DraftModel
    from speculators.train.cli import create_transformer_layer_config

    t2d, d2t = vocab_maps(model_dir, draft_ids)
    layer_cfg = create_transformer_layer_config(model_dir, num_layers=1, draft_arch="llama",
                                                hidden_act=None, sliding_window=2048,
                                                full_attention_indices=[])  # fmt: skip
    model = Eagle3DraftModel.from_training_args(
        layer_cfg, t2d=t2d, d2t=d2t, draft_vocab_size=len(draft_ids), norm_before_residual=norms,
        norm_before_fc=norms, norm_output=norms, ttt_steps=ttt_steps,
        verifier_name_or_path=model_dir, target_layer_ids=aux_layers_hf,
        draft_attn_impl=attn,
    )  # fmt: skip
    model.verifier_norm = torch.nn.Identity()
    return model.float().train()


PEER_ANCHORS = 512  # the peer's blocks a row, its CLI's default (--max-anchors)


def peer_block(p: dict, kind: str, attn: str = "sdpa", recipe: str = "eyas-shape"):
    """speculators' DFlash or DSpark drafter at eyas's default shape (2 layers, blocks of 4,
    qwen3 layers with full attention), float32, training; and its forward's keywords: the
    loss its CLI gives the kind (DFlash: cross-entropy weighted by D-PACE; DSpark: KL with the
    exponential position decay, its TV-based confidence target), `recipe` "kl" the KL and
    decay for both. `p`: model, draft_ids, aux_layers_hf, mask_token_id."""
    import torch
    from speculators.losses import resolve_loss_config
    from speculators.train.cli import create_transformer_layer_config

    t2d, d2t = vocab_maps(p["model"], p["draft_ids"])
    layer_cfg = create_transformer_layer_config(p["model"], num_layers=2, draft_arch="qwen3",
                                                hidden_act=None, sliding_window=2048,
                                                full_attention_indices=[0, 1])  # fmt: skip
    if kind == "dflash":
        from speculators.models.dflash import DFlashDraftModel as cls
    else:
        from speculators.models.dspark import DSparkDraftModel as cls
    model = cls.from_training_args(
        layer_cfg, t2d=t2d, d2t=d2t, draft_vocab_size=len(p["draft_ids"]), block_size=4,
        verifier_name_or_path=p["model"], target_layer_ids=p["aux_layers_hf"],
        draft_attn_impl=attn, mask_token_id=p["mask_token_id"],
    )  # fmt: skip
    model.verifier_norm = torch.nn.Identity()
    cli_dflash = kind == "dflash" and recipe != "kl"
    kw = {"loss_config": resolve_loss_config("ce" if cli_dflash else "kl_div", "eager"),
          "gamma": 4.0, "max_anchors": PEER_ANCHORS,
          "per_position_loss_weight": "dpace" if cli_dflash else "fixed-exp-decay"}  # fmt: skip
    if kind == "dspark":
        kw["tv_loss_fn"] = resolve_loss_config("tv", "eager")["tv"][0]
    return model.float().train(), kw


def packer(run: Path, shifted: bool = True):
    """A function of sample indices -> one packed row of those samples of `run`, as the
    peer's collation makes it (`shifted`: EAGLE-3's shift of the states against the ids)."""
    import torch
    from speculators.models.eagle3.data import shift_batch

    from eyas.run.runmeta import read_run_meta
    from eyas.training.train_data import SampleReader, to_device, usable_samples

    meta = read_run_meta(run)
    entries, _ = usable_samples(run, meta["hidden_size"], lambda m: None)
    reader = SampleReader(run, entries, checksums=True)

    def packed(idx: list[int]) -> dict:
        host = reader.batch(idx)
        b = to_device(host, torch.device("cpu"))
        reader.release(host)
        parts = []
        for r, i in enumerate(idx):
            n = entries[i]["tokens"]
            one = {"input_ids": b["input_ids"][r, :n], "hidden_states": b["aux"][r, :n],
                   "verifier_last_hidden_states": b["last"][r, :n], "loss_mask": b["loss_mask"][r, :n],
                   "lengths": torch.tensor([n]), "position_ids": torch.arange(n)}  # fmt: skip
            parts.append(shift_batch(one) if shifted else one)
        cat = {k: torch.cat([p[k] for p in parts])[None] for k in parts[0] if k != "lengths"}
        lens = torch.cat([p["lengths"] for p in parts])
        cat["document_ids"] = torch.repeat_interleave(torch.arange(len(lens)), lens)[None]
        return cat

    return packed


def worker(args) -> None:
    """Train speculators' drafter on the plan; write its weights and, after checking its
    logits, the same drafter as an eyas training directory."""
    import torch
    from speculators.losses import resolve_loss_config
    from speculators.train.optimizers import build_optimizers

    cpu_muon()
    plan = json.loads(Path(args.plan).read_text())
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(42 + args.seed)  # the peer's CLI seed, moved by the comparison's seed
    lrs = plan["lrs"] if args.schedule == "eyas" else own_schedule(len(plan["lrs"]))
    norms = args.peer_norms == "on"
    if args.kind == "eagle3":
        model = peer_eagle3(plan["model"], plan["draft_ids"], plan["aux_layers_hf"],
                            plan["ttt_steps"], norms)  # fmt: skip
        kw = {"ttt_steps": plan["ttt_steps"], "ttt_step_loss_decay": 1.0,
              "loss_config": resolve_loss_config("kl_div", "eager")}  # fmt: skip
    else:
        model, kw = peer_block(plan, args.kind)
    opt_cfg = argparse.Namespace(optimizer=args.peer_optimizer, lr=lrs[0], weight_decay=0.01,
                                 muon_lr=lrs[0], muon_momentum=0.95, muon_weight_decay=0.1,
                                 muon_ns_steps=5, muon_adjust_lr_fn="match_rms_adamw")  # fmt: skip
    opts = build_optimizers(model, opt_cfg)
    packed = packer(Path(plan["run"]), shifted=args.kind == "eagle3")
    start = resume_peer(out, model, opts)
    step, t0, tokens = 0, time.monotonic(), 0
    stop = []  # SIGTERM: save after the step under way and exit 75, as eyas train does
    signal.signal(signal.SIGTERM, lambda *_: stop.append(True))
    log = open(out / "metrics.jsonl", "a" if start else "w")
    for epoch, batches in enumerate(plan["epochs"]):
        for idx in batches:
            if step < start:  # done before the worker was stopped
                step += 1
                continue
            for o in opts:
                for g in o.param_groups:
                    g["lr"] = lrs[step]
            batch = packed(idx)
            _, loss, metrics = model(**batch, **kw)
            for o in opts:
                o.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            for o in opts:
                o.step()
            step += 1
            tokens += batch["input_ids"].shape[1]
            acc = accuracies(metrics, args.kind, plan["ttt_steps"])
            loss_value = float(loss.detach())
            log.write(
                json.dumps({"step": step, "epoch": epoch, "loss": loss_value, "acc": acc}) + "\n"
            )
            if (stop or step % args.save_every == 0) and step < len(plan["lrs"]):
                log.flush()
                save_peer(out, model, opts, step)
                if stop:
                    print(f"peer: stopped by SIGTERM after step {step}; saved, a rerun resumes", flush=True)  # fmt: skip
                    raise SystemExit(75)
            if step % 10 == 0:
                log.flush()
                print(f"peer: step {step}/{len(plan['lrs'])} loss {loss_value:.3f} acc0 {acc[0]:.3f} "
                      f"{tokens / (time.monotonic() - t0):.0f} tok/s", flush=True)  # fmt: skip
    log.close()
    model.eval()
    from safetensors.torch import save_file

    save_file(
        {k: v.contiguous() for k, v in model.state_dict().items()},
        str(out / "speculators.safetensors"),
    )
    if args.kind == "eagle3":
        _to_eyas(model, packed, plan, norms, out, Path(args.eyas_train))
    else:
        _block_export(model, plan, out)
    print(f"peer: trained {step} steps in {time.monotonic() - t0:.0f} s "
          f"({tokens / (time.monotonic() - t0):.0f} tok/s)", flush=True)  # fmt: skip


def save_peer(out: Path, model, opts, step: int) -> None:
    """The peer's training state after `step` steps, written whole or not at all."""
    import os

    import torch

    tmp = out / "resume.pt.tmp"
    with open(tmp, "wb") as f:
        torch.save({"step": step, "model": model.state_dict(), "rng": torch.get_rng_state(),
                    "opts": [o.state_dict() for o in opts]}, f)  # fmt: skip
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, out / "resume.pt")


def resume_peer(out: Path, model, opts) -> int:
    """The steps a stopped peer training had done (0: none saved), its state (weights,
    optimizers, random generator) restored; the metrics it logged after that save are cut
    off."""
    import torch

    saved = out / "resume.pt"
    if not saved.is_file():
        return 0
    state = torch.load(saved, weights_only=False)
    model.load_state_dict(state["model"])
    for o, st in zip(opts, state["opts"], strict=True):
        o.load_state_dict(st)
    torch.set_rng_state(state["rng"])  # the anchors it draws next, as unbroken
    step = state["step"]
    log = out / "metrics.jsonl"
    kept = [ln for ln in log.read_text().splitlines() if json.loads(ln)["step"] <= step]
    log.write_text("".join(ln + "\n" for ln in kept))
    print(f"peer: resumed after step {step} ({saved})", flush=True)
    return step


def accuracies(metrics: dict, kind: str, ttt_steps: int) -> list[float]:
    """The peer's training accuracy per TTT step (EAGLE-3) or per predicting block
    position (its metrics name every position of the block; the anchor's, where it holds
    the verified token, has none)."""
    if kind == "eagle3":
        names = [f"full_acc_{i}" for i in range(ttt_steps)]
    else:
        names = sorted((k[: -len("_sum")] for k in metrics if k.startswith("position_") and k.endswith("_acc_sum")),
                       key=lambda k: int(k.split("_")[1]))  # fmt: skip
    return [float(metrics[f"{n}_sum"] / metrics[f"{n}_total"].clamp(min=1)) for n in names]


def _block_export(model, plan: dict, out: Path) -> None:
    """The peer's block drafter as its own `save_pretrained` writes it (speculators' format,
    which vLLM serves and eyas evaluates; the target's embedding table, left out of the file,
    eyas reads from the target). Written to OUT/export; OUT/export.done marks it whole."""
    import shutil

    dest = out / "export"
    shutil.rmtree(dest, ignore_errors=True)
    model.save_pretrained(str(dest))
    (out / "export.done").write_text("")


def _to_eyas(model, packed, plan: dict, norms: bool, out: Path, eyas_train: Path) -> None:
    """The peer's weights in eyas's drafter; its logits checked against speculators' on a
    held-out batch at every TTT step; written as a finished eyas training directory."""
    import shutil

    import torch

    from eyas.drafters.eagle3.model import Drafter, DrafterConfig
    from eyas.targets.target import text_config
    from eyas.training.checkpoint import save_final

    c = DrafterConfig.from_target(text_config(plan["model"]), len(plan["draft_ids"]),
                                  norm_before_fc=norms, norm_before_residual=norms, norm_output=norms)  # fmt: skip
    d = Drafter(c)
    state = {}
    for k, v in model.state_dict().items():
        if k.startswith(("verifier_", "rotary_emb")):
            continue
        state[k.replace("layers.0.", "midlayer.")] = v
    missing, unexpected = d.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise SystemExit(f"peer -> eyas: missing {missing}, unexpected {unexpected}")
    d.eval()
    # Both drafters on one held-out sample: speculators' logits per TTT step by a hook.
    batch = packed(plan["val"][0][:1])
    seen = []
    hook = model.lm_head.register_forward_hook(lambda _m, _i, o: seen.append(o.detach()))
    with torch.no_grad():
        model(**{k: v for k, v in batch.items() if k not in ("verifier_last_hidden_states", "loss_mask")},
              ttt_steps=plan["ttt_steps"])  # fmt: skip
        hook.remove()
        n = batch["input_ids"].shape[1]
        ids = torch.cat([batch["input_ids"][:, :1] * 0, batch["input_ids"]], 1)  # x_0 unused
        aux = torch.cat([batch["hidden_states"], batch["hidden_states"][:, -1:]], 1)
        mine = d.forward_ttt(ids, aux, plan["ttt_steps"])
    worst = 0.0
    for i, (logits, _) in enumerate(mine):
        a, b = seen[i][0, : n - i], logits[0, : n - i]
        worst = max(worst, float((a - b).abs().max() / a.abs().max()))
    print(
        f"peer -> eyas: logits agree to {worst:.2e} (largest difference over the largest logit)",
        flush=True,
    )
    if worst > 1e-3:
        raise SystemExit("peer -> eyas: the moved weights do not give speculators' logits")
    dest = out / "eyas-train"
    shutil.rmtree(dest, ignore_errors=True)
    dest.mkdir(parents=True)
    shutil.copy(eyas_train / "train.json", dest / "train.json")
    save_final(dest, d.float())


# ------------------------------------------------------------------ the comparison


class Job:
    """One training in its own process on one CPU thread; done when `done` exists."""

    def __init__(self, name: str, cmd: list[str], done: Path, log: Path, env: dict, after: Path | None = None):  # fmt: skip
        self.name, self.cmd, self.done, self.log, self.env, self.after = (
            name,
            cmd,
            done,
            log,
            env,
            after,
        )
        self.proc = None

    def ready(self) -> bool:
        return self.after is None or self.after.exists()


def run_jobs(jobs: list[Job], at_once: int) -> None:
    """Every job not yet done, `at_once` at a time, each once what it waits for exists."""
    t0 = time.monotonic()
    todo = [j for j in jobs if not j.done.exists()]
    running: list[Job] = []
    while todo or running:
        for j in [j for j in todo if j.ready()][: max(0, at_once - len(running))]:
            todo.remove(j)
            j.log.parent.mkdir(parents=True, exist_ok=True)
            print(f"[{time.monotonic() - t0:.0f} s] start {j.name} (log {j.log})", flush=True)
            j.proc = subprocess.Popen(
                j.cmd, stdout=open(j.log, "a"), stderr=subprocess.STDOUT, env=j.env
            )
            running.append(j)
        for j in list(running):
            if j.proc.poll() is not None:
                running.remove(j)
                ok = j.proc.returncode == 0 and j.done.exists()
                print(f"[{time.monotonic() - t0:.0f} s] {j.name}: {'done' if ok else f'FAILED (exit {j.proc.returncode}), see {j.log}'}",
                      flush=True)  # fmt: skip
        if todo and not running and not any(j.ready() for j in todo):
            raise SystemExit(
                f"nothing can start: {', '.join(j.name for j in todo)} wait for files no job makes"
            )
        time.sleep(2)


def eyas_job(run: Path, out: Path, options: str, seed: int) -> Job:
    cmd = [sys.executable, "-m", "eyas.cli", "train", "--data", str(run), "--out", str(out),
           "--epochs", "3", "--seed", str(seed), *shlex.split(options)]  # fmt: skip
    if (out / "train.json").is_file():
        cmd.append("--resume")
    # A fine-tune (--init-from a training of this comparison) starts once that one has ended.
    words = shlex.split(options)
    start = Path(words[words.index("--init-from") + 1]) if "--init-from" in words[:-1] else None
    is_export = start is not None and (start / "eyas-manifest.json").exists()
    after = start / "drafter.manifest.json" if start is not None and not is_export else None
    return Job(
        f"eyas {out.name}",
        cmd,
        out / "drafter.manifest.json",
        out.with_suffix(".log"),
        one_thread(),
        after=after,
    )


def peer_job(py: Path, run: Path, base: Path, out: Path, config: str, seed: int) -> Job:
    """The peer trained on the batch plan of eyas's training `base` (its split, batches and
    schedule), once `base` has written its train.json."""
    kind, optimizer, norms, schedule = PEER_CONFIGS[config]
    plan = out.with_name(out.name + ".plan.json")
    cmd = [sys.executable, __file__, "plan", "--run", str(run), "--eyas-train", str(base), "--out", str(plan),
           "&&", str(py), __file__, "worker", "--plan", str(plan), "--out", str(out), "--eyas-train", str(base),
           "--kind", kind, "--peer-optimizer", optimizer, "--peer-norms", norms, "--schedule", schedule,
           "--seed", str(seed)]  # fmt: skip
    shell = ["bash", "-c", " ".join(c if c == "&&" else shlex.quote(c) for c in cmd)]
    done = out / "eyas-train" / "drafter.manifest.json" if kind == "eagle3" else out / "export.done"
    return Job(f"peer {out.name}", shell, done, out.with_suffix(".log"), one_thread(),
               after=base / "train.json")  # fmt: skip


# name -> (kind, optimizer, normalisations, schedule): the peer as its CLI builds it, at eyas's
# schedule (eyas's lr for both optimizers, warm-up and cosine) or at its own defaults
# (speculators 0.9.0's TrainConfig: lr 1e-3 for AdamW and Muon alike, a linear schedule with
# 1% warm-up down to zero); both with its step decay 1.0, grad clip 1.0 and weight decays.
# The block kinds at eyas's default shape (2 layers, blocks of 4; the peer's CLI would give 5
# layers and blocks of 16 or 8), with the loss its CLI gives each kind and its 512 anchors.
PEER_CONFIGS = {"peer-eyas-schedule": ("eagle3", "muon", "on", "eyas"),
                "peer-own-defaults": ("eagle3", "muon", "on", "own"),
                "peer-adamw": ("eagle3", "adamw", "on", "eyas"),
                "peer-no-norms": ("eagle3", "muon", "off", "eyas"),
                "peer-dflash": ("dflash", "muon", "on", "eyas"),
                "peer-dspark": ("dspark", "muon", "on", "eyas")}  # fmt: skip


def eyas_base(confs: dict[str, str], kind: str) -> str:
    """The eyas configuration whose batch plan a peer of `kind` replays: the first of that
    kind, else the first."""
    for name, options in confs.items():
        words = shlex.split(options)
        mine = words[words.index("--kind") + 1] if "--kind" in words[:-1] else "eagle3"
        if mine == kind:
            return name
    return next(iter(confs))


def own_schedule(total: int, lr: float = 1e-3) -> list[float]:
    """speculators 0.9.0's default schedule: linear warm-up over 1% of the steps (from 0, as
    transformers' linear schedule starts), then linear down to 0 at the last step."""
    warm = total // 100
    return [lr * (s / max(1, warm) if s < warm else max(0.0, (total - s) / max(1, total - warm)))
            for s in range(total)]  # fmt: skip


def judge_all(args, real: Path, run: Path, exports: dict[str, Path], trainings: dict[str, Path],
              plan: dict, cache: Path) -> dict:  # fmt: skip
    """Every export's validation accuracy on the run's held-out samples (and --holdout's),
    then all of them on the same MT-Bench prompts, cut into --jobs slices judged at once
    (bench/judging.py: greedy decoding kept in REAL/greedy); each result kept in `cache`
    so a rerun judges only what is new."""
    from judging import judge
    from recipe import holdout_accuracy

    cache.mkdir(parents=True, exist_ok=True)
    out, todo = {}, {}
    for name, ex in exports.items():
        f = cache / f"{name}.json"
        if f.is_file():
            out[name] = json.loads(f.read_text())
            continue
        t0 = time.monotonic()
        val = val_accuracy(ex, run, plan)
        hold = None  # (an eyas training's; the peer's block drafters have none)
        if args.holdout and name in trainings:
            hold = holdout_accuracy(trainings[name], args.holdout, 3)
        rec = {"val": val, "holdout": hold, "seconds": round(time.monotonic() - t0)}
        print(f"{name}: val accuracy {' '.join(f'{a:.3f}' for a in val['acc'])}, est. acceptance "
              f"{val['accept_len'][-1]:.3f}" + (f", held-out {hold['accept_len'][-1]:.3f}" if hold else ""),
              flush=True)  # fmt: skip
        if not args.prompts:  # the validation screen alone
            f.with_name(f"{name}.val.json").write_text(json.dumps(rec))
            out[name] = rec
            continue
        todo[name] = rec
    if not todo:
        return out
    t0 = time.monotonic()
    print(f"judging {', '.join(todo)} on {args.prompts} MT-Bench prompts, {args.jobs} slices at once",
          flush=True)  # fmt: skip
    judged = judge(str(real / "model"), {n: str(exports[n]) for n in todo}, real / "mtbench.jsonl",
                   cache / ("slices-finished" if args.judge_finished else "slices"), jobs=args.jobs, k=args.k, max_new_tokens=args.max_new_tokens,
                   limit=args.prompts, greedy_store=real / "greedy")  # fmt: skip
    for name, r in judged.items():
        if r.stopped_by:
            raise SystemExit(f"judging {name} was stopped by {r.stopped_by}; nothing kept")
        d = r.to_dict()
        rec = {**todo[name], "mtbench": d, "per_prompt": r.per_prompt,
               "seconds": todo[name]["seconds"] + round(time.monotonic() - t0)}  # fmt: skip
        (cache / f"{name}.json").write_text(json.dumps(rec))
        out[name] = rec
        print(f"{name}: tokens/forward {d['tokens_per_forward']} {d['tokens_per_forward_ci95']}, per position "
              f"{d['per_position_acceptance']}, lossless {d['lossless']}", flush=True)  # fmt: skip
    return out


def tpf(rows) -> float:
    import numpy as np

    a = np.asarray(rows, dtype=float)
    return float(a[..., 2].sum(-1) / a[..., 0].sum(-1))


def paired_over_seeds(
    mine: list, theirs: list, n: int = 4000, seed: int = 0
) -> tuple[float, list[float]]:
    """Mean over seeds of tokens per forward, mine minus theirs, with a 95% bootstrap interval
    over prompts (the same prompts resampled for every seed and both sides)."""
    import numpy as np

    x = np.array(mine, dtype=float)  # (seeds, prompts, 3)
    y = np.array(theirs, dtype=float)
    idx = np.random.default_rng(seed).integers(0, x.shape[1], (n, x.shape[1]))

    def mean_tpf(a):  # (seeds, prompts, 3) -> (n,)
        s = a[:, idx]  # (seeds, n, prompts, 3)
        return (s[..., 2].sum(-1) / s[..., 0].sum(-1)).mean(0)

    diff = mean_tpf(x) - mean_tpf(y)
    point = float(np.mean([tpf(r) for r in x]) - np.mean([tpf(r) for r in y]))
    return point, [float(v) for v in np.percentile(diff, [2.5, 97.5])]


def table(size: str, results: dict, rows: dict[str, list[str]], anchor: str) -> list[str]:
    """One table for one size (`size`: what the data was, in words): each configuration's mean
    over seeds, each seed, against the anchor (the better of the peer's configurations)."""
    lines = [f"\n{size}: MT-Bench first turns, tokens per target forward (mean over seeds; "
             f"paired against {anchor} over prompts and seeds)",
             f"{'configuration':<28} {'mean':>6}  {'per seed':<22} {'held-out est.':>13}  vs anchor"]  # fmt: skip
    base = [results[n]["per_prompt"] for n in rows[anchor]]
    for conf, names in rows.items():
        per = [tpf(results[n]["per_prompt"]) for n in names]
        hold = [results[n]["holdout"]["accept_len"][-1] for n in names if results[n].get("holdout")]
        mean = sum(per) / len(per)
        vs = ""
        if conf != anchor and len(names) == len(base):
            d, ci = paired_over_seeds([results[n]["per_prompt"] for n in names], base)
            vs = f"x{mean / (sum(tpf(b) for b in base) / len(base)):.3f}  {d:+.3f} [{ci[0]:+.3f}, {ci[1]:+.3f}]"
        held = f"{sum(hold) / len(hold):13.3f}" if hold else f"{'-':>13}"
        lines.append(
            f"{conf:<28} {mean:6.3f}  {' '.join(f'{x:.3f}' for x in per):<22} {held}  {vs}"
        )
    return lines


def val_table(size: int, n_val: int, results: dict, rows: dict[str, list[str]]) -> list[str]:
    """The validation screen (--prompts 0): est. acceptance per configuration, mean over
    seeds, on the run's held-out samples and (where judged) on every sample of --holdout,
    with the accuracy per TTT step there."""
    first = results[next(iter(rows.values()))[0]]
    hold = first.get("holdout")
    head = f"; --holdout: {hold['positions']:,} positions" if hold else ""
    lines = [f"\n{size} conversations: est. acceptance (k=3) on {n_val} held-out samples{head}",
             f"{'configuration':<28} {'mean':>6}  per seed" + ("   holdout  acc per step" if hold else "")]  # fmt: skip
    for conf, names in rows.items():
        per = [results[n]["val"]["accept_len"][-1] for n in names]
        line = f"{conf:<28} {sum(per) / len(per):6.3f}  {' '.join(f'{x:.3f}' for x in per)}"
        if hold:
            h = [results[n]["holdout"] for n in names]
            acc = [sum(x["acc"][i] for x in h) / len(h) for i in range(len(h[0]["acc"]))]
            line += f"   {sum(x['accept_len'][-1] for x in h) / len(h):7.3f}  " + " ".join(
                f"{a:.3f}" for a in acc
            )
        lines.append(line)
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="role")
    w = sub.add_parser("worker", help="(internal) the peer's training, in its environment")
    w.add_argument("--plan", required=True, help="the batch plan written by the comparison")
    w.add_argument("--out", required=True, help="where the peer's drafter goes")
    w.add_argument("--eyas-train", required=True, help="eyas's training directory (its train.json)")
    w.add_argument("--kind", default="eagle3", choices=("eagle3", "dflash", "dspark"))
    w.add_argument("--peer-optimizer", default="muon", choices=("muon", "adamw"))
    w.add_argument("--peer-norms", default="on", choices=("on", "off"))
    w.add_argument("--schedule", default="eyas", choices=("eyas", "own"))
    w.add_argument("--seed", type=int, default=0, help="added to the peer CLI's seed (42)")
    w.add_argument("--save-every", type=int, default=50,
                   help="steps between saves of the training, which a rerun resumes from")  # fmt: skip
    pl = sub.add_parser("plan", help="(internal) eyas's batch plan of a training, as JSON")
    pl.add_argument("--run", type=Path, required=True)
    pl.add_argument("--eyas-train", type=Path, required=True)
    pl.add_argument("--out", type=Path, required=True)
    ap.add_argument(
        "--real", type=Path, help="scripts/real_target.py's --out: the target, ShareGPT, MT-Bench"
    )
    ap.add_argument("--work", type=Path, help="where the data, trainings and exports go")
    ap.add_argument("--conversations", default="300",
                    help="comma-separated sizes: the first N ShareGPT conversations of each (default 300)")  # fmt: skip
    ap.add_argument(
        "--run",
        type=Path,
        default=None,
        help="an eyas extraction to use instead of --conversations",
    )
    ap.add_argument(
        "--seeds", default="0", help="comma-separated seeds (eyas's --seed; the peer's 42 + seed)"
    )
    ap.add_argument("--eyas", action="append", default=[],
                    help="NAME=OPTIONS: an eyas configuration (eyas train options; repeat). "
                         "Default: eyas= (eyas as it is); the first one's batch plan is the peer's")  # fmt: skip
    ap.add_argument("--peer", default="peer-eyas-schedule,peer-own-defaults",
                    help=f"the peer's configurations, of {', '.join(PEER_CONFIGS)}; the better is the anchor")  # fmt: skip
    ap.add_argument("--holdout", type=Path, default=None,
                    help="an extraction of other conversations: every drafter's accuracy on all of it too")  # fmt: skip
    ap.add_argument("--holdout-conversations", type=int, default=0,
                    help="as --holdout: this many ShareGPT conversations after the largest size's, "
                         "prepared and extracted alike")  # fmt: skip
    ap.add_argument("--jobs", type=int, default=2,
                    help="trainings at once, and slices of MT-Bench judged at once; one CPU thread each")  # fmt: skip
    ap.add_argument("--train-only", action="store_true", help="train everything, judge nothing")
    ap.add_argument("--judge-finished", action="store_true",
                    help="train nothing: judge the trainings that have finished (beside a call "
                         "still training the rest; judge with --jobs 1 there)")  # fmt: skip
    ap.add_argument("--max-length", type=int, default=448, help="prepare --max-length")
    ap.add_argument("--draft-vocab", type=int, default=32000,
                    help="prepare --draft-vocab-size (32,000: eyas's default, what users get; the "
                    "runs before 2026-12-07 used 8,192)")  # fmt: skip
    ap.add_argument("--venv", type=Path, default=Path("/tmp/eyas-peer-venv"),
                    help="the peer's virtual environment (made on first use)")  # fmt: skip
    ap.add_argument(
        "--prompts",
        type=int,
        default=80,
        help="MT-Bench first turns to judge on (0: the validation screen alone)",
    )
    ap.add_argument("--max-new-tokens", type=int, default=128, help="tokens per reply")
    ap.add_argument("--k", type=int, default=3, help="drafts per round")
    args = ap.parse_args()
    if args.role == "worker":
        return worker(args)
    if args.role == "plan":
        args.out.write_text(json.dumps(batch_plan(args.run, args.eyas_train)))
        return None
    if not (args.real and args.work):
        ap.error("--real and --work are needed")
    py = None
    if [p for p in args.peer.split(",") if p]:
        try:
            py = ensure_venv(args.venv)
        except Skip as exc:
            print(f"skipped: {exc}")
            return None
    from eyas.run.runmeta import read_run_meta
    from eyas.stages.config import ExportConfig
    from eyas.stages.export import export

    eyas_confs = dict(e.split("=", 1) for e in (args.eyas or ["eyas="]))
    peers = [p for p in args.peer.split(",") if p]
    unknown = [p for p in peers if p not in PEER_CONFIGS]
    if unknown:
        ap.error(f"unknown peer configuration(s) {unknown}; known: {', '.join(PEER_CONFIGS)}")
    seeds = [int(s) for s in args.seeds.split(",")]
    sizes = [int(n) for n in args.conversations.split(",")] if args.run is None else [0]
    if args.holdout_conversations:
        if args.holdout or args.run:
            ap.error(
                "--holdout-conversations goes with --conversations, without --holdout or --run"
            )
        args.holdout = build_run(args.real, args.holdout_conversations, args.work / "data",
                                 args.max_length, args.draft_vocab, skip=max(sizes))  # fmt: skip
    report = []
    for size in sizes:
        run = args.run or build_run(
            args.real, size, args.work / "data", args.max_length, args.draft_vocab
        )
        wn = args.work / (f"n{size}" if size else run.parent.name)
        first = next(iter(eyas_confs))
        jobs = {}  # "name-sS" -> its training
        for seed in seeds:
            for name, options in eyas_confs.items():
                jobs[f"{name}-s{seed}"] = eyas_job(run, wn / f"{name}-s{seed}", options, seed)
            for conf in peers:
                base = wn / f"{eyas_base(eyas_confs, PEER_CONFIGS[conf][0])}-s{seed}"
                jobs[f"{conf}-s{seed}"] = peer_job(
                    py, run, base, wn / f"{conf}-s{seed}", conf, seed
                )
        if not args.judge_finished:
            run_jobs(list(jobs.values()), args.jobs)
        if args.train_only:
            continue
        ready = {n for n, j in jobs.items() if j.done.exists()}
        trainings = {f"{n}-s{s}": wn / f"{n}-s{s}" for n in eyas_confs for s in seeds}
        trainings |= {f"{c}-s{s}": wn / f"{c}-s{s}" / "eyas-train" for c in peers for s in seeds
                      if PEER_CONFIGS[c][0] == "eagle3"}  # fmt: skip
        exports = {f"{c}-s{s}": wn / f"{c}-s{s}" / "export" for c in peers for s in seeds
                   if PEER_CONFIGS[c][0] != "eagle3"}  # the peer's own files  # fmt: skip
        if args.judge_finished:
            waiting = sorted(set(jobs) - ready)
            print(f"{size} conversations: judging the finished {', '.join(sorted(ready)) or 'none'}; "
                  f"not finished: {', '.join(waiting) or 'none'}", flush=True)  # fmt: skip
            trainings = {n: t for n, t in trainings.items() if n in ready}
            exports = {n: e for n, e in exports.items() if n in ready}
            if not ready:
                continue
        for name, tdir in trainings.items():
            dest = wn / f"export-{name}"
            if not (dest / "eyas-manifest.json").is_file():
                cfg = json.loads((tdir / "train.json").read_text())["config"]
                fmt = "sglang" if cfg.get("serve_with") == "sglang" else "vllm"  # a draft window
                export(ExportConfig(train_dir=str(tdir), format=fmt, out=str(dest), force=True))
            exports[name] = dest
        plan = batch_plan(run, wn / f"{first}-s{seeds[0]}")
        results = judge_all(args, args.real, run, exports, trainings, plan, wn / "judged")
        if args.judge_finished:
            continue  # the table waits for every training
        rows = {c: [f"{c}-s{s}" for s in seeds] for c in [*eyas_confs, *peers]}
        if not args.prompts:
            report += val_table(size, sum(len(b) for b in plan["val"]), results, rows)
            continue
        means = {c: sum(tpf(results[n]["per_prompt"]) for n in rows[c]) / len(seeds) for c in peers}
        anchor = max(means, key=means.get) if means else next(iter(eyas_confs))  # no peer run
        what = (
            f"{size} conversations" if size else f"{run} ({read_run_meta(run)['samples']} samples)"
        )
        report += table(what, results, rows, anchor)
        (wn / "result.json").write_text(json.dumps({"anchor": anchor, "rows": rows, "seeds": seeds,
                                                    "results": {n: {k: v for k, v in r.items() if k != "per_prompt"}
                                                                for n, r in results.items()}}, indent=1))  # fmt: skip
    print("\n".join(report))
    return None


if __name__ == "__main__":
    main()
