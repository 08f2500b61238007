"""eyas against the peer users would pick instead: vLLM's speculators 0.9, same data.

    python bench/peer.py --run RUN --real REAL --work WORK [--eyas-train DIR] [--prompts 80]

On one eyas extraction (RUN), this trains two EAGLE-3 drafters and judges them together:

- **eyas**: `eyas train --ttt-steps 3 --epochs 3` with what eyas chooses (or `--eyas-train`, a
  finished training directory of RUN, reused as it is).
- **the peer**: speculators 0.9's own `Eagle3DraftModel` as its CLI builds it (Muon with AdamW,
  `norm_before_fc`, `norm_before_residual`, `norm_output`, the target's head frozen), its KL
  loss, TTT alignment, packed collation and grad clip, in a virtual environment of its own
  (`--venv`; made on first use from the package registry; on a CPU its Muon orthogonalises
  in float32, as eyas's does, not torch's bfloat16). It trains on the same samples,
  with eyas's train/validation split, batch plan (batch by batch), learning rate, warm-up
  and cosine schedule, for the same epochs; the target's stored last state is post-norm, so
  the peer's verifier norm is set to the identity. Its weights are then moved into eyas's
  drafter, checked against speculators' own logits, and exported by eyas.
- **one judge**: validation accuracy per TTT step of both with eyas's metric on the same
  held-out samples, then `eyas evaluate` (hf) on MT-Bench's first turns, K drafts, greedy,
  both drafters in one process (greedy decoding shared), with a paired interval over prompts.

It prints both figures and eyas / peer. A benchmark, not a test; where speculators cannot be
installed it says why and exits 0 without figures. `--peer-optimizer adamw` and
`--peer-norms off` give the peer's variants (its model with eyas's optimizer or eyas's
normalisation); `--eyas-args` passes options to eyas's training.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

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

    from eyas.data.prepare import PrepareConfig, prepare
    from eyas.extract import ExtractConfig, extract
    from eyas.run.runmeta import read_run_meta

    w = work / (f"n{n}" if not skip else f"n{n}-from{skip}")
    run = w / "run"
    if (run / "run.json").is_file() and (w / "extracted").is_file():
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


def train_eyas(run: Path, out: Path, extra: list[str]) -> Path:
    if (out / "drafter.manifest.json").is_file():
        print(f"eyas: reusing the finished training in {out}", flush=True)
        return out
    cmd = [sys.executable, "-m", "eyas.cli", "train", "--data", str(run), "--out", str(out),
           "--ttt-steps", "3", "--epochs", "3", *extra]  # fmt: skip
    resume = ["--resume"] if (out / "train.json").is_file() else []
    t0 = time.monotonic()
    r = subprocess.run(cmd + resume)
    if r.returncode != 0:
        raise SystemExit(f"eyas train failed (exit {r.returncode}): {shlex.join(cmd)}")
    print(f"eyas: trained in {time.monotonic() - t0:.0f} s", flush=True)
    return out


def batch_plan(run: Path, train_dir: Path) -> dict:
    """eyas's training of `train_dir`, batch by batch: samples, split, lr per step."""
    from eyas.data.prepare import PreparedDataset
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
    return {"run": str(run), "model": meta["model_path"], "aux_layers_hf": meta["aux_layers_hf"],
            "epochs": epochs, "val": plan_batches(lengths, val_idx, cfg["batch_tokens"]),
            "lrs": lrs, "ttt_steps": cfg["ttt_steps"], "draft_ids": draft_ids, "eyas": cfg}  # fmt: skip


def val_accuracy(drafter, run: Path, plan: dict) -> dict:
    """eyas's validation summary of `drafter` over the plan's held-out batches."""
    import torch

    from eyas.run.runmeta import read_run_meta
    from eyas.targets.weights import lm_head_weight
    from eyas.training.loss import add_targets, summarize, ttt_loss
    from eyas.training.train_data import SampleReader, to_device, usable_samples

    meta = read_run_meta(run)
    entries, _ = usable_samples(run, meta["hidden_size"], lambda m: None)
    reader = SampleReader(run, entries, checksums=True)
    head = lm_head_weight(plan["model"]).float()
    stats = torch.zeros(plan["ttt_steps"], 6, dtype=torch.float64)
    drafter.eval()
    try:
        with torch.no_grad():
            for idx in plan["val"]:
                host = reader.batch(idx)
                b = to_device(host, torch.device("cpu"))
                reader.release(host)
                add_targets(b, drafter, head)
                stats += ttt_loss(drafter, b, plan["ttt_steps"], 0.8)[1]
    finally:
        reader.close()
    return summarize(stats)


