"""Traffic (issue 29): length distributions, closed- and open-loop load, latency percentiles,
goodput and the latency targets, from the study file to the twin's study."""

from __future__ import annotations

import statistics
import threading
import time
from pathlib import Path

import optuna
import pytest

from autotune.study import objective as objective_mod
from autotune.config import Objective, load_study_config
from autotune.errors import ConfigError
from autotune.measure import ConcurrentResult, StreamResult, serving_run
from autotune.measure.load import latency_metrics, meets, poisson_arrivals, request_latencies, run_requests, search_rate
from autotune.engine.workload import PRESETS, FIRST_RUN_REQUEST, Workload, WorkloadSpec, draw, percentile, read_lengths

# A small twin study: one engine, a handful of configurations, no quality metric.
STUDY = """
[study]
name = "{name}"
seed = 3
n_trials = {trials}
finish_top = 0
baseline = false
[hardware]
gpu = "h200"
[model]
ref = "qwen2.5-7b"
[workload]
{workload}
[[candidates]]
backend = "twin-llama.cpp"
weights = ["gguf:Q4_K_M"]
[space]
ctx = [16384]
parallel = [1, 2, 4, 8, 16, 32]
[objective]
{objective}
"""


def study_file(tmp_path: Path, workload: str, objective: str = "", name: str = "w", trials: int = 6) -> Path:
    path = tmp_path / f"{name}.toml"
    path.write_text(STUDY.format(name=name, trials=trials, workload=workload, objective=objective), encoding="utf-8")
    return path


def stream(start: float, ttft_s: float, out: int, decode_s: float, prompt: int = 10) -> StreamResult:
    return StreamResult.from_timestamps(prompt, out, start, start + ttft_s, start + ttft_s + decode_s)


# ------------------------------------------------------------------ lengths


def test_lengths_are_read_from_jsonl_and_csv(tmp_path):
    (tmp_path / "a.jsonl").write_text(
        '{"prompt_tokens": 12, "output_tokens": 3}\n\n{"prompt_tokens": 7, "output_tokens": 40, "id": "x"}\n',
        encoding="utf-8",
    )
    (tmp_path / "a.csv").write_text("id,prompt_tokens,output_tokens\nq1,12,3\nq2,7,40\n", encoding="utf-8")
    assert read_lengths(tmp_path / "a.jsonl") == read_lengths(tmp_path / "a.csv") == [(12, 3), (7, 40)]


@pytest.mark.parametrize(
    "name, text, expected",
    [
        (
            "b.jsonl",
            '{"prompt_tokens": 12, "output_tokens": 3}\n{"prompt_tokens": 0, "output_tokens": 3}\n',
            "b.jsonl: line 2: prompt_tokens = 0: must be an integer from 1 to 10,000,000",
        ),
        (
            "b.jsonl",
            '{"prompt_tokens": 12}\n',
            "b.jsonl: line 1: output_tokens = missing: must be an integer from 1 to 10,000,000",
        ),
        ("b.jsonl", '{"prompt_tokens": 12, "output_tokens": 3}\nnot json\n', "b.jsonl: line 2: not JSON"),
        ("b.jsonl", "[12, 3]\n", "b.jsonl: line 1: a JSON list, not an object"),
        ("b.csv", "prompt,output_tokens\n1,2\n", "b.csv: line 1: the header lacks prompt_tokens"),
        ("b.csv", "prompt_tokens,output_tokens\n1,2\n3,x\n", "b.csv: line 3: output_tokens = 'x'"),
        ("b.txt", "1 2\n", "unknown kind of file '.txt': give a .jsonl"),
        ("b.jsonl", "\n", "no requests in it"),
    ],
)
def test_a_bad_lengths_file_names_the_file_line_and_field(tmp_path, name, text, expected):
    (tmp_path / name).write_text(text, encoding="utf-8")
    with pytest.raises(ValueError) as err:
        read_lengths(tmp_path / name, name)
    assert expected in str(err.value)


