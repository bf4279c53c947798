"""The traffic a study measures: request lengths, how requests arrive, and the latency targets.

A study's ``[workload]`` table says what one run of the measurement sends. Either one request
shape (``prompt_tokens``, ``output_tokens``: every request alike, ``parallel`` of them at once,
as autotune always measured), or a length distribution:

* ``profile = "chat" | "rag" | "code" | "batch"``: a named preset (:data:`PRESETS`, each with
  where its shape comes from);
* ``file = "lengths.jsonl"`` (or ``.csv``): real request lengths, one request per line with its
  ``prompt_tokens`` and ``output_tokens``.

``requests`` of them are drawn once per study with ``seed`` (the study's by default), so every
trial and every backend is sent the same requests in the same order (:class:`Workload`'s
``requests``). How they are sent (``arrival``): ``"closed"`` keeps ``parallel`` requests in
flight (each user sends its next request when answered), ``"poisson"`` sends them at the times of
a Poisson process of ``rate`` requests per second, whatever is in flight (open loop).

The latency targets (the SLO) are ``[objective]`` keys, read by :func:`read_slo`: see
docs/workload.md.
"""

from __future__ import annotations

import csv
import json
import math
import random
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from autotune.toolkit.paths import path_problem, read_input

__all__ = [
    "ARRIVALS",
    "PRESETS",
    "SLO_KEYS",
    "Preset",
    "WORKLOAD_KEYS",
    "Workload",
    "WorkloadSpec",
    "study_workload",
    "draw",
    "read_lengths",
    "read_slo",
    "read_workload",
]

ARRIVALS = ("closed", "poisson")
# Request numbers from here on are a run's (Workload.request); those below, requests alone.
FIRST_RUN_REQUEST = 1000
WORKLOAD_KEYS = (
    "prompt_tokens",
    "output_tokens",
    "profile",
    "file",
    "requests",
    "seed",
    "arrival",
    "rate",
    "rate_search",
)
# Bisections of a rate search after its two bounds: the rate found is within (high - low) / 2**5.
RATE_SEARCH_STEPS = 5
# The latency quantities a target may bound, each at one of these percentiles, e.g. ttft_p95_ms.
SLO_QUANTITIES = ("ttft", "itl", "e2e")
SLO_PERCENTILES = (50, 95, 99)
SLO_KEYS = tuple(f"{q}_p{p}_ms" for q in SLO_QUANTITIES for p in SLO_PERCENTILES)
# Requests drawn per study when the file does not say: enough for a p95 to be an observed
# request rather than the maximum (20 requests put the p95 at the 19th), few enough for a CPU.
DEFAULT_REQUESTS = 32
# The longest prompt or answer a preset draws: beyond it a lognormal's tail makes requests no
# configuration of a modest context can hold.
MAX_PRESET_TOKENS = 16384


