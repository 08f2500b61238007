"""Training speed: `eyas train`'s step against the peer's (speculators 0.9, built as
`bench/peer.py` builds it) on the same extraction and the same batches, kind by kind.

    python bench/train_speed.py --run RUN [--kinds eagle3,dflash,dspark] [--steps 6]
        [--pairs 3] [--profile] [--venv /tmp/eyas-peer-venv] [--json OUT]

The batches are the first `--steps` of eyas's first epoch over the run's training split
(`--batch-tokens`, 1,024 by default; eyas's defaults otherwise); the peer trains on the same samples
packed in one row, as its collation makes them. Each measurement is a process of its own
on one CPU thread (eyas's in this environment, the peer's in its own): two steps to warm up,
then the batches twice, as a first epoch and as a later one (eyas keeps the target's argmax
per sample after the first: `drafters.loss.TargetHead`; from a run whose samples hold it,
the hf backend's since 2026-12-07 (`argmax=1` in its layout, said in the table's title),
the first multiplies no more of the head than a later one). Its tokens/s is what a three-epoch
training sees, 3 x tokens / (first + 2 x later); its peak memory the process's high-water
RSS. eyas and the peer alternate, pair by pair (which goes first alternates too); the table
gives the median of each and the median of the pairs' ratios.

Like for like: each drafter at eyas's default shape for its kind (EAGLE-3: one layer, 3 TTT
steps; the block kinds: 2 layers, blocks of 4), Muon with AdamW for both (the peer's
iteration in float32 on a CPU, as eyas's), KL against the target over the same draft
vocabulary. A block drafter's blocks: eyas starts one at every trainable position by
default; the peer draws 512 anchors a row (its default). So that both train about as many
blocks a batch, eyas's block kinds run here with `--anchor-stride 2` (a block at every
second trainable position: ~450 of a 1,024-token batch), and the table gives blocks a
second beside tokens a second. (With an anchor at every position the peer's dense mask on a
CPU, (4T) x (5T) a head, takes minutes a step: its GPU path is flex attention.)

`--profile`: one more run of each, split into where a step's time goes (eyas: data, target
logits, forward and loss, backward, optimizer; the peer's forward holds its target logits
and loss). Figures from a shared, noisy CPU: compare ratios of the same run.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from judging import one_thread_env
from peer import PEER_ANCHORS

REPO = Path(__file__).resolve().parent.parent
WARM = 2


def plan(run: Path, steps: int, batch_tokens: int, device: str, stride: int) -> dict:
    """The samples of the first `steps` + warm-up batches, the draft vocabulary, the target."""
    from eyas.data.dataset import PreparedDataset
    from eyas.drafters.block_kind import choose_mask_token
    from eyas.run.runmeta import read_run_meta
    from eyas.training.train_data import epoch_batches, split_samples, usable_samples

    meta = read_run_meta(run)
    entries, _ = usable_samples(run, meta["hidden_size"], lambda m: None)
    train_idx, _ = split_samples(sorted(entries), 0.05)
    lengths = {i: e["tokens"] for i, e in entries.items()}
    batches = epoch_batches(lengths, train_idx, batch_tokens, 0, 0)[: WARM + steps]
    ds = PreparedDataset.open(meta["dataset_path"], check=False)
    return {"run": str(run), "model": meta["model_path"], "aux_layers_hf": meta["aux_layers_hf"],
            "batches": batches, "draft_ids": ds.draft_vocab(None).tolist(),
            "mask_token_id": choose_mask_token(meta["model_path"], ds.vocab_counts()),
            "batch_tokens": batch_tokens, "device": device, "anchor_stride": stride}  # fmt: skip


def peak_mb(device: str) -> float:
    """The process's peak memory: on a GPU torch's allocated peak, on a CPU the RSS's."""
    import torch

    if device == "cuda":
        return torch.cuda.max_memory_allocated() / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def setup(p: dict):
    """torch for a measurement on the plan's device: one thread on a CPU."""
    import torch

    if p["device"] == "cpu":
        torch.set_num_threads(1)
    return torch.device(p["device"])


def timed(step, batches: list, phases: dict | None) -> tuple[float, float, int]:
    """(first pass s, later pass s, tokens a pass) of `step` over `batches` after WARM."""
    for idx in batches[:WARM]:
        step(idx, None)
    out, tokens = [], 0
    for _ in range(2):
        sync()
        t0, tokens = time.monotonic(), 0
        for idx in batches[WARM:]:
            tokens += step(idx, phases)
        sync()
        out.append(time.monotonic() - t0)
    return out[0], out[1], tokens