def test_presets_are_seeded_and_the_chat_means_are_the_published_ones():
    spec = WorkloadSpec(profile="chat", requests=20000)
    a, b = draw(spec, 1, Path(".")), draw(spec, 1, Path("."))
    assert a == b and a != draw(spec, 2, Path("."))
    # ShareGPT's means as Kwon et al. give them (161.31 in, 337.99 out): clipping takes a little off.
    assert statistics.fmean(p for p, _ in a) == pytest.approx(161.31, rel=0.05)
    assert statistics.fmean(o for _, o in a) == pytest.approx(337.99, rel=0.05)
    for name, preset in PRESETS.items():
        drawn = draw(WorkloadSpec(profile=name, requests=500), 0, Path("."))
        assert all(preset.low <= x <= preset.high for pair in drawn for x in pair), name
        assert preset.source  # each says where its shape comes from


def test_rag_prompts_are_longer_and_answers_shorter_than_chat():
    rag, chat = (draw(WorkloadSpec(profile=p, requests=400), 0, Path(".")) for p in ("rag", "chat"))
    assert statistics.median(p for p, _ in rag) > 5 * statistics.median(p for p, _ in chat)
    assert statistics.median(o for _, o in rag) < statistics.median(o for _, o in chat)


# ------------------------------------------------------------------ the study file


def test_a_profile_and_targets_in_the_study_file(tmp_path):
    cfg = load_study_config(
        study_file(
            tmp_path,
            'profile = "rag"\nrequests = 12\narrival = "poisson"\nrate = 0.5',
            "ttft_p95_ms = 800\nitl_p50_ms = 40",
        )
    )
    assert len(cfg.requests) == 12 and cfg.workload.arrival == "poisson" and cfg.workload.rate == 0.5
    assert cfg.prompt_tokens == round(statistics.fmean(p for p, _ in cfg.requests))
    assert cfg.objective.slo == (("ttft_p95_ms", 800.0), ("itl_p50_ms", 40.0))
    assert cfg.objective.metric == "goodput_tok_s"  # the default once targets are set


def test_a_lengths_file_is_relative_to_the_study_file(tmp_path):
    (tmp_path / "mine.csv").write_text("prompt_tokens,output_tokens\n100,20\n300,60\n", encoding="utf-8")
    cfg = load_study_config(study_file(tmp_path, 'file = "mine.csv"\nrequests = 8'))
    assert len(cfg.requests) == 8 and set(cfg.requests) <= {(100, 20), (300, 60)}


@pytest.mark.parametrize(
    "workload, objective, expected",
    [
        ('profile = "chat"\nfile = "x.csv"', "", "[workload] profile = 'chat': and file = 'x.csv' are both set"),
        ('profile = "chat"\nprompt_tokens = 10', "", "[workload] prompt_tokens = 10: set beside profile"),
        ('profile = "chatty"', "", "[workload] profile = 'chatty': must be one of chat, rag, code, batch"),
        ("prompt_tokens = 10", "", "[workload] output_tokens = (missing): required"),
        (
            'prompt_tokens = 10\noutput_tokens = 5\narrival = "poisson"',
            "",
            "[workload] rate = (missing): required with",
        ),
        ("prompt_tokens = 10\noutput_tokens = 5\nrate = 2.0", "", "[workload] rate = 2.0: is for arrival = 'poisson'"),
        ("prompt_tokens = 10\noutput_tokens = 5\nrequests = 9", "", "[workload] requests = 9: is for a length"),
        ("prompt_tokens = 10\noutput_tokens = 5\nburst = 9", "", "[workload] burst: unknown field"),
        ('file = "none.jsonl"', "", "[workload] file = 'none.jsonl': none.jsonl: no such file"),
        ("prompt_tokens = 10\noutput_tokens = 5", "ttft_p95_ms = -1", "[objective] ttft_p95_ms = -1: must be 0.1.."),
        ("prompt_tokens = 10\noutput_tokens = 5", "ttft_p90_ms = 100", "[objective] ttft_p90_ms: unknown field"),
    ],
)
def test_bad_workload_keys_are_named(tmp_path, workload, objective, expected):
    with pytest.raises(ConfigError) as err:
        load_study_config(study_file(tmp_path, workload, objective))
    assert expected in str(err.value)


def test_a_bad_line_of_the_lengths_file_is_a_study_file_error(tmp_path):
    (tmp_path / "l.jsonl").write_text('{"prompt_tokens": 5, "output_tokens": 2.5}\n', encoding="utf-8")
    with pytest.raises(ConfigError) as err:
        load_study_config(study_file(tmp_path, 'file = "l.jsonl"'))
    assert "w.toml: [workload] file = 'l.jsonl': l.jsonl: line 1: output_tokens = 2.5: must be an integer" in str(
        err.value
    )


