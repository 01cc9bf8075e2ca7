"""The health gate: wait until the engine answers, fail fast when it dies, then prove the endpoint
with the three settings (base URL, key, model id) and one streamed chat completion."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from urllib.parse import urlsplit

import httpx
from pydantic import BaseModel, ConfigDict, Field, SecretStr

from k3pipe.bench.client import stream_options
from k3pipe.core.errors import EndpointAuthError, HealthError, LaunchError, ModelNotServedError
from k3pipe.core.http import tls
from k3pipe.core.secrets import scrub
from k3pipe.engines import get_engine
from k3pipe.launchers.base import Launcher
from k3pipe.planning.plan import ArmPlan

__all__ = [
    "EndpointCheck",
    "GateTarget",
    "check_endpoint",
    "gate_target",
    "reset_prefix_cache",
    "server_root",
    "wait_until_healthy",
]


@dataclass(frozen=True)
class GateTarget:
    """Who the health gate's proof talks to, and which spec fields set its three settings: what its
    messages name (the gateway's fields for a gateway, the endpoint's otherwise)."""

    who: str = "the endpoint"
    base_field: str = "endpoint.base_url"
    key_field: str = "endpoint.api_key_env"
    key_var: str | None = None
    model_field: str = "endpoint.model or model.served_name"
    usage_field: str = "endpoint.continuous_usage_stats"
    gateway: bool = False

    def key_hint(self, sent: bool) -> str:
        """Where the key comes from, and whether one was ``sent`` (never the key itself)."""
        if self.key_var is None:
            return f"{self.key_field} is not set, so no key was sent"
        state = "set" if sent else "unset or empty, so no key was sent"
        return f"{self.key_field} names {self.key_var} ({state})"


def gate_target(plan: ArmPlan) -> GateTarget:
    """The :class:`GateTarget` of an arm's plan: its gateway when it has one, else its endpoint."""
    if plan.gateway is None:
        return GateTarget(key_var=plan.api_key_env)
    return GateTarget(
        who="the gateway",
        base_field="gateway.base_url",
        key_field="gateway.api_key_env",
        key_var=plan.gateway.api_key_env,
        model_field="gateway.model",
        usage_field="gateway.continuous_usage_stats",
        gateway=True,
    )


def _auth_hint(target: GateTarget, sent: bool) -> str:
    if target.gateway:
        return (
            f"the gateway's key is wrong or missing: {target.key_hint(sent)}; that variable must hold a key "
            "the gateway accepts (LiteLLM: its master key or a virtual key), not the engine's key "
            "(endpoint.api_key_env is the engine's). Then check gateway.base_url's path and gateway.model"
        )
    return (
        f"check, in this order: the key ({target.key_hint(sent)}; is it right?), the base URL's path (a "
        "gateway usually needs '/v1' or '/api/v1'), and that all three settings (base URL, key, model "
        "id) are set"
    )


class EndpointCheck(BaseModel):
    """What the health gate proved about an endpoint."""

    model_config = ConfigDict(frozen=True)

    base_url: str = Field(description="The base URL that was checked.")
    model: str = Field(description="The model id that answered.")
    served_models: list[str] = Field(description="Ids listed by /v1/models.")
    first_delta_s: float = Field(description="Time to the first delta of the probe request.")
    reply_kinds: list[str] = Field(description="Delta fields seen: content, reasoning, ...")


def server_root(base_url: str) -> str:
    """'http://h:p/v1' -> 'http://h:p' (where /health and /version live)."""
    parts = urlsplit(base_url)
    return f"{parts.scheme}://{parts.netloc}"


def wait_until_healthy(
    url: str | None,
    launcher: Launcher,
    timeout_s: float,
    poll_s: float = 1.0,
    on_wait: Callable[[float], None] | None = None,
    progress: Callable[[str], None] | None = None,
) -> float:
    """Poll until the launcher says ready (:meth:`Launcher.ready`, its start's changes reported to
    ``progress``) and ``url`` (None: the launcher alone tells) answers 200; the seconds waited.

    Fails fast with the log tail when the engine exits first, and with the tail on timeout.
    """
    t0 = time.perf_counter()
    last_report = t0
    last_error = "no answer yet"
    where = url or f"its {launcher.kind} launcher"
    with httpx.Client(timeout=5.0, trust_env=False, verify=tls(False)) as client:
        while True:
            ready = launcher.ready(progress)  # raises where the launcher knows why the start failed
            if not launcher.alive():
                raise LaunchError(
                    f"the engine exited with code {launcher.exit_code()} before {where} said ready; "
                    f"last log lines ({launcher.log_path}):\n{launcher.log_tail()}"
                )
            if not ready:
                last_error = "not ready yet"
            elif url is None:
                return time.perf_counter() - t0
            else:
                try:
                    resp = client.get(url)
                    if resp.status_code == 200:
                        return time.perf_counter() - t0
                    last_error = f"HTTP {resp.status_code}"
                except httpx.TransportError as exc:
                    last_error = type(exc).__name__
            now = time.perf_counter()
            if now - t0 > timeout_s:
                raise LaunchError(
                    f"the engine did not become healthy at {where} within {timeout_s:.0f} s "
                    f"(last: {last_error}); raise launcher.startup_timeout_s if a cold start takes "
                    f"longer; last log lines ({launcher.log_path}):\n{launcher.log_tail()}"
                )
            if on_wait and now - last_report >= 10:
                on_wait(now - t0)
                last_report = now
            time.sleep(poll_s)


