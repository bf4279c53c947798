"""The finish of a study: its leaders measured again, interleaved, until a winner or a tie.

What ``StudyRunner`` runs after the search (``StudyRunner.finish``), given what it uses (the
study, the prepared study, the claims, the scoring) rather than sharing the runner's state;
workers sharing a study claim each round (``Finish.claim_once``), and a claim names its host and pid so that the next run on
that machine can take over the rounds of a worker killed mid-finish. The verdict itself (a
two-sample t-test) is ``verdict.finish_verdict``'s.
"""

from __future__ import annotations

import hashlib
import os
import socket
from typing import TYPE_CHECKING, Callable

import optuna

from autotune.engine.backend import TrialConfig
from autotune.errors import EngineUnavailableError
from autotune.study import noise, records
from autotune.study.baseline import title_of
from autotune.study.claims import process_alive
from autotune.study.records import TrialRecord
from autotune.study.verdict import finish_candidates, finish_verdict, worth_another_round

if TYPE_CHECKING:  # pragma: no cover
    from autotune.study.objective import Score
    from autotune.study.claims import Claims
    from autotune.study.interrupts import Interrupts
    from autotune.study.prepared import PreparedStudy


_PID_BITS = 22  # Linux's largest pid_max is 2**22


def host_tag(host: str) -> int:
    return int.from_bytes(hashlib.sha1(host.encode()).digest()[:1], "big")


def finish_token(host: str, pid: int) -> int:
    """What a worker's claims on rounds of the finish hold: negative, so never a trial's id, and
    naming its host (8 bits of a hash) and pid, so that a worker killed mid-finish can be told
    dead by the next run on its machine, which then takes its rounds over."""
    return -((host_tag(host) << _PID_BITS) | (pid % (1 << _PID_BITS)) or 1)


def dead_local_finisher(token: int) -> bool:
    if token >= 0:
        return False
    value = -token
    return value >> _PID_BITS == host_tag(socket.gethostname()) and not process_alive(value & ((1 << _PID_BITS) - 1))


