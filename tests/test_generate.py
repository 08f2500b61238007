"""`eyas generate` against a real loopback server that fails on purpose: exactly once, in
input order, through SIGKILLs, SIGTERM, 500s, 429s, stalls and dropped connections."""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import eyas

from eyas.demo_target.data import generate_conversations

SERVER = Path(__file__).parent / "fault_server.py"


@contextlib.contextmanager
def fault_server(seed: int, delay: float = 0.0):
    """A fresh fault server: every request meets its injected faults anew."""
    cmd = [
        sys.executable,
        str(SERVER),
        "--seed",
        str(seed),
        "--stall",
        "0.8",
        "--delay",
        str(delay),
    ]
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    try:
        yield f"http://127.0.0.1:{int(p.stdout.readline().split()[1])}"
    finally:
        p.kill()
        p.wait()


@pytest.fixture(scope="module")
def server():
    with fault_server(3) as url:
        yield url


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> Path:
    convs = generate_conversations(24, seed=21)
    for i, c in enumerate(convs):  # some conversations with two assistant turns
        if i % 3 == 0:
            c["messages"] += [
                {"role": "user", "content": f"and again, {i}?"},
                {"role": "assistant", "content": "x"},
            ]
    p = tmp_path_factory.mktemp("gen") / "in.jsonl"
    lines = [json.dumps({**c, "id": f"r{i}"}) for i, c in enumerate(convs)]
    lines.insert(5, "{not json")
    lines.insert(15, json.dumps({"id": "lonely", "messages": [{"role": "user", "content": "hi"}]}))
    p.write_text("\n".join(lines) + "\n")
    return p


def _cmd(server: str, inputs: Path, out: Path, *extra) -> list[str]:
    return [sys.executable, "-m", "eyas.cli", "generate", "--endpoint", server, "--model", "target", "--data", str(inputs),
            "--out", str(out), "--concurrency", "4", "--timeout", "0.5", "--retries", "6", "--backoff", "0.05", "--turns", "all",
            *extra]  # fmt: skip