def sync() -> None:
    """Wait for the GPU's queued work, where there is a GPU: a time is the work's, not its
    launch's."""
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


class Phases(dict):
    """Seconds per named part of a step, summed."""

    def lap(self, name: str, t0: float) -> float:
        sync()
        now = time.monotonic()
        self[name] = self.get(name, 0.0) + now - t0
        return now


# ------------------------------------------------------------------ eyas


def eyas_one(p: dict, kind: str, profile: bool) -> dict:
    import torch

    from eyas.drafters.block_drafter import choose_anchors
    from eyas.run.runmeta import read_run_meta
    from eyas.stages.train import _resolve_schedule
    from eyas.training.config import TrainConfig
    from eyas.training.train_data import SampleReader, usable_samples
    from eyas.training.trainer import Trainer

    device = setup(p)
    run = Path(p["run"])
    meta = read_run_meta(run)
    stride = p["anchor_stride"]  # 2: about the peer's 512 blocks a row
    own = {} if kind == "eagle3" else {"anchor_stride": stride}
    cfg = TrainConfig.of(data=str(run), out=tempfile.mkdtemp(), kind=kind, epochs=1,
                         batch_tokens=p["batch_tokens"], seed=0,
                         dtype="bfloat16" if device.type == "cuda" else "float32", **own)  # fmt: skip
    cfg = _resolve_schedule(cfg, meta, 1)
    entries, _ = usable_samples(run, meta["hidden_size"], lambda m: None)
    t = Trainer(cfg, meta, 0, 1, device, Path(cfg.out), SampleReader(run, entries, True))
    t.schedule(1000)
    blocks = []

    def step(idx, ph: Phases | None) -> int:
        if ph is None:  # the training loop as `eyas train` runs it
            b = t.load(idx)
            if kind != "eagle3":
                seg = [b["segments"]] if "segments" in b else []  # (an older eyas: padded rows)
                a = choose_anchors(b["valid"], b["valid"], stride, 0, *seg)  # every position
                blocks.append(int((a >= 0).sum()))
            return t.step(iter([(None, b)]), 1, cfg.lr)[1]
        t0 = time.monotonic()
        b = t.load(idx)
        b["_key"], b["loss_mask"] = 1, b["valid"].clone()
        t0 = ph.lap("data", t0)
        t.kind.prepare_batch(t.drafter, b, t.lm_head, cfg)  # the target's logits (and anchors)
        t0 = ph.lap("target logits", t0)
        if "anchors" in b:
            blocks.append(int((b["anchors"] >= 0).sum()))
        counts = t.kind.counts(b, cfg)
        with t.autocast:
            loss, _ = t.kind.loss(t.drafter, b, cfg, counts)
        t0 = ph.lap("forward and loss", t0)
        loss.backward()
        t0 = ph.lap("backward", t0)
        torch.nn.utils.clip_grad_norm_(t.params, cfg.grad_clip)
        t.opt.step()
        t.opt.zero_grad(set_to_none=True)
        ph.lap("optimizer", t0)
        t._done(b)
        return int(b["valid"].sum())

    ph = Phases() if profile else None
    first, later, tokens = timed(step, p["batches"], ph)
    return {"first_s": first, "later_s": later, "tokens": tokens, "peak_mb": peak_mb(p["device"]),
            "phases": ph, "blocks": sum(blocks[-len(p["batches"]) + WARM :]) if blocks else None}  # fmt: skip


# ------------------------------------------------------------------ the peer (its venv)


def peer_model(p: dict, kind: str, attn: str):
    """The peer's drafter of `kind` at eyas's default shape, and its forward's keywords (KL
    for every kind, as eyas trains)."""
    from peer import peer_block, peer_eagle3
    from speculators.losses import resolve_loss_config

    if kind == "eagle3":
        model = peer_eagle3(p["model"], p["draft_ids"], p["aux_layers_hf"], 3, True, attn)
        loss = resolve_loss_config("kl_div", "eager")
        return model, {"ttt_steps": 3, "ttt_step_loss_decay": 1.0, "loss_config": loss}
    return peer_block(p, kind, attn, recipe="kl")


