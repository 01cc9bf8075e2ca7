"""Secrets: which values can hold one, the one scrubber that keeps them out of every record, and the
``{env.NAME}`` references that keep them out of experiment files.

A run's secrets are:

- the endpoint's key, read from the variable ``endpoint.api_key_env`` names
  (:func:`k3pipe.jobs.arm_run.arm_key`),
  and a gateway's, from the variable ``gateway.api_key_env`` names (:func:`k3pipe.jobs.arm_run.client_key`);
- a value written literally in an experiment under a name that says secret (``engine.env.HF_TOKEN``,
  ``engine.args.api_key``: :func:`is_secret_name`), or shaped like a key wherever it stands
  (``sk-...``, ``hf_...``: :func:`looks_like_key`);
- the value of every variable an ``{env.NAME}`` reference names: ``engine.env: {HF_TOKEN:
  "{env.HF_TOKEN}"}`` takes ``HF_TOKEN`` of k3pipe's own environment at launch, and every record
  holds the reference, never the value (:func:`resolve_env_references`);
- credentials in a URL (its userinfo, a query parameter named like a key: :func:`url_credentials`).

Every value found is registered with the process-wide scrubber (:func:`register`;
:func:`k3pipe.experiment.load.parse_experiment` registers an experiment's as it reads it), and
:func:`scrub` replaces each registered value with ``***``, and, whatever was registered, masks an
``Authorization`` header's credential, a URL's userinfo, a query parameter named like a key and
anything shaped like a well-known key. Every record passes through it: MLflow (``Tracker.scrub``),
k3pipe's errors (:class:`k3pipe.core.errors.K3pipeError` scrubs its message when it is made), the engine's
log as it is written, Python logging and so Prefect's logs (:class:`SecretFilter`,
:func:`install_log_filter`), and the terminal.

Values shorter than :data:`MIN_SECRET_CHARS` are not registered: replacing them would mangle
ordinary text, and a key that short is no key. Where the structure is known (an engine's env and
arguments, an experiment's dump), secret-named values are redacted whatever their length
(:func:`redact_data`).
"""

from __future__ import annotations

import json
import logging
import re
import threading
from collections.abc import Callable, Iterable, Mapping
from typing import Any
from urllib.parse import parse_qsl, quote, urlsplit

__all__ = [
    "ENV_NAME",
    "MIN_SECRET_CHARS",
    "REDACTED",
    "ScrubbedStream",
    "Scrubber",
    "SecretFilter",
    "UnsetVariable",
    "bad_env_references",
    "check_key_variable",
    "collect_secrets",
    "env_references",
    "install_log_filter",
    "is_env_reference",
    "is_secret_name",
    "looks_like_key",
    "mask",
    "redact_data",
    "register",
    "register_all",
    "registry",
    "resolve_env_references",
    "scrub",
    "scrub_data",
    "scrub_url",
    "shown",
    "url_credentials",
]

REDACTED = "***"
MIN_SECRET_CHARS = 8
"""Shorter values are not registered (they cannot be told from ordinary text)."""

_SECRET_WORDS = {"apikey", "secret", "password", "passwd", "credential", "credentials"}
# 'key' and 'token' name a secret only as the last word (HF_TOKEN, --api-key, access_token), not
# inside a setting's name (--long-prefill-token-threshold, key_cache_dtype)
_SECRET_LAST_WORDS = {"key", "keys", "token"}
# query parameters that carry a credential besides those named like one (presigned URLs)
_SECRET_QUERY_NAMES = {"sig", "signature", "x-amz-signature", "x-goog-signature", "auth", "access_token"}


def is_secret_name(name: str) -> bool:
    """Whether an environment variable, flag, field or query parameter name says it carries a secret."""
    words = [w for w in re.split(r"[-_.]+", name.lower()) if w]
    return any(word in _SECRET_WORDS for word in words) or bool(words and words[-1] in _SECRET_LAST_WORDS)


# -- {env.NAME} references ------------------------------------------------------------------------

ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
"""A variable name (the same rule as ``endpoint.api_key_env``)."""
_REFERENCE = re.compile(r"\{env\.([^{}]*)\}")


def check_key_variable(value: str, field: str, example: str) -> str:
    """``value`` if it names an environment variable that holds a key, else a ValueError naming
    ``field`` (e.g. ``endpoint.api_key_env``) and an ``example`` variable. A key pasted where its
    variable's name belongs is registered with the scrubber and never echoed whole."""
    keyish = looks_like_key(value) or _random_looking(value)
    if keyish or not ENV_NAME.match(value):
        register(value)
        shown = mask(value) if keyish or len(value) >= 12 else repr(value)
        raise ValueError(
            f"{shown} is not an environment variable name{' (it looks like a key)' if keyish else ''}: "
            f"put the key in an environment variable and name that variable in {field}, e.g. "
            f"api_key_env: {example}"
        )
    return value