@dataclass(frozen=True)
class Workload:
    """What a run sends (the study file's ``[workload]``, :mod:`autotune.engine.workload`).

    Attributes:
        prompt_tokens, output_tokens: One request's shape; with a length distribution, its
            requests' mean lengths (rounded), the typical request.
        requests: With a distribution, the lengths of the requests one run sends, in order
            (drawn once per study, the same for every trial and backend); empty: every request
            is ``(prompt_tokens, output_tokens)`` and a run sends ``parallel`` of them at once.
        arrival: ``"closed"`` (``parallel`` requests in flight) or ``"poisson"`` (open loop).
        rate: Requests per second of the Poisson arrivals.
        rate_search: (low, high) requests per second: each run finds the highest Poisson rate
            between them whose requests meet the latency targets (``slo``), by bisection.
        seed: Draws the arrival times.
        slo: The per-request latency targets goodput counts against (``[objective]``'s
            ``ttft_p95_ms``...: :data:`autotune.engine.workload.SLO_KEYS`) and ``min_per_user_tok_s``.
    """

    prompt_tokens: int
    output_tokens: int
    requests: tuple[tuple[int, int], ...] = ()
    arrival: str = "closed"
    rate: float | None = None
    seed: int = 0
    slo: tuple[tuple[str, float], ...] = ()
    rate_search: tuple[float, float] | None = None

    @property
    def sequence_tokens(self) -> int:
        """The longest sequence a slot must hold."""
        if self.requests:
            return max(p + o for p, o in self.requests)
        return self.prompt_tokens + self.output_tokens

    @property
    def need_text(self) -> str:
        """What :attr:`sequence_tokens` is made of, for a refusal: ``1500 prompt + 800 output = 2300 tokens``."""
        p, o = max(self.requests, key=sum) if self.requests else (self.prompt_tokens, self.output_tokens)
        return f"{'the longest request drawn: ' if self.requests else ''}{p} prompt + {o} output = {p + o} tokens"

    @property
    def shaped(self) -> bool:
        """Whether a run is more than ``parallel`` copies of one request sent together."""
        return bool(self.requests) or self.arrival != "closed"

    def request(self, i: int) -> tuple[int, int]:
        """Request number ``i``'s (prompt, output) tokens: every backend builds request ``i`` to
        these lengths. Numbers below :data:`FIRST_RUN_REQUEST` (the request alone of each run,
        the warm-up) are the typical request, so the rates measured alone do not move with the
        draw; a run's requests are numbered from a multiple of ``len(requests)`` above it, so
        each run sends the whole drawn set, in order."""
        if not self.requests or i < FIRST_RUN_REQUEST:
            return self.prompt_tokens, self.output_tokens
        return self.requests[i % len(self.requests)]

    def run_size(self, parallel: int) -> int:
        """Requests a run sends (besides the one alone)."""
        if self.requests:
            return len(self.requests)
        return parallel

    def run_lengths(self, parallel: int) -> list[tuple[int, int]]:
        """The (prompt, output) tokens of a run's requests, in order, for an engine that is handed
        them all at once (a worker, the twin's simulation): the drawn requests, else ``parallel``
        copies of the one shape."""
        return list(self.requests) or [(self.prompt_tokens, self.output_tokens)] * parallel


@dataclass(frozen=True)
class Preset:
    """A length distribution: prompt and output tokens each lognormal (median and sigma of the
    log), clipped to ``[low, high]``.

    Attributes:
        prompt_median, prompt_sigma, output_median, output_sigma: The two lognormals.
        low, high: The clip of both.
        source: Where the shape comes from, and what of it is assumed.
    """

    prompt_median: float
    prompt_sigma: float
    output_median: float
    output_sigma: float
    low: int
    high: int
    source: str

    def draw(self, rng: random.Random) -> tuple[int, int]:
        def one(median: float, sigma: float) -> int:
            return int(min(self.high, max(self.low, round(rng.lognormvariate(math.log(median), sigma)))))

        return one(self.prompt_median, self.prompt_sigma), one(self.output_median, self.output_sigma)


# A lognormal with median m and sigma s has mean m * exp(s^2 / 2): the chat preset's medians are
# set so that its means are the published ones.
PRESETS: Mapping[str, Preset] = {
    "chat": Preset(
        161.31 / math.exp(0.9**2 / 2),
        0.9,
        337.99 / math.exp(0.8**2 / 2),
        0.8,
        4,
        4096,
        "ShareGPT conversations as Kwon et al. measured them for the PagedAttention paper (SOSP "
        "2023, section 6.1 and figure 11: mean input 161.31, mean output 337.99 tokens); the means "
        "are theirs, the lognormal shape and its spread (sigma 0.9 and 0.8) are our assumption",
    ),
    "rag": Preset(
        2000,
        0.35,
        150,
        0.5,
        16,
        8192,
        "assumed, not measured: retrieval-augmented answers send several retrieved passages "
        "(about four of 512 tokens) and a question, and get a short answer; no published "
        "length statistics are used",
    ),
    "code": Preset(
        1500,
        0.6,
        120,
        0.7,
        16,
        8192,
        "assumed, not measured: an editor's code completion sends the file around the "
        "cursor and gets a few lines back; no published length statistics are used",
    ),
    "batch": Preset(
        512,
        0.25,
        512,
        0.25,
        16,
        4096,
        "assumed, not measured: offline generation over a dataset of similar documents "
        "(moderate prompts, long answers, little spread); no published length statistics "
        "are used",
    ),
}


@dataclass(frozen=True)
class WorkloadSpec:
    """The ``[workload]`` table read (before the requests are drawn).

    Attributes:
        prompt_tokens, output_tokens: The one request shape (None with a distribution).
        profile: A preset's name, or None.
        file: A lengths file as written in the study file, or None.
        requests: How many requests one run sends (None: the slots, for one shape).
        seed: Draws the requests (None: the study's seed).
        arrival: ``"closed"`` or ``"poisson"``.
        rate: Requests per second, for ``"poisson"``.
        rate_search: (low, high) requests per second to search, for ``"poisson"`` instead of ``rate``.
    """

    prompt_tokens: int | None = None
    output_tokens: int | None = None
    profile: str | None = None
    file: str | None = None
    requests: int | None = None
    seed: int | None = None
    arrival: str = "closed"
    rate: float | None = None
    rate_search: tuple[float, float] | None = None

    @property
    def distribution(self) -> bool:
        return self.profile is not None or self.file is not None


