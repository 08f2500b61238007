"""`train --follow`: a data source that trains on a run while it is extracted.

Each epoch is one extraction pass (a run without --max-store has one pass; its later epochs
read the full store like a finished run). Samples are taken as they are committed, in
windows: once the committed, unconsumed training samples of the pass hold enough tokens
(or the pass is complete), they are planned into length-bucketed batches and trained, each
once. Which samples the pass has consumed is part of every checkpoint, and the follower's
registration in the run (`stream.publish`) is rewritten only after a checkpoint is durable:
the extractor deletes only what a durable checkpoint is past, so a resume of either side,
after any kill, trains every sample exactly once per pass.

While it waits for samples and the extractor waits for room (its lock's phase says so),
the follower checkpoints what it trained since its last checkpoint, so the extractor can
delete it and go on: neither side waits on the other for ever, and a trainer that is merely
faster than the extractor does not checkpoint at every wait. The held-out samples of a pass are evaluated when the pass is complete. Under
torchrun rank 0 decides each window and sends it to the other ranks.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch
import torch.distributed as dist

from eyas.errors import UsageError
from eyas.run.fsutil import human_bytes, parse_size
from eyas.run.journal import Ledger, journal_files, ledger, pass_of, read_errors
from eyas.run.lock import all_locks, live_locks
from eyas.run.runmeta import is_run
from eyas.run.stream import from_ranges, publish, to_ranges
from eyas.targets.target import plan_batches
from eyas.training.train_data import (
    SampleReader,
    StopRequested,
    StoreSource,
    pack_batches,
    split_samples,
)

POLL = 0.5  # seconds between looks at the journals while waiting
HEARTBEAT = 5.0  # rank 0 tells the other ranks it is still waiting (collectives time out)


class FollowSource:
    saves_each_epoch = True  # the extractor may delete a pass once its end is checkpointed

    def __init__(
        self,
        cfg,
        run: Path,
        out: Path,
        meta: dict,
        rank: int,
        world: int,
        reader: SampleReader,
        log,
    ):
        from eyas.data.dataset import PreparedDataset

        self.cfg, self.run, self.out, self.rank, self.world = cfg, Path(run), Path(out), rank, world
        self.reader, self.log = reader, log
        conf = meta.get("config", {})
        self.passes = int(conf.get("passes") or 1)
        self.budget = parse_size(conf["max_store"], 1) if conf.get("max_store") else None
        if self.budget and cfg.epochs != self.passes:
            raise UsageError(
                f"{run} keeps at most {conf['max_store']} of samples (--max-store): each sample is trained "
                f"once per extraction pass, so --epochs must be the run's --passes ({self.passes})"
            )
        self.n = meta["samples"]
        self.lengths = PreparedDataset.open(meta["dataset_path"], check=False).lengths().tolist()
        self.train_idx, self.val_idx = split_samples(list(range(self.n)), cfg.val_fraction)
        self.train_set = set(self.train_idx)
        bpt = meta["bytes_per_token"]
        window = 16 * cfg.batch_tokens * cfg.grad_accum
        if self.budget:
            val_bytes = sum(self.lengths[i] for i in self.val_idx) * bpt
            if val_bytes > self.budget / 2:
                raise UsageError(
                    f"the held-out samples (~{human_bytes(val_bytes)}) stay on disk until their pass is "
                    f"evaluated, and would fill over half of {run}'s --max-store {conf['max_store']}: "
                    "lower --val-fraction"
                )
            window = min(window, int((self.budget - val_bytes) / bpt / 2))
        self.window_tokens = max(1, window)
        self.consumed: set[int] = set()
        self.trained = 0
        self.command = (
            f"eyas train --follow --resume --data {self.run.resolve()} --out {self.out.resolve()}"
        )
        self._published: tuple[int, set[int], int] = (0, set(), 0)
        self._kept: list[tuple[int, set[int], int]] = []  # (pass, consumed, trained) per checkpoint
        self.unreadable: set[int] = set()  # samples the reader could not read (this rank's)
        self._wait: str | None = None
        self._led: tuple[tuple, Ledger] | None = None
        self._windows = 0
        self._whole: int | None = None  # steps_per_epoch, once planned
        self._lost_said: set[tuple[int, int]] = set()  # (pass, count) of losses already said
        self._store: StoreSource | None = None
        self._live_checked = (0.0, True)
        self.waited = 0.0  # seconds spent waiting for samples
        self._waited = False

    # ------------------------------------------------------------------ what the loop asks

    def describe(self) -> str:
        left = f", {self.passes} extraction pass(es)" if self.passes > 1 else ""
        return (
            f"{self.run} as it is extracted ({len(self.train_idx)} samples, "
            f"{len(self.val_idx)} held out{left})"
        )

    def steps_per_epoch(self) -> int:
        """Batches of one pass planned over the whole set: a lower bound, as each window ends
        in a part-filled batch (`steps_after` corrects the total as windows come)."""
        if self._whole is None:  # the same every call: planned once (`steps_after` asks per window)
            plan = pack_batches if self.cfg.pack else plan_batches
            self._whole = len(plan(self.lengths, self.train_idx, self.cfg.batch_tokens))
        return self._whole

    def steps_after(self, epoch: int, groups: list) -> int:
        """Optimizer steps left once the window `groups` of pass `epoch` is trained: the rest
        of the pass planned as one window, then whole passes."""
        plan = pack_batches if self.cfg.pack else plan_batches
        window = {i for g in groups for b in g for i in b}
        rest = [i for i in self.train_idx if i not in self.consumed and i not in window]
        a = self.cfg.grad_accum
        here = -(-len(plan(self.lengths, rest, self.cfg.batch_tokens)) // a) if rest else 0
        return here + (self.cfg.epochs - epoch - 1) * self.steps_per_epoch() // a

    def restore(self, state: dict) -> None:
        f = state.get("follow") or {}
        self.consumed = from_ranges(f.get("consumed", []))
        self.trained = int(f.get("trained", 0))
        self._kept = [(state["epoch"], set(self.consumed), self.trained)]
        if (
            self.rank == 0
        ):  # register before anything is consumed (a run without followers deletes nothing)
            self._publish(state["epoch"], self.consumed, self.trained)
            if state["epoch"] < self.passes and is_run(self.run):
                self._note_lost(self._ledger(), state["epoch"])  # at once, not at the pass's end

    def windows(self, epoch: int, state: dict, hooks):
        if epoch >= self.passes:  # a run without a budget: the later epochs read the full store
            yield from self._store_epochs().windows(epoch, state, hooks)
            return
        while True:
            msg = self._share(self._decide(epoch, hooks) if self.rank == 0 else None)
            if msg[0] == "wait":
                continue
            if msg[0] == "stop":
                raise StopRequested
            if msg[0] == "end":
                return
            _, groups, entries = msg
            self.reader.update(entries)
            yield groups

    def advance(self, state: dict, epoch: int, group: list[list[int]]) -> dict:
        for b in group:  # a sample whose file could not be read was not trained: not consumed
            read = [i for i in b if i not in self.unreadable]
            self.consumed.update(read)
            self.trained += len(read)
        return {"step": state["step"] + 1, "epoch": epoch, "batch": state["batch"] + len(group)}

    def end_epoch(self, state: dict, epoch: int) -> dict:
        self.consumed = set()
        self.unreadable.clear()  # a later pass may find the file extracted again
        return {"step": state["step"], "epoch": epoch + 1, "batch": 0}

    def has_val(self, epoch: int) -> bool:
        return bool(self._val_plan(epoch))

    def val_batches(self, epoch: int) -> list[list[int]]:
        return self._val_plan(epoch)

    def stamp(self, state: dict) -> dict:
        return {**state, "follow": {"consumed": to_ranges(self.consumed), "trained": self.trained}}

    def saved(self, state: dict) -> None:
        """The checkpoint of `state` is durable: tell the extractor what it may delete, as of
        the oldest checkpoint kept, so that a damaged newest one falls back to a checkpoint
        whose samples are all still on disk (with --keep-checkpoints 1, the newest)."""
        self._kept = [*self._kept, (state["epoch"], set(self.consumed), self.trained)]
        self._kept = self._kept[-max(1, self.cfg.keep_checkpoints) :]
        if self.rank == 0:
            self._publish(*self._kept[0], waiting=self._wait is not None)

    def caught_up(self) -> None:
        """The run waits on this trainer and it has nothing new to checkpoint: publish its
        newest checkpoint, or neither side would ever move."""
        if self.rank == 0 and self._kept and self._published[:2] != self._kept[-1][:2]:
            self._publish(*self._kept[-1], waiting=True)

    def finished(self, state: dict) -> None:
        if self.rank == 0:
            publish(
                self.run,
                self.out,
                state["epoch"],
                set(),
                self.trained,
                command=self.command,
                finished=True,
            )

    def waiting(self) -> str | None:
        return self._wait

    # ------------------------------------------------------------------ rank 0's decisions

    def _decide(self, epoch: int, hooks) -> tuple:
        """The next window of pass `epoch` (waiting for samples as long as needed), the end
        of the pass, or a stop."""
        t0 = time.monotonic()
        try:
            return self._wait_for_window(epoch, hooks)
        finally:
            if self._waited:
                self.waited += time.monotonic() - t0

    def _wait_for_window(self, epoch: int, hooks) -> tuple:
        p, waited, beat = epoch, False, time.monotonic()
        self._waited = False
        while True:
            led = self._ledger()
            commits = led.pass_commits(p)
            pend = [
                i
                for i in commits
                if i in self.train_set
                and i not in self.consumed
                and i not in self.unreadable
                and pass_of(led.present.get(i) or {"pass": -1}) == p
            ]
            complete = self._complete(led, p)
            # The extractor waits for room, or is not running (a full disk stops it): a window
            # that will not fill is trained as it is, so that its checkpoint makes room.
            stalled = bool(self.budget) and (self._extractor_waits() or not self._extractor_live())
            if pend and (
                complete or stalled or sum(commits[i]["tokens"] for i in pend) >= self.window_tokens
            ):
                if self._wait is not None:
                    hooks.note(None)
                self._wait = None
                if waited:
                    self._publish(*self._published, waiting=False)
                entries = {i: led.present[i] for i in pend}
                return ("window", self._plan(pend, entries, epoch), entries)
            if complete:
                if self._wait is not None:
                    hooks.note(None)
                    self._wait = None
                self._note_lost(led, p)
                return ("end",)
            if hooks.stopping():
                return ("stop",)
            if not waited:
                self._publish(*self._published, waiting=True)
                waited = self._waited = True
            if stalled:
                # The store is full (or the extractor stopped) and this trainer holds what it
                # trained since its last checkpoint: checkpoint it, so that the extractor (or
                # its resume) may delete it and go on.
                hooks.before_wait()
            ready = sum(commits[i]["tokens"] for i in pend)
            self._wait = (
                f"waiting for extraction: pass {p + 1}/{self.passes}, {len(commits)}/{self.n} "
                f"committed, {len(self.consumed)} trained; {len(pend)} untrained ({ready:,} tokens "
                f"of the {self.window_tokens:,} a window takes)" + self._extractor_note()
            )
            hooks.note(self._wait)
            if self.world > 1 and time.monotonic() - beat > HEARTBEAT:
                self._share(("wait",))
                beat = time.monotonic()
            time.sleep(POLL)

    def _plan(self, pend: list[int], entries: dict[int, dict], epoch: int) -> list[list[list[int]]]:
        """Length-bucketed (or packed) batches of a window, shuffled, in optimizer steps."""
        lengths = {i: e["tokens"] for i, e in entries.items()}
        plan = pack_batches if self.cfg.pack else plan_batches
        batches = plan(lengths, sorted(pend), self.cfg.batch_tokens)
        self._windows += 1
        g = torch.Generator().manual_seed((self.cfg.seed * 1000 + epoch) * 100003 + self._windows)
        batches = [batches[i] for i in torch.randperm(len(batches), generator=g).tolist()]
        a = self.cfg.grad_accum
        return [batches[k : k + a] for k in range(0, len(batches), a)]

    def _complete(self, led: Ledger, p: int) -> bool:
        """Every sample of pass p is committed, or failed in it."""
        commits = led.pass_commits(p)
        if len(commits) >= self.n:
            return True
        failed = {e["index"] for e in read_errors(self.run) if pass_of(e) == p}
        return len(set(commits) | failed) >= self.n

    def _ledger(self) -> Ledger:
        """The run's ledger, read again only when a journal changed."""
        key = []
        for _, path in sorted(journal_files(self.run).items()):
            try:
                st = path.stat()
                key.append((str(path), st.st_size, st.st_mtime_ns))
            except FileNotFoundError:
                continue
        if self._led is None or self._led[0] != tuple(key):
            self._led = (tuple(key), ledger(self.run))
        return self._led[1]

    def _note_lost(self, led: Ledger, p: int) -> None:
        if bad := sorted(self.unreadable & self.train_set - self.consumed):
            self.log(
                f"warning: pass {p + 1} is incomplete: {len(bad)} sample(s) (e.g. {bad[:3]}) could not "
                "be read (see skipped_samples.jsonl); they are not counted as consumed, so the "
                f"extractor keeps them: `eyas verify --repair {self.run}` sets them up for extraction again"
            )
        lost = [i for i in led.pass_retired(p) if i in self.train_set and i not in self.consumed]
        if lost and (p, len(lost)) not in self._lost_said:
            self._lost_said.add((p, len(lost)))
            self.log(
                f"warning: {len(lost)} sample(s) of pass {p + 1} were deleted before this trainer "
                "consumed them (it registered late, or resumed from an older checkpoint than the "
                "one it had published): they are not trained in this pass"
            )

    def _extractor_waits(self) -> bool:
        return any(lk.live and lk.phase == "waiting for followers" for lk in all_locks(self.run))

    def _extractor_live(self) -> bool:
        t, live = self._live_checked
        if time.monotonic() - t > 5:
            live = bool(live_locks(self.run))
            self._live_checked = (time.monotonic(), live)
        return live

    def _extractor_note(self) -> str:
        live = self._extractor_live()
        return "" if live else f" (no extractor is running: eyas extract --resume {self.run})"

    def _publish(self, p: int, consumed: set[int], trained: int, waiting: bool = False) -> None:
        self._published = (p, set(consumed), trained)
        publish(self.run, self.out, p, consumed, trained, command=self.command, waiting=waiting)

    # ------------------------------------------------------------------ every rank

    def _share(self, msg):
        """Rank 0's message, on every rank."""
        if self.world == 1:
            return msg
        box = [msg]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def _val_plan(self, epoch: int) -> list[list[int]]:
        """Batches of the pass's held-out samples committed so far (all of them at its end)."""
        msg = None
        if self.rank == 0:
            led = self._ledger()
            p = min(epoch, self.passes - 1)
            entries = {
                i: led.present[i]
                for i in self.val_idx
                if i in led.present and pass_of(led.present[i]) == p
            }
            plan = pack_batches if self.cfg.pack else plan_batches
            lengths = {i: e["tokens"] for i, e in entries.items()}
            msg = (plan(lengths, sorted(entries), self.cfg.batch_tokens), entries)
        batches, entries = self._share(msg)
        self.reader.update(entries)
        return batches

    def _store_epochs(self) -> StoreSource:
        if self._store is None:
            led = ledger(self.run)
            entries = {i: e for i, e in led.present.items() if i < self.n}
            self.reader.update(entries)
            self._store = StoreSource(
                self.cfg,
                entries,
                [i for i in self.train_idx if i in entries],
                [i for i in self.val_idx if i in entries],
            )
        return self._store