class Finish:
    """The finish and the claims on work done once per study (a finish round, a baseline).

    Args:
        study, prepared: The study and what it was prepared from.
        claims: The study's claims (``study/claims.py``).
        worker: This worker's name, stored with each round.
        finish_token: What this worker's claims hold (``finish_token``).
        interrupts: Ctrl-C between launches.
        score: The objective of a measurement, as a trial is scored (``TrialPhase.score``).
    """

    def __init__(
        self,
        study: optuna.Study,
        prepared: "PreparedStudy",
        claims: "Claims",
        worker: str,
        finish_token: int,
        interrupts: "Interrupts",
        score: Callable[..., "Score"],
    ):
        self.study, self.prepared, self.cfg = study, prepared, prepared.cfg
        self.claims, self.worker, self.finish_token = claims, worker, finish_token
        self.interrupts, self._score = interrupts, score

    def claim_once(self, key: str) -> bool:
        """Whether this worker holds ``key`` (work done once per study, not per worker): claimed
        now, held already, or taken over from a worker killed on this machine."""
        holder = self.claims.claim(key, self.finish_token)
        return holder in (None, self.finish_token) or (
            dead_local_finisher(holder) and self.claims.take_over(key, holder, self.finish_token)
        )

    def finish(self, note: Callable[[str], None] | None = None) -> int:
        """The noise-aware finish: measure the study's best ``[study] finish_top`` configurations
        again, ``finish_rounds`` times each, interleaved (A B C A B C: a card warming up or a
        neighbour's load then touches each alike), and store every round for the summary's
        verdict (``verdict.finish_verdict``). A tie that more runs could resolve
        (``verdict.worth_another_round``) gets one more round of all of them, up to
        ``finish_max_rounds``. Rounds already stored (a finish cut short) count and are not
        measured again; a launch that fails is stored as a failed round and the finish goes
        on. ``note`` hears one line per launch (it runs after the budget: the user must see why
        the study is still busy). Returns the number of launches.
        """
        top = finish_candidates(self.study, self.cfg.finish_top)
        if len(top) < 2 or len(self.study.directions) > 1:
            return 0  # nothing to compare; a Pareto front has no single winner to confirm
        numbers = [r.number for r in top]
        if all(self._repeats_exactly(r) for r in top):
            # A prediction without noise says the same every time: measuring it again would only
            # report "a tie within the 0.0% noise explains". The verdict reads the first figures.
            records.write_finish_plan(self.study, numbers, 0)
            return 0
        rounds = self.cfg.finish_rounds
        plan = records.finish_plan(self.study)
        if plan is not None and plan[0] == numbers:
            rounds = min(max(rounds, plan[1]), self.cfg.finish_max_rounds)  # rounds a finish added stay
        records.write_finish_plan(self.study, numbers, rounds)
        launches = others = 0
        while True:
            done, skipped, go_on = self._finish_rounds(top, rounds, note, launches + others)
            launches, others = launches + done, others + skipped
            if not go_on:
                return launches
            verdict = finish_verdict(self.study)
            if rounds >= self.cfg.finish_max_rounds or not worth_another_round(verdict):
                break
            rounds += 1
            records.write_finish_plan(self.study, numbers, rounds)
            if note is not None:
                note(
                    f"finish: trials {', '.join(map(str, verdict['tied']))} tie with a lead of "  # type: ignore[index]
                    f"{verdict['lead'] * 100:.1f}% against the {verdict['needed'] * 100:.1f}% noise "  # type: ignore[index]
                    f"explains: one more round ({rounds} of at most {self.cfg.finish_max_rounds})"
                )
        if others and note is not None:
            note(f"finish: {others} round(s) measured by another worker of this study")
        return launches

    def _repeats_exactly(self, record: TrialRecord) -> bool:
        config = record.trial_config
        assert config is not None
        predictor = self.prepared.backend(config.backend).predictor
        return predictor is not None and predictor.repeats_exactly(self.prepared.contexts[config.backend])

    def _finish_rounds(
        self, top: list[TrialRecord], rounds: int, note: Callable[[str], None] | None, said: int
    ) -> tuple[int, int, bool]:
        """The finish's rounds not stored yet: (launches, rounds left to another worker, whether
        to go on: False when the engine is unavailable, and every launch would fail)."""
        stored = records.remeasures(self.study)
        todo = said + sum(round_ not in stored.get(r.number, {}) for round_ in range(rounds) for r in top)
        launches = others = 0
        for round_ in range(rounds):
            for r in top:
                if round_ in stored.get(r.number, {}):
                    continue
                # Workers sharing the study reach the finish together: each round is claimed, so
                # they share the rounds out instead of each measuring all of them.
                key = f"finish:{r.number}:{round_}"
                if not self.claim_once(key):
                    others += 1
                    continue
                config = r.trial_config
                assert config is not None
                self.interrupts.raise_if_interrupted()
                ctx = self.prepared.contexts[config.backend]
                launches += 1
                if note is not None:
                    note(
                        f"finish {said + launches + others}/{todo}: trial {r.number} measured again (round "
                        f"{round_ + 1} of {rounds}, interleaved with trials {', '.join(str(t.number) for t in top)})"
                    )
                try:
                    m = self.prepared.backend(config.backend).run(config, ctx)
                    s = self._score(
                        m,
                        (r.predicted_vram or {})["total_bytes"],
                        ctx.vram_budget_bytes,
                        r.quality_drop_points,
                        r.quality,
                    )
                except EngineUnavailableError:
                    self.claims.release(key, self.finish_token)
                    return launches, others, False  # the missing rounds wait for a later run
                except BaseException as exc:
                    if not isinstance(exc, Exception):  # Ctrl-C: the round is measured when the study continues
                        self.claims.release(key, self.finish_token)
                        raise
                    # The study's outcome stands; the verdict counts the failure.
                    records.write_remeasure(
                        self.study, r.number, round_, error=f"{type(exc).__name__}: {exc}", worker=self.worker
                    )
                    continue
                per_user = m.metrics.get("per_user_tok_s")
                records.write_remeasure(
                    self.study,
                    r.number,
                    round_,
                    value=s.values[0],
                    feasible=s.feasible,
                    per_user_tok_s=per_user.median if per_user is not None else None,
                    peak_vram_bytes=m.peak_vram_bytes,
                    worker=self.worker,
                    metrics={
                        k: float(v.median)
                        for k, v in m.metrics.items()
                        if isinstance(getattr(v, "median", None), (int, float))
                    },
                )
            if not self._baseline_round(round_, note):
                return launches, others, False
        return launches, others, True

    def _baseline_round(self, round_: int, note: Callable[[str], None] | None) -> bool:
        """The fastest baseline launched once more after the round's leaders (interleaved with
        them: A B C base A B C base), so its ratio compares launches of the same time with each
        other and its launches count in the between-launch spread (``study/noise.py``).
        False when the engine is unavailable."""
        base = noise.fastest_baseline(self.study)
        if base is None or round_ in noise.baseline_rounds(self.study).get(base.key, {}):
            return True
        key = f"finish-baseline:{base.key}:{round_}"
        if not self.claim_once(key):
            return True
        config = TrialConfig.from_dict(base.config or {})
        ctx = self.prepared.contexts.get(config.backend)
        if ctx is None:
            return True
        if note is not None:
            note(f"finish: {title_of(base.backend, base.title)} measured again beside them (round {round_ + 1})")
        try:
            m = self.prepared.backend(config.backend).run(config, ctx)
        except EngineUnavailableError:
            self.claims.release(key, self.finish_token)
            return False
        except BaseException as exc:
            if not isinstance(exc, Exception):
                self.claims.release(key, self.finish_token)
                raise
            noise.write_baseline_round(
                self.study, base.key, round_, error=f"{type(exc).__name__}: {exc}", worker=self.worker
            )
            return True
        noise.write_baseline_round(
            self.study,
            base.key,
            round_,
            worker=self.worker,
            metrics={
                k: float(v.median) for k, v in m.metrics.items() if isinstance(getattr(v, "median", None), (int, float))
            },
        )
        return True
