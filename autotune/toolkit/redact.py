"""What autotune never shows, stores or hands on: passwords and tokens.

One owner for three things that must agree on what a secret is:

* :func:`mask_url`: a storage URL as autotune prints and stores it (summary, report hint,
  dashboard note, the last-study file, error messages), whatever form carries the password:
  ``user:password@host`` (an unencoded ``@`` in the password included: the userinfo ends at the
  last ``@`` before the host), ``?password=`` and other secret-looking query keys, SQLAlchemy's
  ``dialect+driver://`` schemes.
* :func:`mask_argv`: a command line as autotune stores and shows it (the deploy command, the
  trial's attributes and notes, ``study``, ``best``, ``best --json``, the report): the value of a
  secret flag (``--api-key``, ``--hf-token``, ``--token``, ``--password``, ``-H 'Authorization:
  ...'``) and anything shaped like a token (``sk-...``, ``hf_...``) replaced by ``***``.
* :func:`engine_environment`: an engine's environment from an allow-list plus what its backend
  declares (``BaseBackend.engine_environment``), never the whole of ours: an engine has no use
  for ``$AUTOTUNE_STORAGE`` or ``$HF_TOKEN``, and some print their environment when they fail.
* :func:`scrub`: text relayed from an engine (a failure's message and log tail, printed and
  stored in the trial) with every known secret value replaced by ``***``: the values of
  secret-looking variables of our environment and the passwords of the storage URLs opened.
"""

from __future__ import annotations

import fnmatch
import os
import re
import threading
from collections.abc import Iterable, Mapping
from urllib.parse import unquote

from autotune.toolkit.processes import MARK_ENV

__all__ = [
    "MASK",
    "PASS_ENV",
    "engine_environment",
    "is_secret_name",
    "mask_argv",
    "mask_url",
    "remember_secret",
    "remember_url",
    "scrub",
    "secret_values",
    "split_url",
    "url_secrets",
]

MASK = "***"
PASS_ENV = "AUTOTUNE_ENGINE_ENV"
"""Names (or ``fnmatch`` patterns) of further variables an engine is given, comma-separated:
the escape hatch for what neither the allow-list nor the backend names (``HF_TOKEN`` for a
server that downloads a gated model)."""

# What every engine may need of our environment: where programs, libraries and temporary files
# are, the locale, the accelerator runtimes' own variables, and the network's proxy and CA
# certificates (an engine that downloads its model; a proxy's password is scrubbed from output).
ALLOWED = (
    "PATH",
    "HOME",
    "USER",
    "LOGNAME",
    "SHELL",
    "LANG",
    "LANGUAGE",
    "LC_*",
    "TZ",
    "TERM",
    "TMPDIR",
    "TMP",
    "TEMP",
    "LD_LIBRARY_PATH",
    "XDG_CACHE_HOME",
    "XDG_RUNTIME_DIR",
    "CUDA_*",
    "NVIDIA_*",
    "HIP_*",
    "ROCR_*",
    "ROCM_*",
    "HSA_*",
    "GPU_DEVICE_ORDINAL",
    "OMP_*",
    "KMP_*",
    "MKL_*",
    "OPENBLAS_*",
    "HTTP_PROXY",
    "HTTPS_PROXY",
    "NO_PROXY",
    "ALL_PROXY",
    "http_proxy",
    "https_proxy",
    "no_proxy",
    "all_proxy",
    "SSL_CERT_FILE",
    "SSL_CERT_DIR",
    "REQUESTS_CA_BUNDLE",
    "CURL_CA_BUNDLE",
)

# Words of a variable or query key that name a secret; matched against the name's parts
# (split at anything but letters and digits), so TOKENIZERS_PARALLELISM is not one.
_SECRET_WORDS = {
    "pass",
    "pwd",
    "token",
    "key",
    "apikey",
    "auth",
    "cookie",
    "private",
    "privatekey",
    "credentials",
    "credential",
    "secret",
    "secrets",
    "sslpassword",
    "passphrase",
}
_SECRET_PARTS = ("passw", "secret", "apikey", "credential")
_NOT_SECRET = {"PWD", "OLDPWD"}  # the working directory, not a password
_MIN_SCRUB = 4  # shorter values would mangle ordinary text; such a password is no protection anyway
_NOT_SECRET_VALUES = {"true", "false", "none", "null", "auto", "always", "never", "enabled", "disabled"}