def peer_one(p: dict, kind: str, profile: bool) -> dict:
    import torch
    from peer import cpu_muon, packer
    from speculators.train.optimizers import build_optimizers

    device = setup(p)
    cpu_muon()
    torch.manual_seed(42)
    # its CLI's attention on a GPU (flex), dense on a CPU
    model, kw = peer_model(p, kind, "simple_flex_attention" if device.type == "cuda" else "sdpa")
    model.to(device)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")
    opt_cfg = argparse.Namespace(optimizer="muon", lr=1e-4, weight_decay=0.01, muon_lr=1e-4,
                                 muon_momentum=0.95, muon_weight_decay=0.1, muon_ns_steps=5,
                                 muon_adjust_lr_fn="match_rms_adamw")  # fmt: skip
    opts = build_optimizers(model, opt_cfg)
    packed = packer(Path(p["run"]), shifted=kind == "eagle3")
    blocks = []

    def step(idx, ph: Phases | None) -> int:
        t0 = time.monotonic()
        batch = {k: v.to(device) for k, v in packed(idx).items()}
        if kind != "eagle3":  # its anchors: up to 512 of the positions before the last block
            blocks.append(min(PEER_ANCHORS, int(batch["loss_mask"][:, :-4].sum())))
        if ph is not None:
            t0 = ph.lap("data", t0)
        with autocast:
            _, loss, _ = model(**batch, **kw)
        if ph is not None:
            t0 = ph.lap("forward and loss", t0)
        loss.backward()
        if ph is not None:
            t0 = ph.lap("backward", t0)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        for o in opts:
            o.step()
            o.zero_grad(set_to_none=True)
        if ph is not None:
            ph.lap("optimizer", t0)
        return int(batch["input_ids"].shape[1])

    ph = Phases() if profile else None
    first, later, tokens = timed(step, p["batches"], ph)
    return {"first_s": first, "later_s": later, "tokens": tokens, "peak_mb": peak_mb(p["device"]),
            "phases": ph, "blocks": sum(blocks[-len(p["batches"]) + WARM :]) if blocks else None}  # fmt: skip


# ------------------------------------------------------------------ the comparison


def rate(r: dict, what: str = "tokens") -> float:
    """Tokens (or blocks) a second of a three-epoch training: one first pass, two later."""
    return 3 * r[what] / (r["first_s"] + 2 * r["later_s"])


def measure(tool: str, kind: str, plan_file: Path, py: Path, profile: bool, src: Path) -> dict:
    """One measurement in a process of its own; `src`: the eyas it imports."""
    out = plan_file.with_name(f"{tool}-{kind}-{time.monotonic_ns()}.json")
    role = "peer" if tool == "peer" else "eyas"
    cmd = [str(py), __file__, "one", "--tool", role, "--kind", kind, "--plan", str(plan_file),
           "--out", str(out)] + (["--profile"] if profile else [])  # fmt: skip
    env = {**one_thread_env(), "PYTHONPATH": f"{src}:{REPO / 'bench'}"}
    r = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit(f"{tool} {kind}: exit {r.returncode}\n{r.stderr[-3000:]}")
    return json.loads(out.read_text())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="role")
    one = sub.add_parser("one", help="(internal) one measurement")
    one.add_argument("--tool", choices=("eyas", "peer"), required=True)
    one.add_argument("--kind", required=True)
    one.add_argument("--plan", type=Path, required=True)
    one.add_argument("--out", type=Path, required=True)
    one.add_argument("--profile", action="store_true")
    ap.add_argument("--run", type=Path, help="an extraction (--target last)")
    ap.add_argument("--kinds", default="eagle3,dflash,dspark")
    ap.add_argument("--steps", type=int, default=6, help="timed batches a pass")
    ap.add_argument("--pairs", type=int, default=3)
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--venv", type=Path, default=Path("/tmp/eyas-peer-venv"))
    ap.add_argument("--peer", choices=("venv", "auto", "none"), default="venv",
                    help="venv: the peer in --venv, made on first use from the package registry; "
                    "auto: this python where speculators imports, else --venv if it is ready, "
                    "installing nothing; none: eyas alone")  # fmt: skip
    ap.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    ap.add_argument("--batch-tokens", type=int, default=1024)
    ap.add_argument("--anchor-stride", type=int, default=2,
                    help="eyas's block kinds: a block every this many positions (2: about the "
                    "peer's blocks a batch; 1: eyas train's default)")  # fmt: skip
    ap.add_argument("--json", type=Path)
    ap.add_argument("--before", type=Path, metavar="SRC",
                    help="another eyas's src/ (a checkout of an earlier commit), measured too")  # fmt: skip
    args = ap.parse_args()
    if args.role == "one":
        p = json.loads(args.plan.read_text())
        fn = eyas_one if args.tool == "eyas" else peer_one
        args.out.write_text(json.dumps(fn(p, args.kind, args.profile)))
        return
    if args.run is None:
        ap.error("--run is required")
    peer_py = peer_python(args.peer, args.venv)
    work = Path(tempfile.mkdtemp(prefix="train-speed-"))
    plan_file = work / "plan.json"
    device = args.device if args.device != "auto" else ("cuda" if cuda() else "cpu")
    plan_file.write_text(
        json.dumps(plan(args.run, args.steps, args.batch_tokens, device, args.anchor_stride))
    )
    pys = {"eyas": Path(sys.executable), "peer": peer_py, "before": Path(sys.executable)}
    srcs = {"eyas": REPO / "src", "peer": REPO / "src", "before": args.before}
    tools = [t for t in ("eyas", "peer", "before") if pys[t] is not None and srcs[t] is not None]
    results: dict = {}
    for kind in args.kinds.split(","):
        rows = results[kind] = {t: [] for t in tools}
        for pair in range(args.pairs):
            for tool in tools if pair % 2 == 0 else tools[::-1]:
                r = measure(tool, kind, plan_file, pys[tool], False, srcs[tool])
                rows[tool].append(r)
                print(f"{kind} {tool} pair {pair}: {rate(r):.0f} tokens/s (first pass "
                      f"{r['tokens'] / r['first_s']:.0f}, later {r['tokens'] / r['later_s']:.0f}), "
                      f"peak {r['peak_mb']:.0f} MB", flush=True)  # fmt: skip
        if args.profile:
            for tool in tools:
                rows[f"{tool}-profile"] = measure(
                    tool, kind, plan_file, pys[tool], True, srcs[tool]
                )
    lines = report(results, tools, args)
    print("\n".join(lines))
    if args.json:
        args.json.write_text(json.dumps({"results": results, "table": lines}, indent=1))


