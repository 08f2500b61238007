"""Stage 0, `generate`: the target's own answers, through a serving endpoint, exactly once.

A drafter learns to predict the target, so its best training data is the target's own
replies to real prompts. `generate` sends every conversation of the input (the record forms
`prepare` reads) to an OpenAI-compatible `/v1/chat/completions` endpoint (vLLM, SGLang, any
other), with the last assistant turn (or every assistant turn, in order, feeding the
target's own earlier answers back) replaced by what the target says.

Exactly once, in input order: each finished record is appended to a durable log (flushed
and fsynced before it counts; a torn last line is cut on resume) by one writer, keyed by
its input position. Requests run concurrently and finish in any order; rerunning the same
command after any crash sends only what the log lacks. When every record is done or has
failed, OUT is written atomically from the log, in input order, each record once. A
changed input, model or sampling setting is refused on resume; the endpoint may move.

State lives next to OUT, in `OUT.eyas-gen/`: `generate.json` (the job), `log.jsonl`,
`errors.jsonl`, `locks/`. `eyas status` and `eyas doctor` read it like a run directory.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import queue
import random
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from eyas import __version__
from eyas.data.records import (
    RawRecord,
    RecordError,
    iter_records,
    parse_record,
    read_conversation,
    record_id,
)
from eyas.errors import Stopped, UsageError
from eyas.host.ui import Reporter
from eyas.resume import ResumeRule
from eyas.run.fsutil import atomic_write, atomic_write_json, fsync_dir, read_json
from eyas.run.lock import WriterLock
from eyas.stages.config import GenerateConfig
from eyas.stop import StopSignals, start_thread

STATE_SUFFIX = ".eyas-gen"
RETRY_STATUS = {408, 409, 425, 429, 500, 502, 503, 504}
STOP_GRACE = 5.0  # seconds a stop waits for requests in flight before abandoning them


class _SameFailure:
    """Watches the outcomes of records: `n` failures in a row, all for the same reason (a
    server gone, a model name it does not serve), mean the rest would fail too, and hours
    of retries would only say so later. `failed` then returns why to stop."""

    def __init__(self, n: int):
        self.n, self.reasons = n, []

    def succeeded(self) -> None:
        self.reasons.clear()

    def failed(self, reason: str) -> str | None:
        self.reasons.append(reason)
        if len(self.reasons) >= self.n and len(set(self.reasons[-self.n :])) == 1:
            return (
                f"stopped: the last {self.n} records all failed the same way ({reason}); the rest would "
                "too. Fix the cause (the server, --endpoint, --model)"
            )
        return None


class GenerateStopped(Stopped):
    def __init__(self, reason: str, done: int, total: int, cmd: str):
        super().__init__(
            f"{reason}. {done}/{total} records are done. Resume with the same command: {cmd}"
        )


@dataclass
class GenerateSummary:
    out: str
    records: int = 0
    done_before: int = 0
    generated: int = 0
    failed: int = 0
    truncated: int = 0
    requests: int = 0
    completion_tokens: int = 0
    seconds: float = 0.0
    errors: list[dict] = field(default_factory=list)

    def render(self) -> str:
        per_s = max(self.seconds, 1e-9)
        return (
            f"generated {self.generated} records ({self.done_before} done before, {self.failed} failed, "
            f"{self.truncated} cut by --max-tokens) with {self.requests} requests, "
            f"{self.completion_tokens:,} completion tokens in {self.seconds:.1f}s "
            f"({self.requests / per_s:.2f} req/s, {self.completion_tokens / per_s:,.0f} tok/s) -> {self.out}"
        )

    def problems(self) -> str | None:
        """What failed (exit 1), and how to retry it, or None."""
        if self.failed:
            return (
                f"{self.failed} records failed; see {state_dir(self.out) / 'errors.jsonl'}; "
                "rerun the same command to retry them"
            )
        return None


def state_dir(out: str | Path) -> Path:
    out = Path(out)
    return out.with_name(out.name + STATE_SUFFIX)


def _fingerprint(files: tuple[str, ...]) -> str:
    h = hashlib.sha256()
    for f in files:
        with open(f, "rb") as fh:
            while block := fh.read(1 << 20):
                h.update(block)
        h.update(b"\0")
    return h.hexdigest()[:16]


# ---------------------------------------------------------------------------- the durable log


def read_log(path: Path) -> dict[int, dict]:
    """Finished records by input position; a torn last line is cut off (the writer died
    mid-append), a damaged line elsewhere is skipped and its record done again."""
    if not path.exists():
        return {}
    data = path.read_bytes()
    if data and not data.endswith(b"\n"):
        with open(path, "r+b") as f:
            f.truncate(data.rfind(b"\n") + 1)
            os.fsync(f.fileno())
        data = data[: data.rfind(b"\n") + 1]
    done = {}
    for line in data.splitlines():
        try:
            e = json.loads(line)
        except (json.JSONDecodeError, UnicodeDecodeError):
            continue
        if (
            isinstance(e, dict)
            and isinstance(e.get("pos"), int)
            and isinstance(e.get("record"), dict)
        ):
            done.setdefault(e["pos"], e)
    return done


class DurableLog:
    def __init__(self, path: Path):
        self._f = open(path, "ab")

    def append(self, entry: dict) -> None:
        """Counts only once this returns: written, flushed and fsynced."""
        self._f.write((json.dumps(entry, ensure_ascii=False) + "\n").encode())
        self._f.flush()
        os.fsync(self._f.fileno())

    def close(self) -> None:
        self._f.close()


# ---------------------------------------------------------------------------- requests


class RequestFailed(Exception):
    pass


def chat_url(endpoint: str) -> str:
    base = endpoint.rstrip("/")
    return base + ("/chat/completions" if base.endswith("/v1") else "/v1/chat/completions")


class Malformed(Exception):
    """An answer that is not a usable chat completion (retried like a server error)."""


def _send(cfg: GenerateConfig, data: bytes, headers: dict) -> tuple[int, bytes]:
    """One POST under a whole-request deadline (`cfg.timeout` from connect to the last
    byte: a server that trickles bytes cannot hold a request longer) and a cap on the
    answer's size. Returns (status, body)."""
    import http.client
    import socket
    import urllib.parse

    url = urllib.parse.urlsplit(chat_url(cfg.endpoint))
    cls = http.client.HTTPSConnection if url.scheme == "https" else http.client.HTTPConnection
    conn = cls(url.hostname, url.port, timeout=cfg.timeout)
    expired = threading.Event()

    def cut() -> None:  # the deadline: wake any blocked read by shutting the socket down
        expired.set()
        if conn.sock is not None:
            with contextlib.suppress(OSError):
                conn.sock.shutdown(socket.SHUT_RDWR)

    timer = threading.Timer(cfg.timeout, cut)
    timer.daemon = True
    timer.start()
    try:
        path = url.path + (f"?{url.query}" if url.query else "")
        conn.request("POST", path, body=data, headers=headers)
        r = conn.getresponse()
        body = bytearray()
        while chunk := r.read1(1 << 16):
            if expired.is_set():  # the deadline passed while the connection was still opening
                raise TimeoutError("no complete answer within --timeout")
            body += chunk
            if len(body) > cfg.max_response_bytes:
                raise RequestFailed(
                    f"answer larger than --max-response-bytes ({cfg.max_response_bytes:,})"
                )
        if expired.is_set():
            raise TimeoutError("no complete answer within --timeout")
        return r.status, bytes(body)
    except (OSError, http.client.HTTPException) as exc:
        if expired.is_set():
            raise TimeoutError(f"no complete answer within --timeout {cfg.timeout:g}s") from None
        raise ConnectionError(f"{type(exc).__name__}: {exc}") from None
    finally:
        timer.cancel()
        conn.close()


