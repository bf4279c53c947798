"""What the report and the dashboard notes say and how they are laid out, without a browser
(tests/test_browser.py measures the pages themselves): the objective in words, a failed study's
causes first, no plot without data, memory axes in the data's unit, notes that wrap."""

from __future__ import annotations

from autotune.report import html as report_html
from autotune.report.dashboard import _wrapped, note_markdown, trial_card
from autotune.study.objective import objective_words
from autotune.study.records import TrialRecord, TrialState
from autotune.study.summary import StudySummary

MIB, GIB = 2**20, 2**30


def _record(number, state=TrialState.COMPLETE, tok_s=None, measured=None, predicted=None, **kw) -> TrialRecord:
    metrics = {} if tok_s is None else {"aggregate_tok_s": {"median": tok_s}, "per_user_tok_s": {"median": tok_s}}
    return TrialRecord(
        number=number,
        state=state,
        values=(tok_s,) if tok_s else None,
        constraints={},
        raw={},
        config={"backend": "b", "weights": "w", "ctx": 512, "parallel": 1 + number % 2},
        metrics=metrics,
        measured_vram_bytes=measured,
        predicted_vram=None if predicted is None else {"total_bytes": predicted},
        **kw,
    )


def _summary(best=None, **extra) -> StudySummary:
    return StudySummary("s", "sqlite:///s.db", 3, 0, 3, 0, 0, 0, False, 0.0, best=best, extra=extra)


def test_the_objective_is_said_in_words():
    assert (
        objective_words(
            {
                "metric": "aggregate_tok_s",
                "min_per_user_tok_s": 10.0,
                "quality": None,
                "penalty_per_point": 0.0,
                "mode": "single",
            }
        )
        == "maximise aggregate tok/s, per-user at least 10 tok/s"
    )
    words = objective_words(
        {
            "metric": "aggregate_tok_s",
            "quality": "mmlu",
            "penalty_per_point": 1.0,
            "max_drop_points": 2.0,
            "reference_weights": "gguf:F16",
        }
    )
    assert (
        words == "maximise aggregate tok/s, less 1 per point of mmlu drop against gguf:F16, "
        "mmlu drop at most 2 points against gguf:F16"
    )
    assert "mmlu measured, not counted" in objective_words({"quality": "mmlu", "penalty_per_point": 0.0})
    assert objective_words({"mode": "pareto", "quality": "kld"}).startswith("the trade-off of aggregate tok/s")
    assert objective_words({"metric": "decode_tok_s", "ttft_p95_ms": 500}) == "maximise decode tok/s, ttft_p95_ms = 500"
    # latency targets as the study stores them ([objective] ttft_p95_ms...: Objective.slo), and one point
    assert (
        objective_words(
            {
                "metric": "goodput_tok_s",
                "slo": [["ttft_p95_ms", 150.0], ["itl_p99_ms", 20.0]],
                "quality": "kld",
                "max_drop_points": 1.0,
            }
        )
        == "maximise goodput tok/s, kld drop at most 1 point, TTFT p95 at most 150 ms, ITL p99 at most 20 ms"
    )


def test_a_small_models_memory_axis_is_in_mib_and_spans_its_points():
    rows = [_record(0, tok_s=900.0, measured=38 * MIB, predicted=40 * MIB), _record(1, tok_s=1200.0, measured=52 * MIB)]
    fig = report_html._vram(rows, budget=17 * GIB)
    assert fig.layout.xaxis.title.text == "memory (MiB)"
    xs = [x for trace in fig.data for x in trace.x]
    assert min(xs) == 38.0 and max(xs) == 52.0
    assert not fig.layout.shapes and "17.00 GiB, lies far beyond them" in fig.layout.title.text
    big = report_html._vram([_record(0, tok_s=30.0, measured=12 * GIB)], budget=14 * GIB)
    assert big.layout.xaxis.title.text == "memory (GiB)" and big.layout.shapes[0].x0 == 14.0  # the budget drawn


def test_no_plot_is_drawn_without_a_measured_trial():
    failed = [
        _record(i, TrialState.FAIL, predicted=GIB, fail_reason="engine exited with code 1: boom") for i in range(3)
    ]
    assert report_html._knee(failed, None) is None and report_html._vram(failed, 14 * GIB) is None


def test_a_failed_studys_causes_are_counted_most_common_first_and_long_ones_collapsed():
    long = (
        "making gguf:Q4_0 from /m/x failed: Traceback (most recent call last):\n"
        + "  File x.py\n" * 40
        + "NotImplementedError: BPE pre-tokenizer was not recognized"
    )
    rows = [
        _record(0, TrialState.FAIL, fail_reason="CUDA error: out of memory allocating 512 MiB"),
        *(_record(i, TrialState.FAIL, fail_reason=long.replace("/m/x", f"/m/{i}")) for i in (1, 2, 3)),
        _record(4, TrialState.PRUNED, prune_reason="does not fit: needs 20 GiB > budget 14 GiB"),
    ]
    html = report_html._causes(rows, _summary())
    first, second, third = (
        html.index("3 failed: making gguf"),
        html.index("1 failed: out of memory"),
        html.index("1 not launched: does not fit"),
    )
    assert first < second < third and "(trials 1, 2, 3)" in html
    assert "<details><summary>" in html and "BPE pre-tokenizer was not recognized</summary>" in html
    assert report_html._causes(rows[:1], _summary(best={"number": 9})).count("<li>") == 1  # prunes only without a best
    assert report_html._causes([_record(0, tok_s=1.0)], _summary()) == ""


def test_the_study_note_wraps_its_text_and_keeps_commands_in_short_code_lines():
    command = "llama-server -m /models/" + "m" * 40 + ".gguf -c 4096 -np 4 --host 127.0.0.1 --port 8080  # a note"
    text = (
        "study s (sqlite:///s.db): 3 trials\nbest (trial 2): ctx=4096, cache_type=q8_0\n  deploy: "
        + command
        + "\n  1. not a list, *not emphasis*\nwhy the search ended: stopped: "
        + "h" * 120
    )
    md = note_markdown(text, [command])
    assert "cache\\_type" in md and "\\*not emphasis\\*" in md and "- 1\\. not a list" in md
    code = md.split("```")[1::2]  # the fenced blocks
    assert [line.strip() for line in code[0].strip().splitlines()] == [line.strip() for line in _wrapped(command)]
    assert code[1].count("h") == 120 and max(len(line) for block in code for line in block.splitlines()) <= 80
    prose = "".join(md.split("```")[0::2])
    assert max(len(word) for word in prose.split()) <= 80  # every word outside a block can wrap


def test_a_trial_note_puts_a_long_reason_in_a_block_of_short_lines():
    reason = "engine exited with code 1: chkhsh=" + "0123456789abcdef" * 6
    card = trial_card(_record(0, TrialState.FAIL, fail_reason=reason))
    assert "- **failed**:" in card and max(len(line) for line in card.splitlines()) <= 80
    assert "".join(card.split("```")[1].split()) == "".join(reason.split())  # the whole reason, only cut
    assert "- **failed**: CUDA error" in trial_card(_record(0, TrialState.FAIL, fail_reason="CUDA error"))