MAX_LENGTHS_BYTES = 64 * 2**20  # a lengths file: a million requests with their text is under this
RATE_RANGE = (0.01, 10_000.0)  # requests per second a rate (or a rate search) may ask for
SLO_RANGE_MS = (0.1, 86_400_000.0)  # a latency target: below a tenth of a millisecond no server answers
MAX_TOKENS = 10_000_000  # a prompt or an output longer than any model's context: a typo, refused


def _short(value: Any) -> str:
    """A bad value as an error shows it: 10**400 is not 400 digits of message."""
    text = (
        repr(value)
        if not isinstance(value, int)
        else str(value)
        if abs(value) < 10**30
        else f"an integer of about {int(abs(value).bit_length() * 0.30103) + 1} digits"
    )
    return text if len(text) <= 60 else text[:57] + "..."


class _RepeatedKey(ValueError):
    def __init__(self, key: str):
        super().__init__(key)
        self.key = key


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise _RepeatedKey(key)
        out[key] = value
    return out


def read_lengths(path: Path, shown: str | None = None) -> list[tuple[int, int]]:
    """Request lengths from a JSONL file (an object a line) or a CSV file (a header line), each
    request's ``prompt_tokens`` and ``output_tokens``.

    Raises:
        ValueError: the file cannot be read, or a line lacks a field or holds a bad value; the
            message names the file, the line, the field and what is accepted.
    """
    shown = shown or str(path)
    fields = ("prompt_tokens", "output_tokens")
    what = "a regular .jsonl or .csv file of request lengths"
    if path_problem(path) == "no such file":
        raise ValueError(f"{shown}: no such file (a .jsonl or .csv of request lengths)")
    data = read_input(path, shown, MAX_LENGTHS_BYTES, what)  # no FIFO, no device, no 10 GB file
    try:
        # utf-8-sig: a spreadsheet's "CSV UTF-8" starts with a byte-order mark, which would
        # otherwise be part of the first column's name ("lacks prompt_tokens").
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise ValueError(f"{shown}: cannot be read as UTF-8 text ({exc})") from None
    rows: list[tuple[int, Mapping[str, Any]]] = []
    if path.suffix.lower() == ".csv":
        # Other columns are ignored, however long (a conversation's text): the csv module's
        # default limit of 128 KiB a field raised _csv.Error; the file's own limit bounds them.
        csv.field_size_limit(max(csv.field_size_limit(), MAX_LENGTHS_BYTES))
        reader = csv.DictReader(text.splitlines())
        missing = [f for f in fields if f not in (reader.fieldnames or ())]
        if missing:
            raise ValueError(
                f"{shown}: line 1: the header lacks {', '.join(missing)} (a CSV of request lengths "
                f"needs the columns {', '.join(fields)})"
            )
        header = ", ".join(reader.fieldnames or ())
        try:
            for row in reader:
                # DictReader keeps a row's surplus values under None: 1,200,7 under a header of
                # two read as 1 and 200, whatever the 7 meant (a shifted column, a comma in a number).
                if None in row:
                    raise ValueError(
                        f"{shown}: line {reader.line_num}: {len(reader.fieldnames or ()) + len(row[None])} "
                        f"values under a header of {len(reader.fieldnames or ())} ({header}); give one "
                        "value a column, quoting a value that holds a comma"
                    )
                rows.append((reader.line_num, row))
        except csv.Error as exc:
            raise ValueError(f"{shown}: line {reader.line_num}: not CSV ({exc})") from None
    elif path.suffix.lower() in (".jsonl", ".ndjson"):
        for n, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line, object_pairs_hook=_unique_keys)
            except _RepeatedKey as exc:  # json.loads keeps the last of two: which one was meant?
                raise ValueError(
                    f"{shown}: line {n}: the key {exc.key!r} twice; give each of {' and '.join(fields)} once"
                ) from None
            except ValueError as exc:  # JSONDecodeError, or a number of more than 4,300 digits
                raise ValueError(
                    f"{shown}: line {n}: not JSON ({getattr(exc, 'msg', exc)}); each line must be an "
                    "object such as "
                    '{"prompt_tokens": 812, "output_tokens": 240}'
                ) from None
            if not isinstance(obj, dict):
                raise ValueError(
                    f"{shown}: line {n}: a JSON {type(obj).__name__}, not an object with {' and '.join(fields)}"
                )
            rows.append((n, obj))
    else:
        raise ValueError(
            f"{shown}: unknown kind of file {path.suffix!r}: give a .jsonl (one JSON object a line) "
            f"or a .csv (a header line) with {' and '.join(fields)} per request"
        )
    out = []
    for n, row in rows:
        pair = []
        for f in fields:
            value = row.get(f)
            # ASCII digits only: str.isdigit() takes '²', which int() then refuses.
            if isinstance(value, str) and re.fullmatch(r"[0-9]{1,12}", value.strip()):
                value = int(value)
            if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= MAX_TOKENS:
                got = "missing" if value is None else _short(value)
                raise ValueError(
                    f"{shown}: line {n}: {f} = {got}: must be an integer from 1 to {MAX_TOKENS:,} (tokens)"
                )
            pair.append(value)
        out.append((pair[0], pair[1]))
    if not out:
        raise ValueError(f"{shown}: no requests in it (each line: {' and '.join(fields)})")
    return out