def peer_python(how: str, venv: Path) -> Path | None:
    """The python the peer's side runs in, or None (said why)."""
    from peer import Skip, ensure_venv

    check = [sys.executable, "-c", "import speculators.models.dflash"]
    if how == "auto" and subprocess.run(check, capture_output=True).returncode == 0:
        return Path(sys.executable)
    py = venv / "bin" / "python"
    if how == "auto" and py.is_file():
        return py
    if how != "venv":
        print("the peer: not measured (speculators does not import here; --peer venv makes it)")
        return None
    try:
        return ensure_venv(venv)
    except Skip as exc:
        print(f"the peer cannot run here: {exc}; eyas alone")
        return None


def cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def report(results: dict, tools: list[str], args) -> list[str]:
    from eyas.run.runmeta import read_run_meta

    layout = read_run_meta(args.run).get("layout")
    lines = [f"training speed, {args.steps} batches of {args.batch_tokens} tokens a pass, "
             f"{args.pairs} alternated pairs (a 3-epoch training's rate; one thread each on a CPU); "
             f"run layout {layout}",
             "kind    | eyas tok/s | peer tok/s | eyas/peer | blocks/s eyas / peer (ratio) | peak MB eyas / peer"]  # fmt: skip
    for kind, rows in results.items():
        med = {t: statistics.median(rate(r) for r in rows[t]) for t in tools}
        rss = {t: statistics.median(r["peak_mb"] for r in rows[t]) for t in tools}
        peer = "peer" in tools
        ratio = (statistics.median(rate(e) / rate(q) for e, q in zip(rows["eyas"], rows["peer"], strict=True))
                 if peer else None)  # fmt: skip
        blocks = "-"
        if rows["eyas"][0].get("blocks"):
            b = {t: statistics.median(rate(r, "blocks") for r in rows[t]) for t in tools}
            blocks = f"{b['eyas']:.0f}" + (
                f" / {b['peer']:.0f} ({statistics.median(rate(e, 'blocks') / rate(q, 'blocks') for e, q in zip(rows['eyas'], rows['peer'], strict=True)):.2f})"
                if peer else "")  # fmt: skip
        lines.append(f"{kind:7} | {med['eyas']:10.0f} | " + (f"{med['peer']:10.0f} | {ratio:9.2f}" if peer else "         - |         -")
                     + f" | {blocks:28} | {rss['eyas']:.0f}" + (f" / {rss['peer']:.0f}" if peer else ""))  # fmt: skip
        if "before" in tools:
            up = statistics.median(
                rate(e) / rate(q) for e, q in zip(rows["eyas"], rows["before"], strict=True)
            )
            lines.append(f"        before ({args.before}): {med['before']:.0f} tok/s, eyas/before {up:.2f}, "
                         f"peak {rss['before']:.0f} MB")  # fmt: skip
        for tool in tools:
            prof = rows.get(f"{tool}-profile")
            if prof and prof["phases"]:
                steps = 2 * args.steps
                parts = ", ".join(f"{k} {v / steps:.2f}" for k, v in prof["phases"].items())
                lines.append(f"        {tool}, s a step: {parts}")
    return lines


if __name__ == "__main__":
    main()
