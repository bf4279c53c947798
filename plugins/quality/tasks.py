"""lm-eval tasks over the shipped JSONL, and one benchmark run through them.

One ``ConfigurableTask`` per subject, as lm-eval's own ``mmlu`` and ``ceval-valid`` groups are
built, so that k-shot prompts take the subject's own first k dev items (``first_n``, the
canonical MMLU order). The prompt formats are lm-eval's standard ones:

* MMLU: "The following are multiple choice questions (with answers) about {subject}.\\n\\n",
  then "{question}\\nA. ..\\nB. ..\\nC. ..\\nD. ..\\nAnswer:" and the choices " A".." D".
* C-Eval: "以下是中国关于{科目}考试的单项选择题，请选出其中的正确答案。\\n\\n", then
  "{question}\\nA. ..\\nB. ..\\nC. ..\\nD. ..\\n答案：" and the choices " A".." D".

The datasets come from ``custom_dataset`` (an in-memory ``DatasetDict`` of the seeded subset),
so lm-eval never calls ``datasets.load_dataset``: no hub, no download, no cache directory.
"""

from __future__ import annotations

import contextlib
import io
import logging
import math
import os
import time
from typing import Any, Callable, Iterator

from autotune.metric import MetricValue
from autotune.scoring import Scorer

from autotune_plugins.quality import benchmarks
from autotune_plugins.quality.adapter import ScorerLM, require_lm_eval

__all__ = ["build_tasks", "evaluate_benchmark"]

LETTERS = ["A", "B", "C", "D"]
DESCRIPTIONS = {
    "mmlu": "The following are multiple choice questions (with answers) about {name}.\n\n",
    "ceval": "以下是中国关于{name}考试的单项选择题，请选出其中的正确答案。\n\n",
}
ANSWER_CUE = {"mmlu": "Answer:", "ceval": "答案："}


def _doc_to_text(cue: str) -> Callable[[dict[str, Any]], str]:
    def text(doc: dict[str, Any]) -> str:
        options = "".join(f"\n{letter}. {choice}" for letter, choice in zip(LETTERS, doc["choices"]))
        return f"{doc['question'].strip()}{options}\n{cue}"

    return text


@contextlib.contextmanager
def _quiet_lm_eval() -> Iterator[None]:
    """Silence lm-eval's per-task warnings and tqdm bars (104 of them per C-Eval run); the
    caller shows one progress bar of its own, on a console opened before this (errors still
    arrive as exceptions)."""
    logger = logging.getLogger("lm_eval")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        with contextlib.redirect_stderr(io.StringIO()):
            yield
    finally:
        logger.setLevel(level)


def build_tasks(benchmark: str, per_subject: int, shots: int, seed: int) -> dict[str, Any]:
    """lm-eval tasks by name (``autotune_<benchmark>_<subject>``) for a seeded subset."""
    require_lm_eval()
    # The tasks read in-memory tables; nothing may reach the hub even by accident (lm-eval
    # imports datasets, which would otherwise look for updates of cached builders).
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import datasets
    from lm_eval.api.task import ConfigurableTask

    b = benchmarks.BENCHMARKS[benchmark]
    if not 0 <= shots <= b.max_shots:
        raise benchmarks.AutotuneError(f"shots {shots}: {benchmark} ships {b.max_shots} dev items per subject (use 0..{b.max_shots})")
    items = benchmarks.subset(benchmark, per_subject, seed)
    dev = benchmarks.load_items(benchmark, "dev")
    names = benchmarks.subject_names(benchmark)
    columns = ("subject", "question", "choices", "answer")
    tasks = {}
    for subject, docs in items.items():
        def dataset(_docs=docs, _dev=dev.get(subject, []), **_: Any) -> Any:
            as_table = lambda rows: datasets.Dataset.from_dict({c: [r[c] for r in rows] for c in columns})
            return datasets.DatasetDict({"test": as_table(_docs), "dev": as_table(_dev)})

        name = f"autotune_{benchmark}_{subject}"
        tasks[name] = ConfigurableTask(config={
            "task": name,
            "custom_dataset": dataset,
            "test_split": "test",
            "fewshot_split": "dev",
            "fewshot_config": {"sampler": "first_n"},
            "num_fewshot": shots,
            "output_type": "multiple_choice",
            "description": DESCRIPTIONS[benchmark].format(name=names.get(subject, subject)),
            "doc_to_text": _doc_to_text(ANSWER_CUE[benchmark]),
            "doc_to_choice": LETTERS,
            "doc_to_target": "answer",
            "metric_list": [{"metric": "acc", "aggregation": "mean", "higher_is_better": True}],
            "metadata": {"version": 1.0},
        })
    return tasks


def evaluate_benchmark(
    scorer: Scorer,
    benchmark: str,
    *,
    per_subject: int,
    shots: int,
    seed: int,
    progress: Callable[[int, int], None] | None = None,
) -> MetricValue:
    """Accuracy of ``scorer``'s artifact on a seeded subset, through lm-eval.

    Args:
        scorer: The artifact, as its backend loads it.
        benchmark: ``mmlu`` or ``ceval``.
        per_subject: Items per subject (1..10).
        shots: Dev examples before each question (0..5).
        seed: Chooses the subset.
        progress: Called with (items done, items in all) after each batch of requests.

    Returns:
        Accuracy over all scored items, its standard error, ``n`` items and per-subject
        accuracies in ``details``. The standard error is that of a mean of n 0/1 outcomes,
        sqrt(p(1-p)/(n-1)) as lm-eval reports ``acc_stderr``: on 57 x 5 items a 30 % accuracy
        carries about 2.7 points, which is why a drop is reported with it.
    """
    from lm_eval.evaluator import evaluate

    started = time.monotonic()
    with _quiet_lm_eval():
        tasks = build_tasks(benchmark, per_subject, shots, seed)
    items = sum(len(t.eval_docs) for t in tasks.values())
    requests = 0

    def advance(n: int) -> None:
        # lm-eval asks one request per answer choice; a person counts questions.
        nonlocal requests
        requests += n
        if progress is not None:
            progress(requests // len(LETTERS), items)

    with _quiet_lm_eval():
        out = evaluate(ScorerLM(scorer, advance), tasks, log_samples=True, bootstrap_iters=0, verbosity="ERROR")
    per_subject_acc, correct = {}, []
    for name, samples in out["samples"].items():
        outcomes = [float(s["acc"]) for s in samples]
        correct += outcomes
        per_subject_acc[name.removeprefix(f"autotune_{benchmark}_")] = sum(outcomes) / len(outcomes)
    n = len(correct)
    acc = sum(correct) / n
    stderr = math.sqrt(acc * (1 - acc) / (n - 1)) if n > 1 else None
    return MetricValue(
        value=acc, stderr=stderr, n=n, seconds=time.monotonic() - started,
        details={"benchmark": benchmark, "shots": shots, "per_subject": per_subject, "seed": seed,
                 "subjects": per_subject_acc, "scorer": scorer.description},
    )