def parse_answer(body: bytes) -> dict:
    """A chat completion's JSON, checked for what `regenerate` reads; Malformed otherwise."""
    try:
        resp = json.loads(body.decode("utf-8"))
    except UnicodeDecodeError:
        raise Malformed("the answer is not UTF-8") from None
    except json.JSONDecodeError as exc:
        raise Malformed(f"the answer is not JSON ({exc})") from None
    if not isinstance(resp, dict):
        raise Malformed(f"the answer is a JSON {type(resp).__name__}, not an object")
    choices = resp.get("choices")
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
        raise Malformed(f"the answer has no list of choices: {str(resp)[:200]}")
    msg = choices[0].get("message")
    if not isinstance(msg, dict):
        raise Malformed("choices[0].message is not an object")
    for key in ("content", "reasoning_content", "reasoning"):
        v = msg.get(key)
        if v is not None and not isinstance(v, str):
            raise Malformed(f"choices[0].message.{key} is not text")
        if isinstance(v, str):
            try:
                v.encode("utf-8")
            except UnicodeEncodeError:
                raise Malformed(
                    f"choices[0].message.{key} holds a lone surrogate (not valid Unicode)"
                ) from None
    usage = resp.get("usage")
    if usage is not None and not isinstance(usage, dict):
        raise Malformed("usage is not an object")
    for k in ("prompt_tokens", "completion_tokens"):
        v = (usage or {}).get(k)
        if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 0):
            raise Malformed(f"usage.{k} is not a token count: {v!r}")
    return resp