def draw(spec: WorkloadSpec, study_seed: int, base_dir: Path, parallel: int = 1) -> tuple[tuple[int, int], ...]:
    """The requests one run sends, in order: drawn once with the workload's seed, so that every
    trial and every backend gets the same ones. For one request shape: empty when closed-loop
    (each run sends ``parallel`` copies of it, as always), ``requests`` copies when open-loop.

    Raises:
        ValueError: the lengths file is bad (see :func:`read_lengths`).
    """
    n = spec.requests or DEFAULT_REQUESTS
    if not spec.distribution:
        # Open loop sends n requests a run at their arrival times, however many slots there are.
        return ((spec.prompt_tokens or 1, spec.output_tokens or 1),) * n if spec.arrival == "poisson" else ()
    rng = random.Random(f"workload:{spec.seed if spec.seed is not None else study_seed}")
    if spec.profile is not None:
        preset = PRESETS[spec.profile]
        return tuple(preset.draw(rng) for _ in range(n))
    assert spec.file is not None
    path = Path(spec.file).expanduser()
    lengths = read_lengths(path if path.is_absolute() else base_dir / path, spec.file)
    return tuple(rng.choice(lengths) for _ in range(n))


def read_workload(
    table: Mapping[str, Any], get: Callable[..., Any], error: Callable[[str, Any, str], None]
) -> WorkloadSpec:
    """Read ``[workload]`` with the study file's reader (``get(key, kind, default, check=...)``
    and ``error(key, value, message)``, both for this table, a value of None meaning a missing
    key), every problem reported."""

    def tokens(v: Any) -> str | None:
        return None if 1 <= v <= MAX_TOKENS else f"must be 1..{MAX_TOKENS:,} (tokens)"

    prompt = get("prompt_tokens", int, None, check=tokens)
    output = get("output_tokens", int, None, check=tokens)
    profile = get(
        "profile",
        str,
        None,
        check=lambda v: None if v in PRESETS else f"must be one of {', '.join(PRESETS)} (docs/workload.md)",
    )
    file = get("file", str, None, check=lambda v: None if v.strip() else "must name a .jsonl or .csv file")
    requests = get("requests", int, None, check=lambda v: None if 1 <= v <= 100_000 else "must be 1..100000")
    seed = get("seed", int, None, check=lambda v: None if 0 <= v <= 2**32 - 1 else f"must be 0..{2**32 - 1}")
    arrival = get(
        "arrival", str, "closed", check=lambda v: None if v in ARRIVALS else f"must be one of {', '.join(ARRIVALS)}"
    )
    rate = get(
        "rate",
        float,
        None,
        check=lambda v: (
            None
            if RATE_RANGE[0] <= v <= RATE_RANGE[1]
            else f"must be {RATE_RANGE[0]:g}..{RATE_RANGE[1]:g} requests per second (below, a run of requests takes "
            "hours; 1e-300 named a best at 0.0 tok/s)"
        ),
    )
    shape = "give prompt_tokens and output_tokens (one request shape), or profile, or file"
    if "profile" in table and "file" in table:
        error("profile", profile, f"and file = {file!r} are both set: {shape}, not both")
    elif "profile" in table or "file" in table:
        for key in ("prompt_tokens", "output_tokens"):
            if key in table:
                error(key, table[key], f"set beside {'profile' if 'profile' in table else 'file'}: {shape}, not both")
    else:
        for key in ("prompt_tokens", "output_tokens"):
            if key not in table:
                error(key, None, f"required: {shape}")
    search = get(
        "rate_search",
        list,
        None,
        check=lambda v: (
            None
            if len(v) == 2
            and all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in v)
            and RATE_RANGE[0] <= v[0] < v[1] <= RATE_RANGE[1]
            else f"must be [low, high] requests per second, {RATE_RANGE[0]:g} <= low < high <= "
            f"{RATE_RANGE[1]:g}, e.g. [0.5, 16.0]"
        ),
    )
    if arrival == "poisson" and "rate" in table and "rate_search" in table:
        # As written, even when it is bad itself: "(missing)" beside "both set" said the opposite.
        error(
            "rate_search",
            table["rate_search"],
            f"and rate = {table['rate']} are both set: give one (a fixed rate, or the range to search)",
        )
    elif arrival == "poisson" and "rate" not in table and "rate_search" not in table:
        error(
            "rate",
            None,
            "required with arrival = 'poisson': requests per second, e.g. 2.0 (or rate_search = "
            "[low, high] to find the highest rate that meets the latency targets)",
        )
    for key, value in (("rate", rate), ("rate_search", search)):
        if arrival == "closed" and value is not None:
            error(key, value, "is for arrival = 'poisson' (open loop); a closed loop sends as fast as the slots answer")
    if requests is not None and "profile" not in table and "file" not in table and arrival == "closed":
        error(
            "requests",
            requests,
            "is for a length distribution (profile or file) or arrival = 'poisson'; "
            "one request shape sends parallel requests a run",
        )
    if seed is not None and "profile" not in table and "file" not in table and arrival == "closed":
        error(
            "seed",
            seed,
            "draws a length distribution (profile or file) or arrival = 'poisson''s times; one "
            "request shape in a closed loop draws nothing, so it would change nothing",
        )
    return WorkloadSpec(
        prompt,
        output,
        profile,
        file,
        requests,
        seed,
        arrival,
        rate,
        (float(search[0]), float(search[1])) if search else None,
    )


