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

from autotune.api import MetricValue
from autotune._builtin import Scorer

from autotune_plugins.quality import benchmarks
from autotune_plugins.quality.adapter import ScorerLM, require_lm_eval

__all__ = ["build_tasks", "evaluate_benchmark", "evaluate_items"]

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
    return build_item_tasks(benchmark, benchmarks.subset(benchmark, per_subject, seed), shots)


def build_item_tasks(benchmark: str, items: dict[str, list[dict[str, Any]]], shots: int) -> dict[str, Any]:
    """lm-eval tasks by name (``autotune_<benchmark>_<subject>``) for the given items by subject."""
    require_lm_eval()
    # The tasks read in-memory tables; nothing may reach the hub even by accident (lm-eval
    # imports datasets, which would otherwise look for updates of cached builders).
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import datasets
    from lm_eval.api.task import ConfigurableTask

    b = benchmarks.BENCHMARKS[benchmark]
    if not 0 <= shots <= b.max_shots:
        raise benchmarks.AutotuneError(
            f"shots {shots}: {benchmark} ships {b.max_shots} dev items per subject (use 0..{b.max_shots})"
        )
    dev = benchmarks.load_items(benchmark, "dev")
    names = benchmarks.subject_names(benchmark)
    columns = ("subject", "question", "choices", "answer", "item")
    tasks = {}
    for subject, docs in items.items():

        def dataset(_docs=docs, _dev=dev.get(subject, []), **_: Any) -> Any:
            as_table = lambda rows: datasets.Dataset.from_dict({c: [r.get(c, -1) for r in rows] for c in columns})
            return datasets.DatasetDict({"test": as_table(_docs), "dev": as_table(_dev)})

        name = f"autotune_{benchmark}_{subject}"
        tasks[name] = ConfigurableTask(
            config={
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
            }
        )
    return tasks


def _margin(sample: dict[str, Any]) -> float:
    """Log-probability of the right answer minus the best wrong one's (> 0: answered right)."""
    lls = [float(r[0]) for r in sample["filtered_resps"]]
    target = int(sample["target"])
    return lls[target] - max(ll for i, ll in enumerate(lls) if i != target)


def evaluate_items(
    scorer: Scorer,
    benchmark: str,
    items: list[int] | tuple[int, ...],
    *,
    shots: int,
    progress: Callable[[int, int], None] | None = None,
) -> MetricValue:
    """Accuracy of ``scorer``'s artifact on the given items of the full set, item by item.

    Args:
        scorer: The artifact, as its backend loads it.
        benchmark: ``mmlu`` or ``ceval``.
        items: Full-set ids (``benchmarks.stratified_order`` draws them).
        shots: Dev examples before each question (0..5).
        progress: Called with (items done, items in all) after each batch of requests.

    Returns:
        Accuracy over the items, its standard error, ``n``, per-subject accuracies in
        ``details``, and ``per_item``: each item's id, 1.0/0.0 for right/wrong, and the margin
        of the right answer's log-probability over the best wrong one (nats), the paired drop's
        two ingredients. The standard error is that of a mean of n 0/1 outcomes,
        sqrt(p(1-p)/(n-1)) as lm-eval reports ``acc_stderr``.
    """
    from lm_eval.evaluator import evaluate

    started = time.monotonic()
    with _quiet_lm_eval():
        tasks = build_item_tasks(benchmark, benchmarks.docs_by_subject(benchmark, items), shots)
    n_items = sum(len(t.eval_docs) for t in tasks.values())
    requests = 0

    def advance(n: int) -> None:
        # lm-eval asks one request per answer choice; a person counts questions.
        nonlocal requests
        requests += n
        if progress is not None:
            progress(requests // len(LETTERS), n_items)

    with _quiet_lm_eval():
        out = evaluate(ScorerLM(scorer, advance), tasks, log_samples=True, bootstrap_iters=0, verbosity="ERROR")
    per_subject_acc: dict[str, float] = {}
    ids: list[int] = []
    correct: list[float] = []
    margins: list[float] = []
    for name, samples in out["samples"].items():
        outcomes = [float(s["acc"]) for s in samples]
        per_subject_acc[name.removeprefix(f"autotune_{benchmark}_")] = sum(outcomes) / len(outcomes)
        ids += [int(s["doc"]["item"]) for s in samples]
        correct += outcomes
        margins += [round(_margin(s), 5) for s in samples]
    n = len(correct)
    acc = sum(correct) / n
    stderr = math.sqrt(acc * (1 - acc) / (n - 1)) if n > 1 else None
    return MetricValue(
        value=acc,
        stderr=stderr,
        n=n,
        seconds=time.monotonic() - started,
        details={"benchmark": benchmark, "shots": shots, "subjects": per_subject_acc, "scorer": scorer.description},
        per_item={"item": ids, "correct": correct, "margin": margins},
    )


def evaluate_benchmark(
    scorer: Scorer,
    benchmark: str,
    *,
    per_subject: int,
    shots: int,
    seed: int,
    progress: Callable[[int, int], None] | None = None,
) -> MetricValue:
    """Accuracy of ``scorer``'s artifact on a seeded subset (``evaluate_items`` on its items).

    Args:
        scorer: The artifact, as its backend loads it.
        benchmark: ``mmlu`` or ``ceval``.
        per_subject: Items per subject (1..10).
        shots: Dev examples before each question (0..5).
        seed: Chooses the subset.
        progress: Called with (items done, items in all) after each batch of requests.

    Returns:
        As ``evaluate_items``, with ``per_subject`` and ``seed`` in ``details``: on 57 x 5
        items a 30 % accuracy carries a standard error of about 2.7 points, which is why a
        study compares artifacts item by item.
    """
    chosen = benchmarks.subset(benchmark, per_subject, seed)
    ids = [i for docs in chosen.values() for i in benchmarks.item_ids(benchmark, docs)]
    value = evaluate_items(scorer, benchmark, ids, shots=shots, progress=progress)
    assert value.details is not None
    value.details.update(per_subject=per_subject, seed=seed)
    return value