class UnsetVariable(LookupError):
    """A ``{env.NAME}`` reference whose variable is not set; ``name`` is the variable."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.name = name


def env_references(value: str) -> list[str]:
    """The variable names ``value`` refers to as ``{env.NAME}``, in order (valid or not)."""
    return _REFERENCE.findall(value)


def bad_env_references(value: str) -> list[str]:
    """The ``{env.X}`` references of ``value`` whose X is not a variable name."""
    return [name for name in env_references(value) if not ENV_NAME.match(name)]


def is_env_reference(value: Any) -> bool:
    """Whether ``value`` is a string made of ``{env.NAME}`` references alone (nothing literal)."""
    return isinstance(value, str) and bool(_REFERENCE.search(value)) and not _REFERENCE.sub("", value)


def resolve_env_references(value: str, lookup: Callable[[str], str | None]) -> str:
    """``value`` with each ``{env.NAME}`` replaced by ``lookup(NAME)``; :class:`UnsetVariable` when
    a variable is unset (None or empty)."""

    def sub(match: re.Match[str]) -> str:
        name = match.group(1)
        found = lookup(name)
        if not found:
            raise UnsetVariable(name)
        return found

    return _REFERENCE.sub(sub, value)


# -- shapes: keys, URLs ---------------------------------------------------------------------------

_KEY_SHAPES = re.compile(
    r"(?<![A-Za-z0-9_-])(?:"
    r"sk-[A-Za-z0-9_-]{16,}"  # OpenAI, Anthropic (sk-ant-...), DeepSeek, most gateways
    r"|[sr]k_(?:live|test)_[A-Za-z0-9]{16,}"  # Stripe-style secret and restricted keys
    r"|nvapi-[A-Za-z0-9_-]{20,}"  # NVIDIA API catalog
    r"|AIza[0-9A-Za-z_-]{30,}"  # Google API keys
    r"|hf_[A-Za-z0-9]{16,}"  # Hugging Face
    r"|gh[pousr]_[A-Za-z0-9]{20,}|github_pat_[A-Za-z0-9_]{20,}"  # GitHub
    r"|xox[abprs]-[A-Za-z0-9-]{10,}"  # Slack
    r"|AKIA[0-9A-Z]{16}"  # AWS access key id
    r"|eyJ[A-Za-z0-9_-]{8,}\.[A-Za-z0-9_-]{8,}\.[A-Za-z0-9_-]{8,}"  # a JWT
    r")"
)


def _random_looking(value: str) -> bool:
    """Whether ``value``, though it may pass as a variable name, reads as generated rather than
    written: a long hex run with digits (``secrets.token_hex``, most self-hosted engines' keys), a long
    mix of letters and digits with no words (``A1b2...``), or a prefix and such a run (``nvapi_...``).
    Names people give variables (``K3PIPE_GPU_API_KEY``, ``OPENAI_API_KEY_2``) have few digits."""
    if len(value) < 16:
        return False
    digits = sum(c.isdigit() for c in value)
    if "_" not in value and digits / len(value) >= 0.2 and any(c.isalpha() for c in value):
        return True
    for run in value.split("_"):
        if len(run) >= 16 and any(c.isdigit() for c in run) and any(c.isalpha() for c in run):
            hexrun = all(c in "0123456789abcdefABCDEF" for c in run)
            mixed = any(c.islower() for c in run) and any(c.isupper() for c in run)
            if hexrun or mixed or digits >= 4:
                return True
    return False


def looks_like_key(value: str) -> bool:
    """Whether ``value`` holds something shaped like a well-known API key or token."""
    return bool(_KEY_SHAPES.search(value))


def shown(value: str) -> str:
    """A value for an error message: as typed (``repr``) unless it may be a key (a well-known key's
    shape, or random-looking), then registered with the scrubber and :func:`mask`-ed."""
    if looks_like_key(value) or _random_looking(value):
        register(value)
        return mask(value)
    return repr(value)


def mask(value: str) -> str:
    """A secret shown so that a person can recognise it and nobody can use it: ``'sk-…' (51 chars)``."""
    if len(value) < 12:
        return f"{REDACTED} ({len(value)} chars)"
    return f"{value[:3]}… ({len(value)} chars)"


def url_credentials(url: str) -> list[tuple[str, str]]:
    """The credentials a URL carries, as ``(where, value)``: its userinfo (``user:key@``) and each
    query parameter named like a key (``?api_key=``, ``&token=``, ``&sig=``)."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return []
    found: list[tuple[str, str]] = []
    if "@" in parts.netloc:
        userinfo = parts.netloc.rsplit("@", 1)[0]
        user, _, password = userinfo.partition(":")
        if user:
            found.append(("userinfo", user))
        if password:
            found.append(("userinfo password", password))
    for name, value in parse_qsl(parts.query, keep_blank_values=False):
        if value and (is_secret_name(name) or name.lower() in _SECRET_QUERY_NAMES):
            found.append((f"query parameter {name!r}", value))
    return found


_USERINFO = re.compile(r"(?i)\b([a-z][a-z0-9+.-]*://)[^/\s@\"'<>]+@")
_QUERY_PARAM = re.compile(r"([?&])([A-Za-z0-9_.\-]+)=([^&#\s\"'<>]+)")
_AUTH_HEADER = re.compile(
    r"(?i)((?:proxy-)?authorization[\"']?\s*[:=]\s*[\"']?(?:bearer|basic|token|apikey)\s+)[^\s\"',;}\]]+"
)
# x-api-key headers, and api_key=... / 'api_key': '...' as an engine prints its own arguments
_KEY_HEADER = re.compile(
    r"(?i)((?:[\"']api[-_]?key[\"']\s*:\s*|\bapi[-_]?key\s*=\s*|\bx-api-key\s*:\s*)[\"']?)"
    r"(?!\{env\.|\*\*\*|None\b|null\b)[^\s\"',;}\]&#]+"
)
"""(a quoted key as in a dict or JSON, ``key=value``, or the header: not ``api_key: unknown field``,
an error message's field path)"""


def _query(match: re.Match[str]) -> str:
    name = match.group(2)
    if is_secret_name(name) or name.lower() in _SECRET_QUERY_NAMES:
        return f"{match.group(1)}{name}={REDACTED}"
    return match.group(0)


def _patterns(text: str) -> str:
    text = _AUTH_HEADER.sub(lambda m: m.group(1) + REDACTED, text)
    text = _KEY_HEADER.sub(lambda m: m.group(1) + REDACTED, text)
    text = _USERINFO.sub(lambda m: m.group(1) + REDACTED + "@", text)
    text = _QUERY_PARAM.sub(_query, text)
    return _KEY_SHAPES.sub(REDACTED, text)


def scrub_url(url: str) -> str:
    """``url`` with its userinfo and secret-named query values masked (and registered values)."""
    return scrub(url)


# -- the scrubber ---------------------------------------------------------------------------------


class Scrubber:
    """Registered secret values, and :meth:`scrub`: each value (and its JSON- and URL-escaped forms)
    replaced with ``***``, then the patterns (Authorization headers, URL credentials, key shapes)."""

    def __init__(self, values: Iterable[str | None] = ()) -> None:
        self._lock = threading.Lock()
        self._values: tuple[str, ...] = ()
        for value in values:
            self.add(value)

    def add(self, value: str | None) -> bool:
        """Register ``value`` (True when it is long enough to be one, see MIN_SECRET_CHARS)."""
        if not value or len(value) < MIN_SECRET_CHARS:
            return False
        forms = {value, json.dumps(value)[1:-1], quote(value, safe="")}
        with self._lock:
            new = set(self._values) | {f for f in forms if len(f) >= MIN_SECRET_CHARS}
            # longest first: a secret that contains another is replaced whole
            self._values = tuple(sorted(new, key=len, reverse=True))
        return True

    def __contains__(self, value: object) -> bool:
        return value in self._values

    def clear(self) -> None:
        with self._lock:
            self._values = ()

    def scrub(self, text: str) -> str:
        for value in self._values:
            if value in text:
                text = text.replace(value, REDACTED)
        return _patterns(text)

    def scrub_data(self, data: Any) -> Any:
        """``data`` (dicts, lists, tuples and strings, any depth) with every string scrubbed."""
        if isinstance(data, str):
            return self.scrub(data)
        if isinstance(data, Mapping):
            return {self.scrub_data(k): self.scrub_data(v) for k, v in data.items()}
        if isinstance(data, list | tuple):
            return type(data)(self.scrub_data(v) for v in data)
        return data


_REGISTRY = Scrubber()


def registry() -> Scrubber:
    """The process-wide scrubber every record goes through."""
    return _REGISTRY


def register(value: str | None) -> None:
    """Register a secret value with the process-wide scrubber."""
    _REGISTRY.add(value)


def register_all(values: Iterable[str | None]) -> None:
    for value in values:
        _REGISTRY.add(value)


def scrub(text: str) -> str:
    """``text`` with every registered secret, and every credential-shaped part, replaced by ``***``."""
    return _REGISTRY.scrub(text)


def scrub_data(data: Any) -> Any:
    """Every string in ``data`` scrubbed (see :func:`scrub`)."""
    return _REGISTRY.scrub_data(data)


# -- finding a run's secrets in its experiment ----------------------------------------------------


def collect_secrets(data: Any, lookup: Callable[[str], str | None] | None = None) -> set[str]:
    """Every secret value in experiment data (a parsed YAML mapping or a spec's dump), any depth:
    string values under secret names (not ``{env.NAME}`` references), key-shaped strings, URL
    credentials, and (with ``lookup``, a variable's value by name) the values of the variables
    that references name."""
    found: set[str] = set()

    def visit(value: Any, name: str | None) -> None:
        if isinstance(value, Mapping):
            for key, item in value.items():
                visit(item, str(key))
            return
        if isinstance(value, list | tuple):
            for item in value:
                visit(item, name)
            return
        if isinstance(value, bool) or value is None:
            return
        text = str(value)
        references = env_references(text)
        if name is not None and is_secret_name(name) and not references:
            found.add(text)
        found.update(m.group(0) for m in _KEY_SHAPES.finditer(text))
        if "://" in text:
            found.update(v for _, v in url_credentials(text))
        if lookup is not None:
            for ref in references:
                if ENV_NAME.match(ref):
                    resolved = lookup(ref)
                    if resolved:
                        found.add(resolved)

    visit(data, None)
    return {v for v in found if len(v) >= MIN_SECRET_CHARS}


def redact_data(data: Any, name: str | None = None) -> Any:
    """``data`` with each value under a secret name replaced by ``***`` (whatever its length; an
    ``{env.NAME}`` reference is kept: it is no secret), any depth; for experiment dumps and engine
    arguments, whose names mean what they say."""
    if isinstance(data, Mapping):
        return {k: redact_data(v, str(k)) for k, v in data.items()}
    if isinstance(data, list | tuple):
        return [redact_data(v, name) for v in data]
    if name is not None and is_secret_name(name) and data is not None and not isinstance(data, bool):
        return data if is_env_reference(data) else REDACTED
    return data


# -- Python logging (and so Prefect's logs and the terminal) --------------------------------------


class SecretFilter(logging.Filter):
    """Scrubs a log record in place (message, arguments, traceback, stack) before any handler
    formats it; installed on handlers, it covers every record they emit, from any logger."""

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            message = record.getMessage()
        except Exception:  # a record whose arguments do not format: leave it to the handler
            return True
        clean = scrub(message)
        if clean != message:
            record.msg, record.args = clean, ()
        if record.exc_info and not record.exc_text:
            record.exc_text = logging.Formatter().formatException(record.exc_info)
        if record.exc_text:
            record.exc_text = scrub(record.exc_text)
        if record.stack_info:
            record.stack_info = scrub(record.stack_info)
        return True


_FILTER = SecretFilter()


def _scrubbing_factory(inner: Callable[..., logging.LogRecord]) -> Callable[..., logging.LogRecord]:
    def make(*args: Any, **kwargs: Any) -> logging.LogRecord:
        record = inner(*args, **kwargs)
        _FILTER.filter(record)
        return record

    make.k3pipe_scrubbing = True  # type: ignore[attr-defined]
    return make


def install_log_filter() -> None:
    """Scrub every log record where it is made: a record factory (:func:`logging.setLogRecordFactory`)
    that runs :class:`SecretFilter` on each record any logger creates, so that every handler, those
    made later too (the CLI's log file, Prefect's API and console handlers, a worker's), only ever
    sees scrubbed records; and the filter on every handler there is now (the root's, every
    logger's, logging's last resort), for records made before it. Idempotent: call it before
    logging is configured and again whenever handlers may have been added."""
    current = logging.getLogRecordFactory()
    if not getattr(current, "k3pipe_scrubbing", False):
        logging.setLogRecordFactory(_scrubbing_factory(current))
    handlers: list[logging.Handler] = list(logging.getLogger().handlers)
    for logger in list(logging.Logger.manager.loggerDict.values()):
        if isinstance(logger, logging.Logger):
            handlers.extend(logger.handlers)
    if logging.lastResort is not None:
        handlers.append(logging.lastResort)
    for handler in handlers:
        if _FILTER not in handler.filters:
            handler.addFilter(_FILTER)


class ScrubbedStream:
    """A text stream whose writes are scrubbed on the way (the command line's stdout and stderr:
    what a person's terminal, or a CI log, shows). Everything else is the wrapped stream's."""

    def __init__(self, stream: Any) -> None:
        self._stream = stream

    def write(self, text: str) -> int:
        self._stream.write(scrub(text))
        return len(text)

    def writelines(self, lines: Iterable[str]) -> None:
        for line in lines:
            self.write(line)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)