# ------------------------------------------------------------------ the peer's side (its venv)


def worker(args) -> None:
    """Train speculators' drafter on the plan; write its weights and, after checking its
    logits, the same drafter as an eyas training directory."""
    import torch
    from speculators.losses import resolve_loss_config
    from speculators.models.eagle3 import Eagle3DraftModel
    from speculators.models.eagle3.data import shift_batch
    from speculators.train.cli import create_transformer_layer_config
    from speculators.train.optimizers import build_optimizers
    from transformers import AutoConfig

    from eyas.run.runmeta import read_run_meta
    from eyas.training.train_data import SampleReader, to_device, usable_samples

    # torch's Muon orthogonalises in bfloat16, which a CPU without fast bfloat16 runs about
    # 50x slower than the rest of a step; on a CPU the peer's Muon runs the same iteration
    # in float32, as eyas's does (on a GPU both keep bfloat16).
    if not torch.cuda.is_available():
        import torch.optim._muon as torch_muon

        from eyas.training.muon import orthogonalise

        torch_muon._zeropower_via_newtonschulz = lambda g, _coeffs, steps, eps: orthogonalise(
            g, steps, eps
        )
    plan = json.loads(Path(args.plan).read_text())
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(42)  # the peer's CLI seed
    run, model_dir = Path(plan["run"]), plan["model"]
    vcfg = AutoConfig.from_pretrained(model_dir)
    draft_ids = torch.tensor(plan["draft_ids"])
    t2d = torch.zeros(vcfg.vocab_size, dtype=torch.bool)
    t2d[draft_ids] = True
    d2t = draft_ids - torch.arange(len(draft_ids))
    norms = args.peer_norms == "on"
    # The draft's decoder config as the peer's CLI makes it by default: one llama layer, its
    # attention in a sliding window of 2,048 (wider than any sample here).
    layer_cfg = create_transformer_layer_config(model_dir, num_layers=1, draft_arch="llama",
                                                hidden_act=None, sliding_window=2048,
                                                full_attention_indices=[])  # fmt: skip
    model = Eagle3DraftModel.from_training_args(
        layer_cfg, t2d=t2d, d2t=d2t, draft_vocab_size=len(draft_ids), norm_before_residual=norms,
        norm_before_fc=norms, norm_output=norms, ttt_steps=plan["ttt_steps"],
        verifier_name_or_path=model_dir, target_layer_ids=plan["aux_layers_hf"],
        draft_attn_impl="sdpa",
    )  # fmt: skip
    model.verifier_norm = torch.nn.Identity()  # eyas stores the target's post-norm last state
    model.float().train()
    opt_cfg = argparse.Namespace(optimizer=args.peer_optimizer, lr=plan["lrs"][0], weight_decay=0.01,
                                 muon_lr=plan["lrs"][0], muon_momentum=0.95, muon_weight_decay=0.1,
                                 muon_ns_steps=5, muon_adjust_lr_fn="match_rms_adamw")  # fmt: skip
    opts = build_optimizers(model, opt_cfg)
    loss_cfg = resolve_loss_config("kl_div", "eager")
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
            parts.append(shift_batch({
                "input_ids": b["input_ids"][r, :n], "hidden_states": b["aux"][r, :n],
                "verifier_last_hidden_states": b["last"][r, :n], "loss_mask": b["loss_mask"][r, :n],
                "lengths": torch.tensor([n]), "position_ids": torch.arange(n)}))  # fmt: skip
        cat = {k: torch.cat([p[k] for p in parts])[None] for k in parts[0] if k != "lengths"}
        lens = torch.cat([p["lengths"] for p in parts])
        cat["document_ids"] = torch.repeat_interleave(torch.arange(len(lens)), lens)[None]
        return cat

    kw = {"ttt_steps": plan["ttt_steps"], "ttt_step_loss_decay": 1.0, "loss_config": loss_cfg}
    step, t0, tokens = 0, time.monotonic(), 0
    log = open(out / "metrics.jsonl", "w")
    for epoch, batches in enumerate(plan["epochs"]):
        for idx in batches:
            for o in opts:
                for g in o.param_groups:
                    g["lr"] = plan["lrs"][step]
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
            acc = [float(metrics[f"full_acc_{i}_sum"] / metrics[f"full_acc_{i}_total"].clamp(min=1))
                   for i in range(plan["ttt_steps"])]  # fmt: skip
            log.write(
                json.dumps({"step": step, "epoch": epoch, "loss": float(loss), "acc": acc}) + "\n"
            )
            if step % 10 == 0:
                log.flush()
                print(f"peer: step {step}/{len(plan['lrs'])} loss {float(loss):.3f} acc0 {acc[0]:.3f} "
                      f"{tokens / (time.monotonic() - t0):.0f} tok/s", flush=True)  # fmt: skip
    log.close()
    model.eval()
    from safetensors.torch import save_file

    save_file(
        {k: v.contiguous() for k, v in model.state_dict().items()},
        str(out / "speculators.safetensors"),
    )
    _to_eyas(model, packed, plan, norms, out, Path(args.eyas_train))
    print(f"peer: trained {step} steps in {time.monotonic() - t0:.0f} s "
          f"({tokens / (time.monotonic() - t0):.0f} tok/s)", flush=True)  # fmt: skip