def _headers(api_key: SecretStr | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key.get_secret_value()}"} if api_key else {}


def _body(resp: httpx.Response, api_key: SecretStr | None) -> str:
    """The start of an error body for a message, without the key (a gateway may echo the request's
    Authorization header): scrubbed before the cut, so that a key across the cut goes whole."""
    text = resp.text
    if api_key is not None and api_key.get_secret_value():
        text = text.replace(api_key.get_secret_value(), "***")
    return scrub(text)[:300]


def _raise_for_status(
    resp: httpx.Response,
    what: str,
    base_url: str,
    api_key: SecretStr | None = None,
    target: GateTarget | None = None,
) -> None:
    target = target or GateTarget()
    status, sent = resp.status_code, api_key is not None
    where = f"{target.who} at {base_url}: {what} answered {status}"
    if status in (401, 403):
        raise EndpointAuthError(f"{where}: {_auth_hint(target, sent)}", status=status)
    if status == 404:
        raise HealthError(
            f"{where}: {target.base_field}'s path is probably wrong (it must end where '/models' and "
            "'/chat/completions' live, e.g. '/v1' or '/api/v1')",
            status=status,
        )
    if what == "GET /models" and (status == 400 or (not sent and status == 500)):
        # GET /models takes no parameters: a 400 there is about the credentials (LiteLLM without a
        # database answers a key that is not its master key with 400 'No connected db.'), and
        # LiteLLM 1.108 answers a request without a key with 500
        raise EndpointAuthError(
            f"{where} ({_body(resp, api_key)}): {_auth_hint(target, sent)}", status=status
        )
    if status >= 400:
        raise HealthError(f"{where}: {_body(resp, api_key)}", status=status)


def check_endpoint(
    base_url: str,
    model: str,
    api_key: SecretStr | None,
    timeout_s: float = 60.0,
    client: httpx.Client | None = None,
    continuous_usage: bool = True,
    target: GateTarget | None = None,
) -> EndpointCheck:
    """Prove the endpoint: the model is listed, and one streamed chat completion yields a delta.

    The probe asks for ``stream_options`` as the benchmark will (``continuous_usage_stats`` when
    ``continuous_usage``), so an endpoint that refuses that field fails here, before any workload,
    with the setting to change. ``target`` says who answers (the endpoint or a gateway) and which
    spec fields set what, for the messages.
    """
    target = target or GateTarget()
    own = client is None
    http = client or httpx.Client(timeout=timeout_s, trust_env=False, verify=tls(False))
    try:
        try:
            resp = http.get(f"{base_url}/models", headers=_headers(api_key))
        except httpx.ConnectError as exc:
            running = "the gateway running" if target.gateway else "the engine running"
            raise HealthError(
                f"nothing answers at {base_url}, {target.who}'s base URL ({exc}); is {running} and "
                f"{target.base_field}'s host and port right?"
            ) from exc
        except httpx.TransportError as exc:
            raise HealthError(f"could not reach {base_url}/models: {exc!r}") from exc
        _raise_for_status(resp, "GET /models", base_url, api_key, target)
        try:
            ids = [str(m["id"]) for m in resp.json().get("data", [])]
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise HealthError(
                f"{target.who} at {base_url}: GET /models did not return an OpenAI model list "
                f"(is {target.base_field}'s path right?): {_body(resp, api_key)}"
            ) from exc
        if model not in ids:
            raise ModelNotServedError(_not_served(model, base_url, ids, target))
        try:
            return _probe(http, base_url, model, api_key, ids, continuous_usage, target)
        except HealthError as exc:
            if not continuous_usage or exc.status not in (400, 422):
                raise
            _probe(http, base_url, model, api_key, ids, False, target)  # raises if still bad
            raise HealthError(
                f"{target.who} at {base_url} refuses stream_options.continuous_usage_stats ({exc}) but "
                f"answers without it: set {target.usage_field}: false (ITL is then per chunk, labelled so)"
            ) from exc
    finally:
        if own:
            http.close()