# ------------------------------------------------------------------ latencies and goodput


def test_percentiles_and_goodput_of_known_requests():
    # Four requests, TTFT 0.1..0.4 s, 11 tokens each decoded at 100 tok/s (ITL 10 ms).
    run = ConcurrentResult(tuple(stream(0.0, 0.1 * (k + 1), 11, 0.1) for k in range(4)), 0.5)
    m = latency_metrics(run, (("ttft_p95_ms", 250.0),))
    assert m["ttft_p50_ms"] == pytest.approx(250.0) and m["ttft_p99_ms"] == pytest.approx(397.0)
    assert m["itl_p95_ms"] == pytest.approx(10.0) and m["e2e_p50_ms"] == pytest.approx(350.0)
    assert m["goodput_req_s"] == pytest.approx(2 / 0.5) and m["goodput_tok_s"] == pytest.approx(22 / 0.5)
    # Without targets every request counts: goodput is the throughput.
    assert latency_metrics(run)["goodput_tok_s"] == pytest.approx(run.aggregate_tok_s)


def test_a_request_meets_the_loosest_bound_of_each_latency_and_the_per_user_floor():
    r = request_latencies(stream(0.0, 0.3, 11, 0.2))  # TTFT 300 ms, ITL 20 ms, 50 tok/s
    assert meets(r, (("ttft_p50_ms", 200.0), ("ttft_p99_ms", 400.0)))
    assert not meets(r, (("ttft_p99_ms", 250.0),))
    assert not meets(r, (("itl_p95_ms", 15.0),))
    assert meets(r, (("min_per_user_tok_s", 40.0),)) and not meets(r, (("min_per_user_tok_s", 60.0),))
    assert percentile([5.0], 99) == 5.0


def test_latency_targets_are_constraints():
    obj = Objective(metric="goodput_tok_s", slo=(("ttft_p95_ms", 500.0),))
    ok = objective_mod.score(obj, 10.0, 1, 2, None, latencies={"ttft_p95_ms": 400.0})
    late = objective_mod.score(obj, 12.0, 1, 2, None, latencies={"ttft_p95_ms": 750.0})
    assert ok.feasible and ok.constraints["slo_ttft_p95_ms"] == pytest.approx(-0.2)
    assert not late.feasible and late.constraints["slo_ttft_p95_ms"] == pytest.approx(0.5)
    assert not objective_mod.score(obj, 12.0, 1, 2, None).feasible  # not measured: not met
    assert objective_mod.unmeasured_constraints(obj)["slo_ttft_p95_ms"] == 0.0


# ------------------------------------------------------------------ the load generator


def test_closed_loop_keeps_the_concurrency_and_sends_every_request_once():
    lock, in_flight, peak, sent = threading.Lock(), [0], [0], []

    def send(i: int) -> StreamResult:
        with lock:
            in_flight[0] += 1
            peak[0] = max(peak[0], in_flight[0])
            sent.append(i)
        start = time.monotonic()
        time.sleep(0.01)
        with lock:
            in_flight[0] -= 1
        return StreamResult.from_timestamps(5, 2, start, start, time.monotonic())

    result = run_requests(send, range(100, 111), 30, concurrency=3)
    assert sorted(sent) == list(range(100, 111)) and peak[0] <= 3
    assert [s.prompt_tokens for s in result.streams] == [5] * 11


def test_open_loop_sends_each_request_at_its_arrival_and_is_seeded():
    times = poisson_arrivals(6, 20.0, 1)
    assert times == poisson_arrivals(6, 20.0, 1) and times != poisson_arrivals(6, 20.0, 2) and times[0] == 0.0
    t0 = time.monotonic()
    result = run_requests(
        lambda i: StreamResult.from_timestamps(1, 1, time.monotonic(), time.monotonic(), time.monotonic()),
        range(6),
        30,
        arrivals=times,
    )
    assert all(s.start_s >= t0 + a for s, a in zip(result.streams, times))


def test_a_failed_request_fails_the_load():
    def send(i: int) -> StreamResult:
        raise RuntimeError(f"engine died on {i}")

    with pytest.raises(RuntimeError, match="engine died"):
        run_requests(send, range(4), 30, concurrency=2)