_known: set[str] = set()
_known_lock = threading.Lock()


def is_secret_name(name: str) -> bool:
    """Whether a variable or query key looks like it holds a secret (``HF_TOKEN``, ``password``,
    ``PGPASSWORD``, ``OPENAI_API_KEY``, ``sslpassword``)."""
    if name.upper() in _NOT_SECRET:
        return False
    words = [w for w in re.split(r"[^a-z0-9]+", name.lower()) if w]
    return any(
        w in _SECRET_WORDS or w.endswith(("token", "tokens")) or any(p in w for p in _SECRET_PARTS) for w in words
    )


def split_url(url: str) -> tuple[str, str, str, str] | None:
    """``scheme://``, userinfo (without its ``@``), host and path, query (with its ``?``); None
    for what is not ``scheme://...`` (``journal:FILE``)."""
    scheme, sep, rest = url.partition("://")
    if not sep or not re.fullmatch(r"[A-Za-z][A-Za-z0-9+.\-]*", scheme):
        return None
    body, qmark, query = rest.partition("?")
    if scheme.lower().startswith("sqlite"):  # a file path, which may hold an '@' of its own
        return scheme + sep, "", body, qmark + query
    # The host never holds an '@': the userinfo ends at the last one before the query, whatever
    # the password holds ('/' and '@' included). A '?' in the password moves the query's start
    # into it: then the userinfo is "user:pass?word", before the first '@' after it.
    at = body.rfind("@")
    if at < 0 and "@" in query and ":" in body and "/" not in body:
        at = rest.find("@")
    if at < 0:
        return scheme + sep, "", body, qmark + query
    userinfo, after = rest[:at], rest[at + 1 :]
    hostpath, qmark, query = after.partition("?")
    return scheme + sep, userinfo, hostpath, qmark + query


def _query_pairs(query: str) -> list[tuple[str, str, str]]:
    """(key, '=' or '', value) of each ``&``-separated part of ``?...`` (raw, unencoded)."""
    out = []
    for part in query[1:].split("&") if query else ():
        key, eq, value = part.partition("=")
        out.append((key, eq, value))
    return out


def mask_url(url: str) -> str:
    """The URL with every secret in it replaced by ``***``: what autotune shows, stores and logs.

    A URL without one is returned unchanged, character for character (``remember_run`` relies
    on that to tell which URLs may be written down).
    """
    parts = split_url(url)
    if parts is None:
        return url
    scheme, userinfo, hostpath, query = parts
    out = scheme
    if userinfo:
        user, colon, _password = userinfo.partition(":")
        out += f"{user}:{MASK}@" if colon else f"{userinfo}@"
    out += hostpath
    if query:
        out += "?" + "&".join(
            f"{k}{eq}{MASK if eq and is_secret_name(unquote(k)) else v}" for k, eq, v in _query_pairs(query)
        )
    return out


def url_secrets(url: str) -> set[str]:
    """The secrets a URL holds, as written and percent-decoded (for :func:`scrub`)."""
    parts = split_url(url)
    if parts is None:
        return set()
    _, userinfo, _, query = parts
    found = []
    if ":" in userinfo:
        found.append(userinfo.partition(":")[2])
    found += [v for k, eq, v in _query_pairs(query) if eq and is_secret_name(unquote(k))]
    return {s for v in found for s in (v, unquote(v)) if s}


def remember_url(url: str) -> None:
    """Scrub this URL's secrets from engine output from now on (a ``--storage`` URL is in no
    environment variable :func:`secret_values` would read)."""
    with _known_lock:
        _known.update(url_secrets(url))


def remember_secret(value: str) -> None:
    """Scrub ``value`` from engine output from now on: a key read from a variable whose name
    does not look secret (``api_key_env = "VLLM_API"``), which :func:`secret_values` would miss."""
    if value:
        with _known_lock:
            _known.add(value)


def secret_values(environ: Mapping[str, str] | None = None) -> set[str]:
    """Values that must not appear in relayed text: those of secret-looking variables, the
    secrets of URLs in any variable ($AUTOTUNE_STORAGE, $DATABASE_URL), and the remembered URLs'."""
    env = os.environ if environ is None else environ
    found = {v for k, v in env.items() if is_secret_name(k) and v}
    for v in env.values():
        if "://" in v:
            found |= url_secrets(v)
    with _known_lock:
        found |= _known
    # A flag's value (HF_HUB_DISABLE_TOKEN=true) is no secret, and hiding it would mangle every log.
    return {v for v in found if len(v) >= _MIN_SCRUB and v.lower() not in _NOT_SECRET_VALUES and not v.isdigit()}