def _to_eyas(model, packed, plan: dict, norms: bool, out: Path, eyas_train: Path) -> None:
    """The peer's weights in eyas's drafter; its logits checked against speculators' on a
    held-out batch at every TTT step; written as a finished eyas training directory."""
    import shutil

    import torch

    from eyas.targets.target import text_config
    from eyas.training.checkpoint import save_final
    from eyas.training.drafter import Drafter, DrafterConfig

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


def judge(args, real: Path, drafters: dict[str, Path]) -> dict:
    """Both exports on the same prompts in one process, greedy decoding shared."""
    from eyas.evaluate import evaluate

    greedy: dict = {}
    out = {}
    for name, ex in drafters.items():
        t0 = time.monotonic()
        r = evaluate(str(real / "model"), str(ex), str(real / "mtbench.jsonl"), k=args.k,
                     max_new_tokens=args.max_new_tokens, limit=args.prompts, precision=None,
                     progress=False, greedy_cache=greedy)  # fmt: skip
        out[name] = r
        d = r.to_dict()
        print(f"{name}: tokens/forward {d['tokens_per_forward']} {d['tokens_per_forward_ci95']}, "
              f"per position {d['per_position_acceptance']}, lossless {d['lossless']}, "
              f"{time.monotonic() - t0:.0f} s", flush=True)  # fmt: skip
    return out