def test_rate_search_finds_the_highest_rate_within_the_targets():
    # A queue whose p95 TTFT grows with the rate and passes 1 s at 3.7 requests/s.
    def measure(rate: float) -> dict[str, float]:
        return {"ttft_p95_ms": 100.0 / max(1e-9, 1 - rate / 4.1)}

    best, tried = search_rate(measure, (("ttft_p95_ms", 1000.0),), 0.5, 8.0, steps=8)
    assert best is not None and 3.65 <= best <= 3.69 and tried[0] == (8.0, False)
    assert search_rate(measure, (("ttft_p95_ms", 10.0),), 0.5, 8.0)[0] is None


def test_a_shaped_run_sends_the_drawn_requests_in_order_at_the_slots():
    wl = Workload(50, 10, requests=((20, 4), (80, 16), (50, 10)), seed=1)
    seen: list[tuple[int, int]] = []

    def send(i: int) -> StreamResult:
        p, o = wl.request(i)
        seen.append((i, p))
        now = time.monotonic()
        return StreamResult.from_timestamps(p, o, now, now, now + 0.001 * o)

    run_once = serving_run(send, send, 2, 30, workload=wl)
    m1, m2 = run_once(), run_once()
    alone = [p for i, p in seen if i < FIRST_RUN_REQUEST]
    assert alone == [50, 50]  # the typical request, each run
    runs = [sorted(p for i, p in seen if i >= FIRST_RUN_REQUEST and (i // 3) == FIRST_RUN_REQUEST + k) for k in (0, 1)]
    assert runs == [[20, 50, 80], [20, 50, 80]]
    assert set(m1) == set(m2) and m1["goodput_tok_s"] > 0


# ------------------------------------------------------------------ the twin, end to end


def test_the_twin_serves_a_distribution_request_by_request():
    from autotune_plugins.twin.traffic import simulate

    step = lambda n: 0.01 * (1 + 0.1 * n)  # noqa: E731 - a step of n streams
    one_slot = simulate([(100, 5), (100, 5)], 1, 1000.0, step, concurrency=2)
    # One slot: the second request waits for the first's whole answer before its prefill.
    assert one_slot[1].ttft_ms == pytest.approx(one_slot[0].ttft_ms + 4 * 11 + 100 + 11, rel=1e-6)
    spaced = simulate([(100, 5), (100, 5)], 4, 1000.0, step, arrivals=[0.0, 10.0])
    assert spaced[0].ttft_ms == pytest.approx(spaced[1].ttft_ms) and spaced[1].start_s == 10.0


def test_a_twin_study_under_a_ttft_target_gives_up_throughput_for_it(tmp_path, twin_plugin):
    from autotune.study import records, run_study

    def best(path: Path):
        summary = run_study(load_study_config(path), storage=f"sqlite:///{tmp_path / path.stem}.db")
        study = optuna.load_study(study_name=path.stem, storage=f"sqlite:///{tmp_path / path.stem}.db")
        return summary.best, study

    workload = 'profile = "rag"\nrequests = 24'
    free, study = best(study_file(tmp_path, workload, name="free"))
    bound, bound_study = best(study_file(tmp_path, workload, "ttft_p95_ms = 1500", name="bound"))
    # Every trial records its percentiles, with targets or without.
    measured = records.measured(study) + records.measured(bound_study)
    assert measured and all(
        {"ttft_p95_ms", "itl_p99_ms", "e2e_p50_ms", "goodput_tok_s"} <= set(r.metrics) for r in measured
    )
    assert bound["metrics"]["ttft_p95_ms"] <= 1500
    assert free["metrics"]["ttft_p95_ms"] > 1500  # the unconstrained winner misses the target...
    assert bound["params"]["parallel"] < free["params"]["parallel"]  # ...by taking more users at once
    assert bound["metrics"]["aggregate_tok_s"] < free["metrics"]["aggregate_tok_s"]
    # The report's latency section: the winner under the target, the fastest without it, the cost.
    from autotune.report.html import render
    from autotune.study import summarize

    page = render(bound_study, summarize(bound_study, "x"))
    assert 'id="plot-slo"' in page and f"Winner under the targets (by goodput_tok_s): trial {bound['number']}" in page
    assert "(misses ttft_p95_ms). What the targets cost:" in page
    assert "plot-slo" not in render(study, summarize(study, "x"))  # no targets, no section


def test_rate_search_keys(tmp_path):
    cfg = load_study_config(
        study_file(tmp_path, 'profile = "chat"\narrival = "poisson"\nrate_search = [0.5, 16]', "ttft_p95_ms = 500")
    )
    assert cfg.workload.rate_search == (0.5, 16.0) and cfg.objective.metric == "rate_req_s"
    for workload, objective, expected in [
        (
            'profile = "chat"\narrival = "poisson"\nrate_search = [0.5, 16]',
            "",
            "[workload] rate_search needs latency targets in [objective]",
        ),
        (
            'profile = "chat"\narrival = "poisson"\nrate = 1.0\nrate_search = [0.5, 16]',
            "ttft_p95_ms = 500",
            "[workload] rate_search = [0.5, 16]: and rate = 1.0 are both set",
        ),
        (
            'profile = "chat"\narrival = "poisson"\nrate_search = [16, 0.5]',
            "ttft_p95_ms = 500",
            "[workload] rate_search = [16, 0.5]: must be [low, high]",
        ),
    ]:
        with pytest.raises(ConfigError) as err:
            load_study_config(study_file(tmp_path, workload, objective))
        assert expected in str(err.value)


def test_the_twin_finds_the_highest_rate_within_the_target(twin_plugin):
    from dataclasses import replace

    from autotune.engine.backend import StudyContext, TrialConfig
    from autotune.hardware.gpus import get_gpu
    from autotune.measure import Protocol
    from autotune.modelfiles.models import get_model
    from autotune_plugins.twin import TwinLlamaCpp, load_constants, traffic

    wl = Workload(
        2000,
        150,
        requests=draw(WorkloadSpec(profile="rag", requests=24), 0, Path(".")),
        arrival="poisson",
        rate_search=(0.25, 40.0),
        slo=(("ttft_p95_ms", 2000.0),),
    )
    ctx = StudyContext(
        gpu=get_gpu("h200"),
        model=get_model("qwen2.5-7b"),
        workload=wl,
        vram_budget_bytes=100 * 2**30,
        protocol=Protocol(warmup_runs=0, min_runs=1, max_runs=1),
    )
    twin = TwinLlamaCpp()
    config = TrialConfig(twin.name, "gguf:Q4_K_M", 16384, 8, (("flash_attn", True),))
    m = twin.run(config, ctx)
    found = m.metrics["rate_req_s"].median
    assert 0.25 < found < 40.0 and m.metrics["ttft_p95_ms"].median <= 2000.0
    # Just above the rate found, the same requests miss the target.
    scenario, (k, host) = twin.scenario(config, ctx), (twin.constants(), load_constants()[1])
    above, _ = traffic.predicted_run(scenario, k, host, replace(wl, rate_search=None, rate=found + 40.0 / 2**5))
    assert latency_metrics(above)["ttft_p95_ms"] > 2000.0


@pytest.mark.parametrize(
    "ttft_s, expected_rate, loads", [(0.0, 1000.0, 2), (0.5, 0.0, 3)], ids=["every-rate-meets", "none-meets"]
)
def test_a_runs_rate_search_then_measures_at_the_rate_found(ttft_s, expected_rate, loads):
    wl = Workload(
        8, 2, requests=((8, 2),) * 4, arrival="poisson", rate_search=(100.0, 1000.0), slo=(("ttft_p95_ms", 100.0),)
    )
    sent: list[int] = []

    def send(i: int) -> StreamResult:
        sent.append(i)
        now = time.monotonic()
        return StreamResult.from_timestamps(8, 2, now - ttft_s - 0.001, now - 0.001, now)

    wrapped: list[int] = []

    def around(streams):
        wrapped.append(len(sent))
        return streams()

    m = serving_run(send, send, 2, 30, workload=wl, around_streams=around)()
    # The search's loads (high first; then low when high missed), then the run at the rate found
    # (the range's low end when none met), alone inside the backend's hook.
    assert len(sent) == 1 + 4 * loads and wrapped == [1 + 4 * (loads - 1)]
    assert m["rate_req_s"] == expected_rate