def scrub(text: str, secrets: Iterable[str] | None = None) -> str:
    """``text`` with each secret value replaced by ``***`` (default: :func:`secret_values`)."""
    if not text:
        return text
    for value in sorted(secret_values() if secrets is None else secrets, key=len, reverse=True):
        if value and value in text:
            text = text.replace(value, MASK)
    return text


def engine_environment(
    declared: Iterable[str] = (), *, environ: Mapping[str, str] | None = None, **overrides: str
) -> dict[str, str]:
    """The environment an engine is started with: our variables that the allow-list, the
    backend's ``declared`` names or ``$AUTOTUNE_ENGINE_ENV`` name, then ``overrides``.

    Names may be ``fnmatch`` patterns (``CUDA_*``). A secret-looking variable (:func:`is_secret_name`)
    passes only when named exactly, never through a pattern: ``HF_*`` does not hand on ``HF_TOKEN``.
    """
    env = os.environ if environ is None else environ
    extra = [n.strip() for n in env.get(PASS_ENV, "").split(",") if n.strip()]
    # The marks of an autotune run by autotune: processes.start adds the engine's own to them, so
    # the outer run still finds (and ends) this engine and what it starts.
    patterns = [*ALLOWED, MARK_ENV, *declared, *extra]
    exact = {p for p in patterns if not any(c in p for c in "*?[")}
    out = {}
    for name, value in env.items():
        if name in exact or (not is_secret_name(name) and any(fnmatch.fnmatchcase(name, p) for p in patterns)):
            out[name] = value
    out.update(overrides)
    return out


# Tokens recognisable by their shape wherever they stand in a word: OpenAI-style keys (sk-,
# sk-proj-), Hugging Face (hf_), GitHub (ghp_, github_pat_), Slack (xox?-), AWS access keys.
_TOKEN_SHAPES = re.compile(
    r"\b(?:sk-[A-Za-z0-9_-]{16,}|hf_[A-Za-z0-9]{16,}|gh[pousr]_[A-Za-z0-9]{20,}|"
    r"github_pat_[A-Za-z0-9_]{20,}|xox[abpr]-[A-Za-z0-9-]{10,}|AKIA[0-9A-Z]{16})"
)
# A header that carries a credential: ``-H 'Authorization: Bearer ...'`` (curl, vLLM's
# --allowed-headers are names only), its proxy twin, and the API-key headers of some servers.
_SECRET_HEADER = re.compile(r"^\s*((?:proxy-)?authorization|x-api-key|api-key|x-auth-token)\s*:\s*", re.I)
# A flag whose value names where a secret is, not the secret: a file, a path, a variable.
_NOT_SECRET_FLAG = re.compile(r"(file|path|dir|env|var|name|mode|type|len|length|size)$", re.I)


def _secret_flag(word: str) -> bool:
    """Whether ``word`` is a flag whose value is a secret (``--api-key``, ``--hf-token``, ``-token``)."""
    if not word.startswith("-") or len(word) < 3:
        return False
    name = word.lstrip("-")
    return is_secret_name(name) and not _NOT_SECRET_FLAG.search(name)


def _masked_value(value: str) -> str:
    # A number is no secret (``--max-tokens 512``); nor is an empty value.
    return value if not value or value.isdigit() else MASK


def mask_argv(argv: Iterable[object]) -> list[str]:
    """``argv`` as strings with every secret it holds replaced by ``***`` (see the module's doc):
    the value after a secret flag or in its ``--flag=value`` form, a credential header's value,
    and token-shaped words anywhere. What is not secret is returned unchanged, word for word."""
    out: list[str] = []
    words = [str(a) for a in argv]
    after_flag = False
    for word in words:
        if after_flag and not word.startswith("-"):
            out.append(_masked_value(word))
            after_flag = False
            continue
        after_flag = False
        flag, eq, value = word.partition("=")
        header = _SECRET_HEADER.match(word)
        if header and word[header.end() :]:
            out.append(word[: header.end()] + MASK)
        elif eq and _secret_flag(flag):
            out.append(f"{flag}={_masked_value(value)}")
        else:
            after_flag = _secret_flag(word)
            out.append(_TOKEN_SHAPES.sub(MASK, word))
    return out