@pytest.fixture(scope="module")
def reference(server, inputs, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("gen-ref") / "out.jsonl"
    p = subprocess.run(_cmd(server, inputs, out), capture_output=True, text=True, timeout=600)
    assert p.returncode == 1 and "2 records failed" in p.stderr, (
        p.stderr
    )  # the two bad input records
    return out


def test_reference_output(reference, inputs):
    recs = [json.loads(x) for x in reference.read_text().splitlines()]
    assert [r["id"] for r in recs] == [f"r{i}" for i in range(24)]  # input order, each once
    for r in recs:
        assistant = [m["content"] for m in r["messages"] if m["role"] == "assistant"]
        assert assistant and all(a.startswith("target says") for a in assistant)
        g = r["generation"]
        assert (
            g["endpoint_model"] == "target"
            and g["temperature"] == 0.0
            and g["usage"]["completion_tokens"] > 0
        )
        assert g["truncated"] == ("length" in g["finish_reason"])
    assert any(r["generation"]["truncated"] for r in recs)  # cut by max_tokens: kept and marked
    errors = [
        json.loads(x)
        for x in (reference.parent / "out.jsonl.eyas-gen" / "errors.jsonl").read_text().splitlines()
    ]
    assert sorted(e["line"] for e in errors) == [6, 16] and {e["code"] for e in errors} == {
        "malformed-json",
        "no-assistant",
    }


def test_sigkill_at_random_moments_exactly_once(inputs, reference, tmp_path):
    out = tmp_path / "out.jsonl"
    rng = random.Random(5)
    with fault_server(5, delay=0.3) as server:  # slow enough that 10 kills land mid-job
        _kill_repeatedly(server, inputs, out, rng)
    assert out.read_bytes() == reference.read_bytes()
    log = [
        json.loads(x)
        for x in (tmp_path / "out.jsonl.eyas-gen" / "log.jsonl").read_text().splitlines()
        if x.strip()
    ]
    positions = [e["pos"] for e in log]
    assert len(positions) == len(set(positions)) == 24  # each record logged exactly once


def _kill_repeatedly(server: str, inputs: Path, out: Path, rng: random.Random) -> None:
    kills = 0
    for _ in range(60):
        p = subprocess.Popen(
            _cmd(server, inputs, out, "--concurrency", "2"),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        if kills >= 10:
            assert p.wait(timeout=600) == 1  # done; the two bad records fail as before
            break
        time.sleep(rng.uniform(0.3, 1.2))
        if p.poll() is None:
            os.kill(p.pid, signal.SIGKILL)
            kills += 1
        p.wait()
    assert kills >= 10


def test_sigterm_stops_cleanly_and_a_rerun_finishes(inputs, reference, tmp_path):
    out = tmp_path / "out.jsonl"
    log = tmp_path / "out.jsonl.eyas-gen" / "log.jsonl"
    with fault_server(9) as server:
        p = subprocess.Popen(
            _cmd(server, inputs, out), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        while p.poll() is None and not (log.exists() and log.read_bytes().count(b"\n") >= 3):
            time.sleep(0.01)
        p.send_signal(signal.SIGTERM)
        _, err = p.communicate(timeout=60)
        assert p.returncode == 75 and "Resume with the same command" in err, err
        assert not out.exists()
        st = eyas("status", out)
        assert st.returncode == 0 and "done" in st.stdout and "remaining" in st.stdout, st.stdout
        plan = json.loads(eyas("doctor", out, "--json").stdout)["plan"]
        assert plan[-1]["command"].startswith("eyas generate --endpoint"), plan
        assert subprocess.run(_cmd(server, inputs, out), capture_output=True).returncode == 1
    assert out.read_bytes() == reference.read_bytes()


def test_changed_settings_are_refused_and_the_key_is_never_written(server, inputs, tmp_path):
    out = tmp_path / "out.jsonl"
    env = {**os.environ, "MY_KEY": "sk-secret-4242"}
    p = subprocess.run(
        _cmd(server, inputs, out, "--api-key-env", "MY_KEY"),
        capture_output=True,
        text=True,
        env=env,
    )
    assert p.returncode == 1, p.stderr
    for f in [out, *out.parent.rglob("*")]:
        if f.is_file():
            assert b"sk-secret-4242" not in f.read_bytes(), f
    p = subprocess.run(
        _cmd(server, inputs, out, "--max-tokens", "7"), capture_output=True, text=True
    )
    assert p.returncode == 2 and "another sampling" in p.stderr, p.stderr


def test_bad_answers_are_per_record_errors(server, tmp_path):
    """Answers that are not usable completions fail their record (after retries), never the
    job; a trickling server is cut at --timeout for the whole request; an answer over
    --max-response-bytes is refused. The good records are written."""
    kinds = ["bad-utf8", "array", "choices-string", "usage-text", "surrogate", "trickle", "huge"]
    recs = [{"id": k, "messages": [{"role": "user", "content": f"HOSTILE:{k} please"},
                                   {"role": "assistant", "content": "x"}]} for k in kinds]  # fmt: skip
    recs.insert(3, {"id": "good", "messages": [{"role": "user", "content": "hello"},
                                               {"role": "assistant", "content": "x"}]})  # fmt: skip
    data = tmp_path / "in.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in recs))
    out = tmp_path / "out.jsonl"
    t0 = time.monotonic()
    cmd = [
        *_cmd(server, data, out)[:-2],
        "--timeout",
        "3",
        "--retries",
        "1",
        "--max-response-bytes",
        "1000000",
    ]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    took = time.monotonic() - t0
    assert p.returncode == 1 and "Traceback" not in p.stderr, p.stderr
    assert f"{len(kinds)} records failed" in p.stderr
    assert [json.loads(x)["id"] for x in out.read_text().splitlines()] == ["good"]
    errors = {e["id"]: e["reason"] for e in map(json.loads, (tmp_path / "out.jsonl.eyas-gen" / "errors.jsonl").read_text().splitlines())}  # fmt: skip
    assert set(errors) == set(kinds)
    assert "not UTF-8" in errors["bad-utf8"] and "JSON list" in errors["array"]
    assert "lone surrogate" in errors["surrogate"] and "token count" in errors["usage-text"]
    assert "within --timeout" in errors["trickle"] and "--max-response-bytes" in errors["huge"]
    assert took < 60  # two attempts of 3 s for the trickle, not minutes of one byte a second
    # A rerun retries only the failed records and ends the same way: the job can finish.
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert p.returncode == 1 and f"{len(kinds)} records failed" in p.stderr


def test_opening_assistant_turn_is_kept_and_reasoning_is_kept(server, tmp_path):
    recs = [
        {"id": "opens", "messages": [{"role": "assistant", "content": "Hi, I am the bot."},
                                     {"role": "user", "content": "hello"},
                                     {"role": "assistant", "content": "x"}]},
        {"id": "thinks", "messages": [{"role": "user", "content": "HOSTILE:think add"},
                                      {"role": "assistant", "content": "x"}]},
        {"id": "only-opening", "messages": [{"role": "assistant", "content": "Hi."}]},
    ]  # fmt: skip
    data = tmp_path / "in.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in recs))
    out = tmp_path / "out.jsonl"
    p = subprocess.run(_cmd(server, data, out), capture_output=True, text=True, timeout=120)
    assert p.returncode == 1 and "1 records failed" in p.stderr, (
        p.stderr
    )  # only-opening: nothing to do
    got = {r["id"]: r for r in map(json.loads, out.read_text().splitlines())}
    opens = got["opens"]
    assert opens["messages"][0] == {"role": "assistant", "content": "Hi, I am the bot."}
    assert opens["messages"][2]["content"].startswith("target says")
    assert opens["generation"]["kept_as_written"] == [0]
    turn = got["thinks"]["messages"][1]
    assert (
        turn["reasoning_content"] == "let me think"
        and turn["tool_calls"][0]["function"]["name"] == "add"
    )


def test_disk_full_is_exit_75(server, inputs, tmp_path):
    from conftest import mounted_tmpfs

    with mounted_tmpfs(tmp_path, "1m") as mnt:
        (mnt / "filler").write_bytes(b"\0" * (1024 * 1024 - 8192))
        p = subprocess.run(
            _cmd(server, inputs, mnt / "out.jsonl"), capture_output=True, text=True, timeout=300
        )
        assert p.returncode == 75 and "disk full" in p.stderr and "Traceback" not in p.stderr, (
            p.stderr
        )


def test_an_endpoint_nothing_answers_is_said_at_once(inputs, tmp_path):
    import socket

    with socket.socket() as s:  # a port that was free a moment ago: nothing listens there
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = tmp_path / "out.jsonl"
    p = subprocess.run(
        _cmd(f"http://127.0.0.1:{port}", inputs, out), capture_output=True, text=True, timeout=120
    )
    assert p.returncode == 2 and "connection refused" in p.stderr, p.stderr
    assert not out.exists() and not list(tmp_path.iterdir())  # nothing written


@contextlib.contextmanager
def _loopback(reply):
    """A loopback server answering each request body (parsed) with `reply(req)`: (status, body)."""
    import http.server
    import threading

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802 - the stdlib's name
            status, body = reply(
                json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))
            )
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *_):
            pass

    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    try:
        yield f"http://127.0.0.1:{srv.server_address[1]}"
    finally:
        srv.shutdown()
        srv.server_close()