def post_chat(
    cfg: GenerateConfig, messages: list[dict], stop: threading.Event, tools: list | None = None
) -> tuple[dict, int]:
    """One chat completion with retries and backoff; (response, attempts). Every way an
    answer can fail (status, time, size, shape) ends in RequestFailed, never elsewhere."""
    body = {
        "model": cfg.model,
        "messages": messages,
        "max_tokens": cfg.max_tokens,
        "temperature": cfg.temperature,
    }
    if cfg.seed is not None:
        body["seed"] = cfg.seed
    if tools:
        body["tools"] = tools
    if cfg._template:
        body["chat_template"] = cfg._template
    headers = {"Content-Type": "application/json"}
    if cfg.api_key_env:
        headers["Authorization"] = f"Bearer {os.environ[cfg.api_key_env]}"
    data = json.dumps(body).encode()
    last = ""
    for attempt in range(cfg.retries + 1):
        if stop.is_set():
            raise RequestFailed("stopped")
        try:
            status, raw = _send(cfg, data, headers)
            if status >= 400:
                last = f"HTTP {status}: {raw[:200].decode('utf-8', 'replace')}"
                if "chat template" in last.lower() or "chat_template" in last:
                    last += (
                        " (the server has no chat template for this target: start it with "
                        "--chat-template FILE, or give eyas generate --chat-template FILE)"
                    )
                if status not in RETRY_STATUS:
                    raise RequestFailed(last)
            else:
                return parse_answer(raw), attempt + 1
        except Malformed as exc:
            last = f"malformed answer: {exc}"
        except (TimeoutError, ConnectionError) as exc:
            last = f"{type(exc).__name__}: {exc}"
        delay = min(60.0, cfg.backoff * 2**attempt) * (0.5 + random.random())  # backoff with jitter
        if attempt < cfg.retries and stop.wait(delay):
            raise RequestFailed("stopped")
    raise RequestFailed(f"gave up after {cfg.retries + 1} attempts; last: {last}")