def _not_served(model: str, base_url: str, ids: list[str], target: GateTarget) -> str:
    listed = ", ".join(repr(i) for i in ids) or "no models"
    if target.gateway:
        return (
            f"the gateway at {base_url} does not list gateway.model {model!r}; its /models lists: {listed}. "
            "gateway.model must be one of those, exactly: the id the gateway knows the model by "
            "(its own name for the route to the engine), not the engine's served name"
        )
    return (
        f"model id {model!r} is not served at {base_url}; it lists: {listed} (the id must match "
        f"exactly; set {target.model_field})"
    )


def _probe(
    http: httpx.Client,
    base_url: str,
    model: str,
    api_key: SecretStr | None,
    ids: list[str],
    continuous_usage: bool = True,
    target: GateTarget | None = None,
) -> EndpointCheck:
    body = {
        "model": model,
        "messages": [{"role": "user", "content": "Say hello."}],
        "max_tokens": 8,
        "stream": True,
        "stream_options": stream_options(continuous_usage),
    }
    kinds: list[str] = []
    saw_choices = False
    first: float | None = None
    t0 = time.perf_counter()
    try:
        with http.stream(
            "POST", f"{base_url}/chat/completions", json=body, headers=_headers(api_key)
        ) as resp:
            if resp.status_code >= 400:
                resp.read()
                _raise_for_status(resp, "POST /chat/completions", base_url, api_key, target)
            for line in resp.iter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                try:
                    chunk = json.loads(data)
                except ValueError as exc:
                    shown = scrub(data)[:200]
                    raise HealthError(f"the stream sent a line that is not JSON: {shown}") from exc
                if "error" in chunk:
                    shown = scrub(json.dumps(chunk["error"]))[:300]
                    raise HealthError(f"the stream reported an error: {shown}")
                for choice in chunk.get("choices") or []:
                    saw_choices = True
                    delta = choice.get("delta") or {}
                    for key in ("content", "reasoning", "reasoning_content", "tool_calls"):
                        if delta.get(key):
                            if first is None:
                                first = time.perf_counter() - t0
                            if key not in kinds:
                                kinds.append(key)
    except httpx.TransportError as exc:
        raise HealthError(f"the probe request to {base_url}/chat/completions failed: {exc!r}") from exc
    if not saw_choices:
        raise HealthError(
            f"the stream from {base_url}/chat/completions carried no choices ('Error reading "
            "choices'): the stream was cut or the server is not OpenAI-compatible"
        )
    if first is None:
        raise HealthError(
            f"the stream from {base_url}/chat/completions carried choices but no content, reasoning "
            "or tool-call delta"
        )
    return EndpointCheck(
        base_url=base_url, model=model, served_models=ids, first_delta_s=first, reply_kinds=kinds
    )


Progress = Callable[[str], None]


def wait_ready(plan: ArmPlan, launcher: Launcher, progress: Progress | None = None) -> float:
    """Wait until the engine answers its health URL (an engine served through a gateway: until its
    launcher says ready); returns the seconds waited (0 for an endpoint k3pipe did not start)."""
    if plan.health_url is None and not plan.launch.starts_engine:
        return 0.0
    where = plan.health_url or f"{plan.launcher} ({plan.base_url})"

    def waiting(elapsed: float) -> None:
        if progress:
            progress(f"waiting for {plan.engine} at {where}: {elapsed:.0f} s")

    return wait_until_healthy(
        plan.health_url, launcher, plan.startup_timeout_s, on_wait=waiting, progress=progress
    )


def engine_version(plan: ArmPlan) -> str | None:
    """The version the running engine reports, if it has a version endpoint."""
    if not plan.version_url:
        return plan.engine_version
    try:
        resp = httpx.get(plan.version_url, timeout=10.0, trust_env=False, verify=tls(False))
        if resp.status_code == 200:
            return get_engine(plan.engine).version_from(resp.json()) or plan.engine_version
    except (httpx.HTTPError, ValueError):
        pass
    return plan.engine_version


def reset_prefix_cache(plan: ArmPlan, api_key: SecretStr | None, timeout_s: float = 30.0) -> bool:
    """Empty the engine's prefix cache (its ``prefix_cache_reset_path``, POSTed at the server root):
    whether it answered 2xx. False, never an error, where the engine offers no way or refused (vLLM
    serves it only with ``VLLM_SERVER_DEV_MODE=1``): the caller records which it was."""
    path = get_engine(plan.engine).prefix_cache_reset_path
    if path is None:
        return False
    try:
        resp = httpx.post(
            server_root(plan.base_url) + path, headers=_headers(api_key), timeout=timeout_s, verify=tls()
        )
    except httpx.HTTPError:
        return False
    return resp.is_success