def _refusing_server():
    """A server that answers every request with the same HTTP 404 (a model it does not serve)."""
    return _loopback(
        lambda _req: (404, b'{"error": {"message": "The model `target` does not exist."}}')
    )


def test_every_request_failing_alike_stops_the_job(inputs, tmp_path):
    """A server that refuses every request the same way: the job stops after a few records
    (exit 75, the reason named) instead of retrying all of them; the bar counts none as done."""
    out = tmp_path / "out.jsonl"
    with _refusing_server() as url:
        p = subprocess.run(_cmd(url, inputs, out, "--retries", "0"), capture_output=True, text=True,
                           timeout=300, env={**os.environ, "EYAS_LOG_EVERY": "0"})  # fmt: skip
    assert p.returncode == 75, p.stderr
    assert "the last 8 records all failed the same way" in p.stderr and "does not exist" in p.stderr
    assert "Resume with the same command" in p.stderr
    errors = (tmp_path / "out.jsonl.eyas-gen" / "errors.jsonl").read_text().splitlines()
    assert 8 <= sum('"request"' in e for e in errors) < 24  # the rest were never asked for
    assert "generate: 0/" in p.stderr and "pending" in p.stderr and "failed" in p.stderr
    assert not out.exists()


def test_a_target_served_without_chat_template(inputs, tmp_path):
    """A server whose target has no chat template refuses every chat request as vLLM does: the
    job stops with the way out named; with --chat-template FILE every request carries the
    file's text (vLLM's per-request `chat_template`) and the job completes."""
    template = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    seen: list[str | None] = []

    def reply(req):
        seen.append(req.get("chat_template"))
        if not req.get("chat_template"):
            return 400, b'{"error": {"message": "default chat template is no longer allowed"}}'
        msg = {"role": "assistant", "content": "ok"}
        return 200, json.dumps({"choices": [{"message": msg, "finish_reason": "stop"}],
                                "usage": {"prompt_tokens": 3, "completion_tokens": 1}}).encode()  # fmt: skip

    (tmp_path / "chat.jinja").write_text(template)
    with _loopback(reply) as url:
        p = subprocess.run(_cmd(url, inputs, tmp_path / "a.jsonl", "--retries", "0"),
                           capture_output=True, text=True, timeout=300)  # fmt: skip
        assert p.returncode == 75, p.stderr
        assert "the server has no chat template" in p.stderr and "--chat-template FILE" in p.stderr
        seen.clear()
        p = subprocess.run(_cmd(url, inputs, tmp_path / "b.jsonl", "--chat-template", tmp_path / "chat.jinja"),
                           capture_output=True, text=True, timeout=300)  # fmt: skip
    assert p.returncode == 1 and "2 records failed" in p.stderr, (
        p.stderr
    )  # the two bad input records
    assert seen and set(seen) == {template}
    made = json.loads((tmp_path / "b.jsonl.eyas-gen" / "generate.json").read_text())
    assert made["sampling"]["chat_template"]


def test_every_name_of_the_resume_rule_is_in_what_generate_writes(reference):
    """generate's resume rule names fields of the generate.json it writes (a field renamed
    there but not in the rule would silently become fixed, or never be checked), and every
    field it writes is under the rule: fixed, may change, or per invocation."""
    from eyas.stages.generate import RESUME_RULE

    written = json.loads((reference.parent / "out.jsonl.eyas-gen" / "generate.json").read_text())
    named = RESUME_RULE.may_change | RESUME_RULE.per_invocation
    assert named <= written.keys(), sorted(named - written.keys())
    # the rest is fixed by the job: another value is refused naming it (a new field must
    # be placed under the rule on purpose, which this list makes someone do)
    assert written.keys() - named == {"model", "data_fingerprint", "sampling"}