def regenerate(
    cfg: GenerateConfig, messages: list[dict], stop: threading.Event, tools: list | None = None
) -> dict:
    """The conversation with its last (or every) assistant turn the target's, and provenance.

    An assistant turn that opens the conversation has no prompt to answer: it is kept as
    written (named in the provenance), and the turns after it are regenerated."""
    idx = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    kept = [i for i in idx if not any(m["role"] != "assistant" for m in messages[:i])]
    todo = [i for i in (idx[-1:] if cfg.turns == "last" else idx) if i not in kept]
    if not todo:
        raise RequestFailed("no assistant turn has a prompt before it to regenerate from")
    out = list(messages[: todo[0]])
    usage = {"prompt_tokens": 0, "completion_tokens": 0}
    finish, served, requests, cut_in_reasoning = [], None, 0, []
    for i in todo:
        out.extend(messages[len(out) : i])  # the user turns (and others) before this answer
        resp, attempts = post_chat(cfg, out, stop, tools)
        requests += attempts
        choice = resp["choices"][0]
        msg = choice["message"]
        turn = {"role": "assistant", "content": msg.get("content") or ""}
        reasoning = msg.get("reasoning_content") or msg.get("reasoning")
        if reasoning:
            turn["reasoning_content"] = reasoning
        if isinstance(msg.get("tool_calls"), list) and msg["tool_calls"]:
            turn["tool_calls"] = msg["tool_calls"]
        if not (turn["content"] or reasoning or turn.get("tool_calls")):
            raise RequestFailed(f"turn {i}: the answer has no text, reasoning or tool calls")
        out.append(turn)
        finish.append(choice.get("finish_reason"))
        if (
            finish[-1] == "length"
            and reasoning
            and not turn["content"]
            and not turn.get("tool_calls")
        ):
            cut_in_reasoning.append(i)  # the token limit ended it while it was still thinking
        served = resp.get("model", served) if isinstance(resp.get("model"), str) else served
        for k in usage:
            usage[k] += int((resp.get("usage") or {}).get(k) or 0)
    provenance = {
        "endpoint_model": cfg.model,
        "served_model": served,
        "max_tokens": cfg.max_tokens,
        "temperature": cfg.temperature,
        "seed": cfg.seed,
        "turns": cfg.turns,
        "finish_reason": finish,
        "truncated": "length" in finish,
        "usage": usage,
        "eyas_version": __version__,
    }
    if kept:
        provenance["kept_as_written"] = kept  # opening assistant turns: no prompt to answer
    if cut_in_reasoning:
        provenance["cut_in_reasoning"] = cut_in_reasoning
    return {"messages": out, "generation": provenance, "requests": requests}


# ---------------------------------------------------------------------------- the stage


def _inputs(cfg: GenerateConfig) -> list[RawRecord]:
    recs: list[RawRecord] = []
    for f in cfg.data:
        p = Path(f)
        if not p.is_file():
            raise FileNotFoundError(f"input file not found: {p}")
        recs.extend(iter_records(p))
    return recs


# How a resume meets generate.json (eyas.resume): the target, the inputs' content and the
# sampling are fixed; the inputs' paths and the endpoint may move; the rest notes one
# invocation.
RESUME_RULE = ResumeRule(
    may_change=frozenset({"data", "endpoint"}),
    per_invocation=frozenset({"records", "created", "command", "eyas_version"}),
)


def _job(cfg: GenerateConfig) -> dict:
    return {
        "model": cfg.model,
        "data": [str(Path(f).resolve()) for f in cfg.data],
        "data_fingerprint": _fingerprint(cfg.data),
        "sampling": cfg.sampling(),
    }


class EndpointUnreachable(UsageError):
    """Nothing answers at --endpoint: no record could succeed (a usage error, exit 2)."""


def check_endpoint(endpoint: str, timeout: float = 10.0) -> None:
    """One TCP connection to the endpoint before the job: a wrong host or port is said at
    once, instead of every record being retried against it."""
    import socket
    import urllib.parse

    url = urllib.parse.urlsplit(chat_url(endpoint))
    port = url.port or (443 if url.scheme == "https" else 80)
    try:
        socket.create_connection((url.hostname, port), timeout=timeout).close()
    except OSError as exc:
        why = (
            "connection refused"
            if isinstance(exc, ConnectionRefusedError)
            else (f"no answer within {timeout:g}s" if isinstance(exc, TimeoutError) else str(exc))
        )
        raise EndpointUnreachable(
            f"cannot reach --endpoint {endpoint} ({url.hostname}:{port}): {why}; "
            "is the server running, on that host and port?"
        ) from None


def generate(cfg: GenerateConfig, command: str = "eyas generate ...") -> GenerateSummary:
    out = Path(cfg.out)
    state = state_dir(out)
    recs = _inputs(cfg)
    job = _job(cfg)
    check_endpoint(cfg.endpoint)  # before anything is written
    state.mkdir(parents=True, exist_ok=True)
    saved = state / "generate.json"
    if saved.exists():
        prev = read_json(saved)
        if names := RESUME_RULE.differing(prev, job):
            raise UsageError(
                f"{saved}: this generation was started with another {', '.join(names)} "
                f"({'; '.join(RESUME_RULE.differences(prev, job))}); use another --out, "
                "or the original settings"
            )
    else:
        atomic_write_json(
            saved,
            {
                **job,
                "endpoint": cfg.endpoint,
                "records": len(recs),
                "created": time.time(),
                "command": command,
                "eyas_version": __version__,
            },
        )
    lock = WriterLock(state, 0, 1).acquire()
    log = None
    try:
        done = read_log(state / "log.jsonl")
        log = DurableLog(state / "log.jsonl")
        return _run(cfg, recs, done, log, state, out, command)
    finally:
        if log is not None:
            log.close()
        lock.release()


