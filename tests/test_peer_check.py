"""bench/peer_check.py: the figures both clients are compared on, and autotune's side of it (the
adapter over today's client) against a fake OpenAI server whose timing is known."""

from __future__ import annotations

import importlib.util
import json
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from tests.conftest import REPO

spec = importlib.util.spec_from_file_location("peer_check", REPO / "bench" / "peer_check.py")
peer_check = importlib.util.module_from_spec(spec)
sys.modules["peer_check"] = peer_check  # dataclasses look their module up by name
spec.loader.exec_module(peer_check)

FIRST_S, GAP_S = 0.05, 0.01  # the fake server's prefill and its gap between tokens


def test_summarize_defines_itl_over_the_tokens_after_the_first():
    r = peer_check.RequestRecord
    records = [
        r(0.0, 0.1, 1.0, 128, 10),  # 9 gaps in 0.9 s: 100 ms
        r(1.0, 1.3, 2.3, 128, 11),
    ]  # 10 gaps in 1.0 s: 100 ms
    s = peer_check.summarize(records)
    assert s["ttft_ms_mean"] == pytest.approx(200.0)
    assert s["ttft_ms_p50"] == pytest.approx(200.0)
    assert s["itl_ms_mean"] == pytest.approx(100.0)
    assert s["output_tok_s"] == pytest.approx(21 / 2.3)
    assert s["request_s"] == pytest.approx(2 / 2.3)


def test_percentile_interpolates_as_numpy():
    assert peer_check.percentile([1, 2, 3, 4], 50) == 2.5
    assert peer_check.percentile([1, 2, 3, 4], 99) == pytest.approx(3.97)


class Fake(BaseHTTPRequestHandler):
    bodies: list[dict] = []

    def log_message(self, *args):
        pass

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if self.path == "/tokenize":
            data = json.dumps({"tokens": list(range(1, 41))}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
            return
        Fake.bodies.append(body)
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        time.sleep(FIRST_S)
        for i in range(body["max_tokens"]):
            if i:
                time.sleep(GAP_S)
            self.wfile.write(f"data: {json.dumps({'choices': [{'text': 'x'}]})}\n\n".encode())
            self.wfile.flush()
        usage = {"prompt_tokens": len(body["prompt"]), "completion_tokens": body["max_tokens"]}
        self.wfile.write(f"data: {json.dumps({'choices': [], 'usage': usage})}\n\ndata: [DONE]\n\n".encode())


@pytest.fixture()
def fake_server():
    Fake.bodies = []
    server = ThreadingHTTPServer(("127.0.0.1", 0), Fake)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def test_autotune_adapter_sends_the_workload_and_times_each_request(fake_server):
    workload = peer_check.Workload(prompt_tokens=24, output_tokens=6)
    records = peer_check.AutotuneStreams().run(fake_server, "m", workload, concurrency=2, count=5)
    assert len(records) == 5  # rounds of 2, 2, 1 after a warm-up round of 2
    sent = Fake.bodies[2:]
    assert len(sent) == 5 and all(b["max_tokens"] == 6 and b["ignore_eos"] and b["cache_prompt"] is False for b in sent)
    assert all(len(b["prompt"]) == 24 for b in sent)
    assert len({tuple(b["prompt"]) for b in Fake.bodies}) == len(Fake.bodies)  # no prompt sent twice
    s = peer_check.summarize(records)
    assert s["output_tokens_min"] == s["output_tokens_max"] == 6
    assert s["ttft_ms_p50"] >= FIRST_S * 1000
    assert s["itl_ms_p50"] >= GAP_S * 1000


def test_aiperf_records_keep_the_timed_phase_and_leave_failures_out(tmp_path):
    def line(phase: str, start_ns: int, ttft_ms: float | None, error: dict | None = None) -> str:
        metrics = {"input_sequence_length": {"value": 128}, "output_sequence_length": {"value": 64}}
        if ttft_ms is not None:
            metrics["time_to_first_token"] = {"value": ttft_ms}
        rec = {
            "metadata": {
                "benchmark_phase": phase,
                "request_start_ns": start_ns,
                "request_end_ns": start_ns + 2_000_000_000,
            },
            "metrics": metrics,
        }
        if error:
            rec["error"] = error
        return json.dumps(rec)

    path = tmp_path / "profile_export.jsonl"
    path.write_text(
        "\n".join(
            [
                line("warmup", 0, 100.0),
                line("profiling", 10**9, 250.0),
                line("profiling", 2 * 10**9, None, {"type": "ClientOSError"}),
            ]
        )
        + "\n"
    )
    errors: list = []
    records = peer_check.aiperf_records(path, errors)
    assert records == [peer_check.RequestRecord(1.0, 1.25, 3.0, 128, 64)]
    assert errors == [{"type": "ClientOSError"}]