def read_slo(table: Mapping[str, Any], get: Callable[..., Any]) -> tuple[tuple[str, float], ...]:
    """The latency targets of ``[objective]`` (``ttft_p95_ms = 500``...), in :data:`SLO_KEYS` order."""
    out = []
    for key in SLO_KEYS:
        value = get(
            key,
            float,
            None,
            check=lambda v: (
                None
                if SLO_RANGE_MS[0] <= v <= SLO_RANGE_MS[1]
                else f"must be {SLO_RANGE_MS[0]:g}..{SLO_RANGE_MS[1]:g} (milliseconds: a tenth of a millisecond to "
                "a day)"
            ),
        )
        if value is not None:
            out.append((key, float(value)))
    return tuple(out)


def percentile(values: Sequence[float], p: float) -> float:
    """The ``p``-th percentile (0..100) of ``values``, linearly interpolated between the two
    nearest ranks (numpy's default), so that it is defined for any number of requests."""
    xs = sorted(values)
    if not xs:
        raise ValueError("percentile of no values")
    k = (len(xs) - 1) * p / 100.0
    lo = math.floor(k)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def study_workload(cfg: Any) -> Workload:
    """The :class:`Workload` a study's backends are given (``cfg``: a ``StudyConfig``): the
    drawn requests, how they arrive, and the targets goodput counts against (the latency
    targets and the per-user floor of ``[objective]``)."""
    spec: WorkloadSpec = cfg.workload
    floor = cfg.objective.min_per_user_tok_s
    slo = tuple(cfg.objective.slo) + ((("min_per_user_tok_s", float(floor)),) if floor is not None else ())
    return Workload(
        cfg.prompt_tokens,
        cfg.output_tokens,
        requests=tuple(cfg.requests),
        arrival=spec.arrival,
        rate=spec.rate,
        seed=spec.seed if spec.seed is not None else cfg.seed,
        slo=slo,
        rate_search=spec.rate_search if spec.arrival == "poisson" else None,
    )