def _todo(recs, done, errors: dict[int, dict]) -> list[tuple]:
    """The records still to regenerate; one that cannot be read goes to `errors` instead."""
    todo = []
    for pos, rec in enumerate(recs):
        if pos in done:
            continue
        try:
            obj = parse_record(rec)
            rid = record_id(obj, rec)
            conv = read_conversation(obj)
            if conv.form == "text":
                raise RecordError("a 'text' record has no turns to regenerate", "no-assistant")
            todo.append((pos, rec, rid, conv.messages, conv.tools))
        except RecordError as exc:
            errors[pos] = {"file": rec.file, "line": rec.line, "reason": str(exc), "code": exc.code}
    return todo


def _commit(s: GenerateSummary, log, done, pos, rec, rid, tools, result: dict) -> None:
    """One regenerated record: durable in the log first, then counted."""
    requests = result.pop("requests")  # attempts: this session's statistics, not provenance
    record = {"id": rid, **result, **({"tools": tools} if tools else {})}
    log.append({"pos": pos, "file": rec.file, "line": rec.line, "record": record})
    done[pos] = {"record": record}
    s.generated += 1
    s.requests += requests
    s.completion_tokens += result["generation"]["usage"]["completion_tokens"]


def _start_workers(cfg, stop: threading.Event) -> tuple[queue.Queue, queue.Queue]:
    """cfg.concurrency request threads: records in on `work` (None ends one), outcomes on `results`.

    Daemon threads: a stop abandons requests still in flight after a grace period instead of
    waiting out their timeouts (their records are simply done again on resume)."""
    work: queue.Queue = queue.Queue()
    results: queue.Queue = queue.Queue()

    def worker() -> None:
        while (item := work.get()) is not None:
            try:
                results.put((item, regenerate(cfg, item[3], stop, item[4]), None))
            except BaseException as exc:  # noqa: BLE001 - handed to the main thread
                results.put((item, None, exc))

    for _ in range(cfg.concurrency):
        start_thread(threading.Thread(target=worker, name="eyas-gen", daemon=True))
    return work, results


def _failed(
    errors: dict, pos: int, rec, rid, exc: Exception, rep, alike: _SameFailure
) -> str | None:
    """A record whose request failed: kept in `errors` and out of the bar's total; the reason
    to stop where the last records all failed the same way."""
    if not isinstance(exc, RequestFailed):  # a record this code cannot handle
        exc = RequestFailed(f"{type(exc).__name__}: {exc}")
    errors[pos] = {
        "file": rec.file,
        "line": rec.line,
        "id": rid,
        "reason": str(exc),
        "code": "request",
    }
    rep.retotal(rep.total - 1)
    rep.advance(0)  # none more done: the line shows the failure
    return alike.failed(str(exc))


