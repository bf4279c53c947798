"""Quality metrics for autotune: MMLU and C-Eval through lm-eval on local data, and a KLD proxy.

Metrics (through the ``register_metrics`` hook), all measured through the backend's scoring API
(``BaseBackend.scorer``, see ``autotune.engine.scoring``):

* ``mmlu``, ``ceval``: accuracy on a seeded per-subject sample of the shipped benchmark files
  (``data/``, licences beside them), 0- to 5-shot, in lm-eval's standard prompt formats
  (:mod:`~autotune_plugins.quality.tasks`, :mod:`~autotune_plugins.quality.adapter`).
* ``kld``: mean KL divergence of next-token distributions and top-1 agreement against the
  study's reference artifact on a fixed text (:mod:`~autotune_plugins.quality.kld`).

Command (through the ``register_commands`` hook): ``autotune quality`` measures one artifact
outside a study (:mod:`~autotune_plugins.quality.commands`).

Study files configure the benchmark items in a ``[quality]`` table: ``per_subject`` (default
5), ``shots`` (default 5), ``seed`` (default 0) and ``pool`` (``sample``, the default, or
``full``: the full MMLU test and C-Eval validation sets, for sequential sampling); the study
measures the items it needs, paired with the reference's (``autotune.study.quality``).
"""

from __future__ import annotations

from autotune.api import hookimpl

__all__ = ["register_commands", "register_metrics"]


@hookimpl
def register_metrics(register):
    """Add the ``mmlu``, ``ceval`` and ``kld`` metrics.

    Args:
        register: Called with each metric instance.
    """
    from autotune_plugins.quality.metrics import CevalMetric, KldMetric, MmluMetric

    for metric in (MmluMetric(), CevalMetric(), KldMetric()):
        register(metric)


@hookimpl
def register_commands(cli):
    """Add ``autotune quality``.

    Args:
        cli: The top-level click group.
    """
    from autotune_plugins.quality.commands import add_quality_command

    add_quality_command(cli)