def paired(a, b, n: int = 4000, seed: int = 0) -> tuple[float, list[float], int]:
    """Tokens per forward of a minus b, with a 95% bootstrap interval over prompts resampled
    in pairs, and on how many prompts a is ahead."""
    import numpy as np

    x, y = np.array(a.per_prompt, dtype=float), np.array(b.per_prompt, dtype=float)
    idx = np.random.default_rng(seed).integers(0, len(x), (n, len(x)))
    diff = x[idx, 2].sum(1) / x[idx, 0].sum(1) - y[idx, 2].sum(1) / y[idx, 0].sum(1)
    ahead = int(((x[:, 2] / x[:, 0]) > (y[:, 2] / y[:, 0])).sum())
    return (
        a.tokens_per_forward - b.tokens_per_forward,
        [float(v) for v in np.percentile(diff, [2.5, 97.5])],
        ahead,
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="role")
    w = sub.add_parser("worker", help="(internal) the peer's training, in its environment")
    w.add_argument("--plan", required=True, help="the batch plan written by the comparison")
    w.add_argument("--out", required=True, help="where the peer's drafter goes")
    w.add_argument("--eyas-train", required=True, help="eyas's training directory (its train.json)")
    w.add_argument("--peer-optimizer", default="muon", choices=("muon", "adamw"))
    w.add_argument("--peer-norms", default="on", choices=("on", "off"))
    ap.add_argument("--run", type=Path, help="an eyas extraction run (verified)")
    ap.add_argument(
        "--real", type=Path, help="scripts/real_target.py's --out: the target and MT-Bench"
    )
    ap.add_argument("--work", type=Path, help="where the trainings and exports go")
    ap.add_argument("--eyas-train", type=Path, default=None,
                    help="a finished eyas training of --run to judge (default: train one in WORK/eyas)")  # fmt: skip
    ap.add_argument("--eyas-args", default="", help="more options for eyas train, as one string")
    ap.add_argument("--also", action="append", default=[],
                    help="NAME=TRAIN_DIR: another finished eyas training of --run, judged beside (repeat)")  # fmt: skip
    ap.add_argument("--venv", type=Path, default=Path("/tmp/eyas-peer-venv"),
                    help="the peer's virtual environment (made on first use)")  # fmt: skip
    ap.add_argument("--peer-optimizer", default="muon", choices=("muon", "adamw"),
                    help="the peer's optimizer (its CLI's default: muon)")  # fmt: skip
    ap.add_argument("--peer-norms", default="on", choices=("on", "off"),
                    help="the peer's three normalisations (its CLI's default: on)")  # fmt: skip
    ap.add_argument("--prompts", type=int, default=80, help="MT-Bench first turns to judge on")
    ap.add_argument("--max-new-tokens", type=int, default=128, help="tokens per reply")
    ap.add_argument("--k", type=int, default=3, help="drafts per round")
    ap.add_argument("--threads", type=int, default=None, help="CPU threads of the peer's training")
    args = ap.parse_args()
    if args.role == "worker":
        return worker(args)
    if not (args.run and args.real and args.work):
        ap.error("--run, --real and --work are needed")
    try:
        py = ensure_venv(args.venv)
    except Skip as exc:
        print(f"skipped: {exc}")
        return
    from eyas.export import export, load_export

    args.work.mkdir(parents=True, exist_ok=True)
    mine = args.eyas_train or train_eyas(args.run, args.work / "eyas", shlex.split(args.eyas_args))
    plan = batch_plan(args.run, mine)
    (args.work / "plan.json").write_text(json.dumps(plan))
    print(f"plan: {sum(len(e) for e in plan['epochs'])} steps over {len(plan['epochs'])} epochs, "
          f"lr {plan['eyas']['lr']}, batch {plan['eyas']['batch_tokens']} tokens, "
          f"{sum(len(b) for b in plan['val'])} held-out samples", flush=True)  # fmt: skip
    peer_dir = args.work / f"peer-{args.peer_optimizer}-norms-{args.peer_norms}"
    if not (peer_dir / "eyas-train" / "drafter.manifest.json").is_file():
        env = {**os.environ, "PYTHONPATH": str(REPO / "src")}
        if args.threads:
            env["EYAS_THREADS"] = env["OMP_NUM_THREADS"] = str(args.threads)
        cmd = [str(py), __file__, "worker", "--plan", str(args.work / "plan.json"), "--out", str(peer_dir),
               "--eyas-train", str(mine), "--peer-optimizer", args.peer_optimizer, "--peer-norms", args.peer_norms]  # fmt: skip
        if subprocess.run(cmd, env=env).returncode != 0:
            raise SystemExit("the peer's training failed (above)")
    exports = {}
    trainings = [("eyas", mine), ("peer", peer_dir / "eyas-train")]
    trainings += [(n, Path(d)) for n, d in (a.split("=", 1) for a in args.also)]
    for name, tdir in trainings:
        exports[name] = export(tdir, "vllm", args.work / f"export-{name}-{tdir.parent.name if name == 'peer' else tdir.name}",
                               force=True)  # fmt: skip
    val = {n: val_accuracy(load_export(e)[0], args.run, plan) for n, e in exports.items()}
    for n, v in val.items():
        print(f"{n}: validation acc per TTT step {[round(a, 3) for a in v['acc']]}, conditional "
              f"{[round(a, 3) for a in v['cond_acc']]}, est. acceptance {v['accept_len'][-1]:.3f}", flush=True)  # fmt: skip
    res = judge(args, args.real, exports)
    summary = {"val": val, **{n: r.to_dict() for n, r in res.items()}, "vs_peer": {}}
    p = res["peer"].tokens_per_forward
    print(
        "\nMT-Bench first turns, tokens per target forward (paired over prompts against the peer):"
    )
    for name in [n for n in res if n != "peer"]:
        d, ci, ahead = paired(res[name], res["peer"])
        e = res[name].tokens_per_forward
        summary["vs_peer"][name] = {"ratio": round(e / p, 4), "difference": round(d, 4),
                                    "ci95": [round(x, 4) for x in ci], "ahead_on": ahead}  # fmt: skip
        print(f"  {name}: {e:.3f} against the peer's {p:.3f}: x{e / p:.3f}, {d:+.3f} [{ci[0]:+.3f}, {ci[1]:+.3f}], "
              f"ahead on {ahead} of {len(res[name].per_prompt)} prompts", flush=True)  # fmt: skip
    (args.work / "result.json").write_text(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