def _run(cfg, recs, done, log, state, out, command) -> GenerateSummary:
    s = GenerateSummary(out=str(out), records=len(recs), done_before=len(done))
    errors: dict[int, dict] = {}
    todo = _todo(recs, done, errors)
    stop = threading.Event()
    reason: list[str] = []

    signals = StopSignals(event=stop, on_first=lambda name: reason.append(f"stopped by {name}"))
    t0 = time.monotonic()

    def extra() -> str:
        el = max(time.monotonic() - t0, 1e-9)
        speed = (
            f"{s.requests / el:.1f} req/s, {s.completion_tokens / el:,.0f} tok/s, "
            if s.requests
            else ""
        )
        return f"{speed}{len(errors)} failed, {len(recs) - len(done) - len(errors)} pending"

    # The bar counts records done; a failed one leaves the total (its count is in `extra`),
    # so that failures never read as progress and the ETA is for the records still pending.
    rep = Reporter(
        "generate", len(recs) - len(errors), unit="records done", enabled=cfg.progress, extra=extra
    )
    rep.__enter__()
    rep.skip(len(done))
    alike = _SameFailure(max(8, 2 * cfg.concurrency))
    work, results = _start_workers(cfg, stop)
    items, in_flight, stopped_at = iter(todo), 0, None
    with signals:
        try:
            while True:
                while (
                    not stop.is_set()
                    and in_flight < 2 * cfg.concurrency
                    and (item := next(items, None))
                ):
                    work.put(item)
                    in_flight += 1
                if in_flight == 0:
                    break
                if stop.is_set():
                    stopped_at = stopped_at or time.monotonic()
                    if time.monotonic() - stopped_at > STOP_GRACE:
                        break
                try:
                    (pos, rec, rid, _, tools), result, exc = results.get(timeout=0.2)
                except queue.Empty:
                    continue
                in_flight -= 1
                if exc is not None:
                    if not isinstance(exc, Exception):
                        raise exc
                    if not stop.is_set() and (
                        why := _failed(errors, pos, rec, rid, exc, rep, alike)
                    ):
                        reason.append(why)
                        stop.set()
                    continue
                _commit(s, log, done, pos, rec, rid, tools, result)
                alike.succeeded()
                rep.advance()
        finally:
            stop.set()
            for _ in range(cfg.concurrency):
                work.put(None)
            rep.__exit__(None, None, None)
    s.seconds = time.monotonic() - t0
    s.failed = len(errors)
    s.errors = [errors[p] for p in sorted(errors)]
    _write_errors(state, s.errors)
    if reason:
        raise GenerateStopped(reason[0], len(done), len(recs), command)
    s.truncated = sum(bool(done[p]["record"]["generation"]["truncated"]) for p in done)
    _write_out(out, recs, done)
    return s


def _write_errors(state: Path, errors: list[dict]) -> None:
    atomic_write(
        state / "errors.jsonl",
        lambda f: f.write("".join(json.dumps(e) + "\n" for e in errors).encode()),
    )


def _write_out(out: Path, recs: list[RawRecord], done: dict[int, dict]) -> None:
    """OUT from the log, in input order, each record once, published atomically."""

    def write(f) -> None:
        for pos in range(len(recs)):
            if pos in done:
                f.write((json.dumps(done[pos]["record"], ensure_ascii=False) + "\n").encode())

    out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(out, write)
    fsync_dir(out.parent)


def generation_status(state: Path) -> dict:
    """What `status` and `doctor` say about a generation directory."""
    from eyas.run.lock import all_locks

    job = read_json(state / "generate.json")
    done = read_log(state / "log.jsonl") if (state / "log.jsonl").exists() else {}
    errors = (
        [json.loads(x) for x in (state / "errors.jsonl").read_text().splitlines()]
        if (state / "errors.jsonl").exists()
        else []
    )
    locks = all_locks(state)
    out = state.with_name(state.name[: -len(STATE_SUFFIX)])
    return {
        "state": str(state),
        "out": str(out),
        "out_written": out.exists(),
        "records": job["records"],
        "done": len(done),
        "failed": len(errors),
        "remaining": job["records"] - len(done),
        "model": job["model"],
        "endpoint": job.get("endpoint"),
        "sampling": job["sampling"],
        "command": job.get("command"),
        "live_writer": any(lk.live for lk in locks),
        "locks": [lk.describe() for lk in locks],
    }


def format_generation(g: dict) -> str:
    """`generation_status` for people."""
    locks = [f"lock       {lk}" for lk in g["locks"]] or ["lock       none (no generator running)"]
    return "\n".join(
        [
            f"generation {g['state']} -> {g['out']} ({'written' if g['out_written'] else 'not written yet'})",
            f"records    {g['done']}/{g['records']} done, {g['remaining']} remaining, {g['failed']} failed last session",
            f"model      {g['model']} at {g['endpoint']}, sampling {g['sampling']}",
            *locks,
        ]
    )


__all__ = [
    "GenerateConfig",
    "GenerateStopped",
    "generate",
    "generation_status",
    "state_dir",
    "asdict",
]
