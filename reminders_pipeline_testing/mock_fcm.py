"""A strict mock of Firebase Cloud Messaging HTTP v1 and of Google's OAuth2 token endpoint, over TLS.

One ASGI app on 127.0.0.1, served by hypercorn (``tls_loop``), answers both endpoints on both
protocols, chosen by ALPN: ``h2`` and ``http/1.1`` (also what a client that offers no ALPN gets).
Both are needed: google-auth refreshes its token through ``requests`` (HTTP/1.1), and an
FCM sender may speak either. What it checks, in Google's order:

* ``POST /token`` (the ``token_uri`` of the service-account files it writes): a form body with
  ``grant_type=urn:ietf:params:oauth:grant-type:jwt-bearer`` and an RS256 ``assertion`` signed by a
  service-account key it made (``kid`` = ``private_key_id`` when present), ``iss`` = that
  ``client_email``, ``aud`` = the ``token_uri`` or ``https://oauth2.googleapis.com/token`` (what
  google-auth sends whatever the file's ``token_uri``, and what Google accepts), ``exp`` at most an
  hour after ``iat`` and both within a minute of now, and a ``scope`` holding ``firebase.messaging``
  (or ``cloud-platform``). A 200 is ``{"access_token", "expires_in", "token_type": "Bearer"}``; a
  failure is Google's OAuth error body (400 ``invalid_grant``, ``invalid_scope``,
  ``invalid_request``, ``unsupported_grant_type``; 401 ``unauthorized_client`` for a ``sub``).
  ``script_token(status, delay=)`` makes it answer an OAuth error instead, late if asked: a token
  endpoint that is down (5xx) or refuses the key (4xx).
* ``POST /v1/projects/<project>/messages:send``: ``Authorization: Bearer`` with a token it issued
  and that is neither expired nor revoked (else 401 ``UNAUTHENTICATED``, with Google's
  ``WWW-Authenticate``); the project of the token's service account (else 403
  ``PERMISSION_DENIED``); then the body as FCM parses it (``application/json``, no unknown or
  duplicate fields, proto3 JSON field names in either spelling, types, a token target, ``ttl`` a
  non-negative duration of at most 4 weeks, ``priority`` ``HIGH``/``NORMAL``, ``data`` a string map
  without reserved keys, the 4096-byte payload), answering 400 ``INVALID_ARGUMENT``. Only then the
  scripted answer for the registration token: 200 ``{"name": "projects/<p>/messages/<id>"}`` or
  FCM's error body, ``{"error": {"code", "message", "status", "details": [FcmError]}}``.
* any other path or method: 404 ``{"error": {"code": 404, "message": "Method not found.", ...}}``
  with no ``details``, so a client that reads every 404 as ``UNREGISTERED`` is caught.

It runs its own event loop in a background thread, so a synchronous test, an asyncio test and a
benchmark script can all use it. The CA, the server certificate and every service-account key are
generated when it is created or asked; nothing secret lives in the repository.
"""

from __future__ import annotations

import json
import re
import secrets
import time
import urllib.parse
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jwt
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import rsa
from starlette.requests import Request

from .tls_loop import AsgiServer, Reply, request_target

JWT_BEARER = "urn:ietf:params:oauth:grant-type:jwt-bearer"
GOOGLE_TOKEN_URI = "https://oauth2.googleapis.com/token"
FCM_SCOPE = "https://www.googleapis.com/auth/firebase.messaging"
CLOUD_PLATFORM_SCOPE = "https://www.googleapis.com/auth/cloud-platform"
MAX_PAYLOAD_BYTES = 4096
MAX_TTL_SECONDS = 28 * 24 * 3600  # FCM keeps a message at most 4 weeks
ASSERTION_MAX_LIFETIME = 3600
CLOCK_SKEW_SECONDS = 60
SEND_PATH = re.compile(r"^/v1/projects/(?P<project>[^/]+)/messages:send$")
DURATION = re.compile(r"^(?P<sign>-?)(?P<seconds>\d+)(?:\.(?P<fraction>\d{1,9}))?s$")
FCM_ERROR_TYPE = "type.googleapis.com/google.firebase.fcm.v1.FcmError"
BAD_REQUEST_TYPE = "type.googleapis.com/google.rpc.BadRequest"

# FCM's errorCode → the HTTP status it comes with (the google.rpc status follows from the HTTP status).
ERROR_STATUS: dict[str, int] = {
    "UNREGISTERED": 404,
    "INVALID_ARGUMENT": 400,
    "QUOTA_EXCEEDED": 429,
    "UNAVAILABLE": 503,
    "INTERNAL": 500,
    "SENDER_ID_MISMATCH": 403,
    "THIRD_PARTY_AUTH_ERROR": 401,
}
ERROR_MESSAGES: dict[str, str] = {
    "UNREGISTERED": "Requested entity was not found.",
    "INVALID_ARGUMENT": "The registration token is not a valid FCM registration token",
    "QUOTA_EXCEEDED": "Quota exceeded for quota metric 'Send requests' and limit 'Send requests per minute'.",
    "UNAVAILABLE": "The service is currently unavailable.",
    "INTERNAL": "Internal error encountered.",
    "SENDER_ID_MISMATCH": "SenderId mismatch",
    "THIRD_PARTY_AUTH_ERROR": "Auth error from APNS or Web Push Service",
}
RPC_STATUS: dict[int, str] = {
    400: "INVALID_ARGUMENT",
    401: "UNAUTHENTICATED",
    403: "PERMISSION_DENIED",
    404: "NOT_FOUND",
    409: "ABORTED",
    429: "RESOURCE_EXHAUSTED",
    499: "CANCELLED",
    500: "INTERNAL",
    501: "NOT_IMPLEMENTED",
    503: "UNAVAILABLE",
    504: "DEADLINE_EXCEEDED",
}
UNAUTHENTICATED_MESSAGE = (
    "Request had invalid authentication credentials. Expected OAuth 2 access token, login cookie or other "
    "valid authentication credential. See https://developers.google.com/identity/sign-in/web/devconsole-project."
)
JWT_TIMES_MESSAGE = (
    "Invalid JWT: Token must be a short-lived token (60 minutes) and in a reasonable timeframe. "
    "Check your iat and exp values in the JWT claim."
)


@dataclass(frozen=True)
class Answer:
    """How the mock answers one send that passed authentication and validation.

    ``status`` None means 200 without an ``error_code``, else the HTTP status FCM pairs with it
    (``ERROR_STATUS``); an explicit status overrides, and a non-200 status with no ``error_code``
    answers Google's error body without ``details``, as a front end in Google's path may.
    ``retry_after`` is sent as the ``Retry-After`` header (seconds); ``delay`` seconds pass before
    the answer goes out.
    """

    status: int | None = None
    error_code: str | None = None
    retry_after: int | None = None
    delay: float = 0.0

    def __post_init__(self) -> None:
        if self.error_code is not None and self.error_code not in ERROR_STATUS:
            raise ValueError(f"unknown FCM errorCode {self.error_code!r}; one of {sorted(ERROR_STATUS)}")
        if self.error_code is not None and self.status == 200:
            raise ValueError("an answer with an error_code cannot have status 200")

    @property
    def http_status(self) -> int:
        if self.status is not None:
            return self.status
        return ERROR_STATUS[self.error_code] if self.error_code is not None else 200


@dataclass
class _Scripted:
    answer: Answer
    times: int | None  # None = every time


@dataclass(frozen=True)
class RecordedSend:
    """One request to ``messages:send``, whatever its answer (401s and 400s included)."""

    token: str  # message.token, or "" when the body had none
    status: int  # the HTTP status answered
    message: dict[str, Any] | None  # the request's ``message`` object as sent; None when the body was not JSON
    access_token: str | None  # the bearer token presented
    at: float  # time.time() when the request was complete
    project: str
    error_code: str | None  # the FcmError errorCode answered, if any
    protocol: str  # "h2" or "http/1.1"
    validate_only: bool


@dataclass(frozen=True)
class ServiceAccount:
    project_id: str
    client_email: str
    key_id: str
    public_key: rsa.RSAPublicKey
    path: Path


@dataclass(frozen=True)
class _Issued:
    account: ServiceAccount
    expires_at: float


@dataclass(frozen=True)
class _Request:
    method: str
    target: str
    headers: dict[str, str]  # lower-case names; a repeated header's values joined by ", "
    body: bytes
    protocol: str
    received_at: float


def _json_response(status: int, body: Any, *headers: tuple[str, str], delay: float = 0.0) -> Reply:
    return Reply(
        status, (("content-type", "application/json; charset=UTF-8"), *headers), json.dumps(body).encode(), delay
    )


def _google_error(status: int, message: str, details: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    error: dict[str, Any] = {"code": status, "message": message, "status": RPC_STATUS.get(status, "UNKNOWN")}
    if details:
        error["details"] = details
    return {"error": error}


def _oauth_error(status: int, error: str, description: str) -> Reply:
    return _json_response(status, {"error": error, "error_description": description})


class _Invalid(Exception):
    """A send body FCM would refuse with 400 INVALID_ARGUMENT."""

    def __init__(self, description: str, field: str | None = None) -> None:
        super().__init__(description)
        self.description = description
        self.field = field


def _invalid_argument(problem: _Invalid) -> dict[str, Any]:
    details: list[dict[str, Any]] = [{"@type": FCM_ERROR_TYPE, "errorCode": "INVALID_ARGUMENT"}]
    if problem.field is not None:
        violation = {"field": problem.field, "description": problem.description}
        details.append({"@type": BAD_REQUEST_TYPE, "fieldViolations": [violation]})
    return _google_error(400, problem.description, details)


# -- the send body, as FCM's proto3 JSON parser sees it -------------------------------------------

# Field (proto name) → kind, for the objects the pipeline fills. Objects marked "object" are FCM's
# (so known) but not used by the pipeline: any JSON object passes.
_MESSAGE_FIELDS = {
    "name": "string",
    "data": "map",
    "notification": "notification",
    "android": "android",
    "webpush": "object",
    "apns": "object",
    "fcm_options": "object",
    "token": "string",
    "topic": "string",
    "condition": "string",
}
_NOTIFICATION_FIELDS = {"title": "string", "body": "string", "image": "string"}
_ANDROID_FIELDS = {
    "collapse_key": "string",
    "priority": "priority",
    "ttl": "duration",
    "restricted_package_name": "string",
    "data": "map",
    "notification": "object",
    "fcm_options": "object",
    "direct_boot_ok": "bool",
    "bandwidth_constrained_ok": "bool",
    "restricted_satellite_ok": "bool",
}
_REQUEST_FIELDS = {"message": "message", "validate_only": "bool"}
_PRIORITIES = ("NORMAL", "HIGH")
_RESERVED_DATA_KEYS = ("from", "message_type")


def _camel(name: str) -> str:
    first, *rest = name.split("_")
    return first + "".join(part.capitalize() for part in rest)


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    result: dict[str, Any] = {}
    for key, value in pairs:
        if key in result:
            raise _Invalid(f'Invalid JSON payload received. Duplicate name "{key}".')
        result[key] = value
    return result


def _fields(value: Any, where: str, schema: dict[str, str], type_name: str) -> dict[str, Any]:
    """The object's fields under their proto names; a null field is unset, as in proto3 JSON."""
    if not isinstance(value, dict):
        raise _Invalid(f"Invalid value at '{where}' (type.googleapis.com/{type_name}), {json.dumps(value)}", where)
    names = {alias: name for name in schema for alias in (name, _camel(name))}
    fields: dict[str, Any] = {}
    for key, item in value.items():
        name = names.get(key)
        if name is None:
            raise _Invalid(
                f"Invalid JSON payload received. Unknown name \"{key}\" at '{where}': Cannot find field.", where
            )
        if name in fields:
            raise _Invalid(
                f"Invalid JSON payload received. Duplicate field \"{name}\" at '{where}'.", f"{where}.{name}"
            )
        fields[name] = item
    return {name: item for name, item in fields.items() if item is not None}


def _check_scalar(value: Any, where: str, kind: str) -> None:
    if kind == "string" and not isinstance(value, str):
        raise _Invalid(f"Invalid value at '{where}' (TYPE_STRING), {json.dumps(value)}", where)
    if kind == "bool" and not isinstance(value, bool):
        raise _Invalid(f"Invalid value at '{where}' (TYPE_BOOL), {json.dumps(value)}", where)
    if kind == "object" and not isinstance(value, dict):
        raise _Invalid(f"Invalid value at '{where}' (TYPE_MESSAGE), {json.dumps(value)}", where)


def _check_map(value: Any, where: str) -> None:
    if not isinstance(value, dict):
        raise _Invalid(f"Invalid value at '{where}' (map), {json.dumps(value)}", where)
    for key, item in value.items():
        if not isinstance(item, str):
            raise _Invalid(f"Invalid value at '{where}' (TYPE_STRING) for key \"{key}\", {json.dumps(item)}", where)
        lowered = key.lower()
        if key in _RESERVED_DATA_KEYS or lowered.startswith(("google", "gcm")):
            raise _Invalid(f"Invalid data payload key: {key}", where)


def _check_duration(value: Any, where: str) -> None:
    match = DURATION.match(value) if isinstance(value, str) else None
    if match is None:
        raise _Invalid(
            f"Invalid value at '{where}' (type.googleapis.com/google.protobuf.Duration), Field 'ttl', "
            f"Illegal duration format; duration must end with 's' and be a decimal number of seconds: {json.dumps(value)}",
            where,
        )
    seconds = int(match["seconds"]) + int((match["fraction"] or "0").ljust(9, "0")) / 1e9
    if match["sign"] and seconds > 0:
        raise _Invalid(f"Invalid value at '{where}': TTL cannot be negative, {value}", where)
    if seconds > MAX_TTL_SECONDS:
        raise _Invalid(f"Invalid value at '{where}': TTL cannot exceed {MAX_TTL_SECONDS}s (4 weeks), {value}", where)


def _check_object(value: Any, where: str, schema: dict[str, str], type_name: str) -> dict[str, Any]:
    fields = _fields(value, where, schema, type_name)
    for name, item in fields.items():
        kind = schema[name]
        at = f"{where}.{name}"
        if kind == "map":
            _check_map(item, at)
        elif kind == "duration":
            _check_duration(item, at)
        elif kind == "priority":
            if item not in _PRIORITIES:
                raise _Invalid(
                    f"Invalid value at '{at}' (type.googleapis.com/google.firebase.fcm.v1.AndroidMessagePriority), {json.dumps(item)}",
                    at,
                )
        elif kind == "notification":
            _check_object(item, at, _NOTIFICATION_FIELDS, "google.firebase.fcm.v1.Notification")
        elif kind == "android":
            _check_object(item, at, _ANDROID_FIELDS, "google.firebase.fcm.v1.AndroidConfig")
        else:
            _check_scalar(item, at, kind)
    return fields


def _parse_send_body(body: bytes) -> tuple[dict[str, Any], bool]:
    """``(message, validate_only)`` of a valid send body; raises ``_Invalid`` as FCM would refuse it."""
    try:
        request = json.loads(body.decode("utf-8"), object_pairs_hook=_no_duplicates)
    except (UnicodeDecodeError, ValueError) as exc:
        raise _Invalid(f"Invalid JSON payload received. {exc}") from None
    fields = _fields(request, "", _REQUEST_FIELDS, "google.firebase.fcm.v1.SendMessageRequest")
    if "validate_only" in fields:
        _check_scalar(fields["validate_only"], "validate_only", "bool")
    if "message" not in fields:
        raise _Invalid("Request contains an invalid argument: 'message' is required.", "message")
    message = fields["message"]
    checked = _check_object(message, "message", _MESSAGE_FIELDS, "google.firebase.fcm.v1.Message")
    targets = [name for name in ("token", "topic", "condition") if checked.get(name)]
    if len(targets) > 1:
        raise _Invalid(
            f"Invalid value at 'message' (oneof), oneof field 'target' is already set. Cannot set '{targets[1]}'",
            "message",
        )
    if not targets:
        raise _Invalid("Recipient of the message is not set.", "message.token")
    if targets != ["token"]:
        raise _Invalid(
            f"This mock sends to registration tokens only; message.{targets[0]} is not supported.",
            f"message.{targets[0]}",
        )
    payload = {key: value for key, value in message.items() if key != "token"}
    size = len(json.dumps(payload, separators=(",", ":"), ensure_ascii=False).encode())
    if size > MAX_PAYLOAD_BYTES:
        raise _Invalid(
            f"Message is too big: {size} bytes of payload, the limit is {MAX_PAYLOAD_BYTES} bytes.", "message"
        )
    return message, bool(fields.get("validate_only", False))


# -- the server ----------------------------------------------------------------------------------


class MockFcm(AsgiServer):
    """FCM HTTP v1 and its OAuth2 token endpoint in a background thread; a context manager, or
    ``start()`` → ``(host, port)`` and ``stop()``.

    ``service_account_file(project_id)`` writes a key file whose ``token_uri`` is this mock; a
    client trusting ``ca_file`` trades it for an access token at ``/token`` and sends with it.
    Sends answer 200 unless ``script(token, Answer(...))`` or ``script_default(Answer(...))`` says
    otherwise. Every send is in ``requests``; ``tokens_issued`` counts access tokens handed out.
    """

    def __init__(self, *, workdir: str | Path | None = None) -> None:
        # expires_in of the access tokens issued from now on, in seconds. google-auth counts a token
        # as stale 3 min 45 s before its expiry, so below 225 it refreshes before every use.
        self.token_lifetime = 3600
        super().__init__(workdir, name="mock-fcm")
        self._accounts: dict[str, ServiceAccount] = {}  # by key id
        self._issued: dict[str, _Issued] = {}  # by access token
        self._reset_state()

    # -- configuration ---------------------------------------------------------------------

    @property
    def url(self) -> str:
        return f"https://{self.host}:{self.port}"

    @property
    def token_uri(self) -> str:
        return f"{self.url}/token"

    def send_url(self, project_id: str = "demo-project") -> str:
        return f"{self.url}/v1/projects/{project_id}/messages:send"

    def service_account_file(self, project_id: str = "demo-project") -> Path:
        """Write a fresh service-account key file for ``project_id`` (a new RSA 2048 key each call,
        all of them accepted) whose ``token_uri`` is this mock, and return its path."""
        assert self.port, "start the mock first: the key file names its port"
        key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
        pem = key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
        key_id = secrets.token_hex(20)
        client_email = f"reminders@{project_id}.iam.gserviceaccount.com"
        info = {
            "type": "service_account",
            "project_id": project_id,
            "private_key_id": key_id,
            "private_key": pem.decode(),
            "client_email": client_email,
            "client_id": str(secrets.randbelow(9 * 10**20) + 10**20),
            "auth_uri": f"{self.url}/o/oauth2/auth",
            "token_uri": self.token_uri,
            "auth_provider_x509_cert_url": f"{self.url}/oauth2/v1/certs",
            "client_x509_cert_url": f"{self.url}/robot/v1/metadata/x509/{urllib.parse.quote(client_email)}",
            "universe_domain": "googleapis.com",
        }
        path = self.workdir / f"service-account-{project_id}-{key_id[:8]}.json"
        path.write_text(json.dumps(info, indent=2))
        path.chmod(0o600)
        with self._lock:
            self._accounts[key_id] = ServiceAccount(project_id, client_email, key_id, key.public_key(), path)
        return path

    def script(self, token: str, answer: Answer, *, times: int | None = None) -> None:
        """Answer sends to registration ``token`` with ``answer`` (``times`` times, or always)."""
        with self._lock:
            self._scripts[token] = _Scripted(answer, times)

    def script_default(self, answer: Answer) -> None:
        """The answer for every token without a script of its own (``Answer()``, a 200, until set)."""
        with self._lock:
            self._default = answer

    def script_token(self, status: int | None, *, delay: float = 0.0) -> None:
        """Answer every later ``POST /token`` with ``status`` and Google's OAuth error body for it
        (``temporarily_unavailable`` for a 5xx, ``invalid_grant`` else), ``delay`` seconds late,
        instead of checking the grant; None: check and issue again."""
        with self._lock:
            self._token_script = None if status is None else (status, delay)

    def revoke_tokens(self) -> None:
        """Invalidate every access token issued so far: each later send with one gets a 401."""
        with self._lock:
            self._issued.clear()

    def reset(self) -> None:
        """Forget scripts (the token endpoint's too), recorded sends and counters. Service accounts,
        issued tokens, the token lifetime and open connections stay."""
        with self._lock:
            self._reset_state()

    def _reset_state(self) -> None:
        self._scripts: dict[str, _Scripted] = {}
        self._default = Answer()
        self._requests: list[RecordedSend] = []
        self.tokens_issued = 0
        self.token_requests = 0  # every POST /token, refused ones included
        self._token_script: tuple[int, float] | None = None

    # -- observations ----------------------------------------------------------------------

    @property
    def requests(self) -> list[RecordedSend]:
        with self._lock:
            return list(self._requests)

    @property
    def service_accounts(self) -> list[ServiceAccount]:
        with self._lock:
            return list(self._accounts.values())

    def wait_for_requests(self, count: int, timeout: float = 10.0) -> list[RecordedSend]:
        """The recorded sends once there are ``count`` of them, or whatever there is at ``timeout``."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self._lock:
                if len(self._requests) >= count:
                    break
            time.sleep(0.005)
        return self.requests

    # -- called from the server thread -----------------------------------------------------

    async def _respond(self, request: Request, protocol: str) -> Reply:
        headers: dict[str, str] = {}
        for name, value in request.headers.items():
            headers[name] = f"{headers[name]}, {value}" if name in headers else value
        body = await request.body()
        return self._handle(_Request(request.method, request_target(request), headers, body, protocol, time.time()))

    def _handle(self, request: _Request) -> Reply:
        path = urllib.parse.unquote(request.target.split("?", 1)[0])
        if path == "/token":
            if request.method != "POST":
                return _oauth_error(405, "invalid_request", f"Method {request.method} is not allowed; use POST.")
            return self._token(request)
        match = SEND_PATH.match(path)
        if match is None or request.method != "POST":
            return _json_response(404, _google_error(404, "Method not found."))
        return self._send(request, match["project"])

    def _token(self, request: _Request) -> Reply:
        with self._lock:
            self.token_requests += 1
            scripted = self._token_script
        if scripted is not None:
            status, delay = scripted
            error = "temporarily_unavailable" if status >= 500 else "invalid_grant"
            body = {"error": error, "error_description": f"scripted {status}"}
            return _json_response(status, body, delay=delay)
        content_type = request.headers.get("content-type", "").split(";")[0].strip().lower()
        if content_type != "application/x-www-form-urlencoded":
            return _oauth_error(400, "invalid_request", "Content-Type must be application/x-www-form-urlencoded.")
        try:
            pairs = urllib.parse.parse_qsl(request.body.decode("utf-8"), keep_blank_values=True, strict_parsing=True)
        except (UnicodeDecodeError, ValueError):
            return _oauth_error(400, "invalid_request", "Malformed form body.")
        form = dict(pairs)
        if len(form) != len(pairs):
            return _oauth_error(400, "invalid_request", "A parameter is repeated.")
        if form.get("grant_type") != JWT_BEARER:
            return _oauth_error(400, "unsupported_grant_type", f"Invalid grant_type: {form.get('grant_type', '')}")
        if not form.get("assertion"):
            return _oauth_error(400, "invalid_request", "Missing required parameter: assertion")
        refused, account = self._verify_assertion(form["assertion"])
        if refused is not None:
            return refused
        assert account is not None
        access_token = "ya29.mock-" + secrets.token_urlsafe(32)
        with self._lock:
            lifetime = self.token_lifetime
            self._issued[access_token] = _Issued(account, time.time() + lifetime)
            self.tokens_issued += 1
        body = {"access_token": access_token, "expires_in": lifetime, "token_type": "Bearer"}
        return _json_response(
            200, body, ("cache-control", "no-cache, no-store, max-age=0, must-revalidate"), ("pragma", "no-cache")
        )

    def _verify_assertion(self, assertion: str) -> tuple[Reply | None, ServiceAccount | None]:
        """Google's checks of a JWT-bearer grant: the refusal, or the service account it is for."""
        try:
            header = jwt.get_unverified_header(assertion)
            unverified = jwt.decode(assertion, options={"verify_signature": False})
        except jwt.PyJWTError:
            return _oauth_error(400, "invalid_grant", "Invalid JWT: malformed token."), None
        if header.get("alg") != "RS256":
            return _oauth_error(400, "invalid_grant", "Invalid JWT Signature."), None
        issuer = unverified.get("iss")
        with self._lock:
            accounts = [account for account in self._accounts.values() if account.client_email == issuer]
        if not accounts:
            return _oauth_error(400, "invalid_grant", "Invalid grant: account not found"), None
        kid = header.get("kid")
        candidates = [account for account in accounts if kid is None or account.key_id == kid]
        claims: dict[str, Any] | None = None
        account: ServiceAccount | None = None
        for candidate in candidates:
            try:
                claims = jwt.decode(
                    assertion,
                    candidate.public_key,
                    algorithms=["RS256"],
                    audience=[self.token_uri, GOOGLE_TOKEN_URI],
                    issuer=candidate.client_email,
                    options={
                        "require": ["iss", "aud", "exp", "iat"],
                        "verify_exp": False,
                        "verify_iat": False,
                        "verify_nbf": False,
                    },
                )
            except jwt.InvalidSignatureError:
                continue
            except jwt.InvalidAudienceError:
                return _oauth_error(
                    400,
                    "invalid_grant",
                    f"Invalid JWT: Failed audience check. The expected audience is {self.token_uri}.",
                ), None
            except jwt.PyJWTError as exc:
                return _oauth_error(400, "invalid_grant", f"Invalid JWT: {exc}"), None
            account = candidate
            break
        if claims is None or account is None:
            return _oauth_error(400, "invalid_grant", "Invalid JWT Signature."), None
        iat, exp = claims["iat"], claims["exp"]
        now = time.time()
        if (
            not all(isinstance(value, int | float) and not isinstance(value, bool) for value in (iat, exp))
            or exp <= iat
            or exp - iat > ASSERTION_MAX_LIFETIME
            or iat > now + CLOCK_SKEW_SECONDS
            or exp < now - CLOCK_SKEW_SECONDS
        ):
            return _oauth_error(400, "invalid_grant", JWT_TIMES_MESSAGE), None
        if "sub" in claims and claims["sub"] != account.client_email:
            return _oauth_error(
                401,
                "unauthorized_client",
                "Client is unauthorized to retrieve access tokens using this method, or client not authorized for any of the scopes requested.",
            ), None
        scopes = claims.get("scope")
        if not isinstance(scopes, str) or not {FCM_SCOPE, CLOUD_PLATFORM_SCOPE} & set(scopes.split()):
            return _oauth_error(
                400, "invalid_scope", f"Invalid OAuth scope or ID token audience provided; FCM needs {FCM_SCOPE}."
            ), None
        return None, account

    def _send(self, request: _Request, project: str) -> Reply:
        access_token = _bearer(request.headers.get("authorization", ""))
        try:
            sent = json.loads(request.body)
            message = sent.get("message") if isinstance(sent, dict) else None
        except ValueError:
            message = None
        message = message if isinstance(message, dict) else None
        token = message.get("token") if message is not None else None

        def record(status: int, error_code: str | None = None, validate_only: bool = False) -> None:
            recorded = RecordedSend(
                token=token if isinstance(token, str) else "",
                status=status,
                message=message,
                access_token=access_token,
                at=request.received_at,
                project=project,
                error_code=error_code,
                protocol=request.protocol,
                validate_only=validate_only,
            )
            with self._lock:
                self._requests.append(recorded)

        with self._lock:
            issued = self._issued.get(access_token) if access_token else None
        if issued is None or issued.expires_at <= time.time():
            record(401)
            challenge = 'Bearer realm="https://accounts.google.com/", error="invalid_token"'
            return _json_response(401, _google_error(401, UNAUTHENTICATED_MESSAGE), ("www-authenticate", challenge))
        if issued.account.project_id != project:
            record(403)
            denied = (
                f"Permission 'cloudmessaging.messages.create' denied on resource "
                f"'//cloudresourcemanager.googleapis.com/projects/{project}' (or it may not exist)."
            )
            info = {
                "@type": "type.googleapis.com/google.rpc.ErrorInfo",
                "reason": "IAM_PERMISSION_DENIED",
                "domain": "cloudresourcemanager.googleapis.com",
            }
            return _json_response(403, _google_error(403, denied, [info]))
        content_type = request.headers.get("content-type", "").split(";")[0].strip().lower()
        try:
            if content_type != "application/json":
                raise _Invalid(f"Invalid Content-Type {content_type or '(none)'!r}: the body must be application/json.")
            checked, validate_only = _parse_send_body(request.body)
        except _Invalid as problem:
            record(400, "INVALID_ARGUMENT")
            return _json_response(400, _invalid_argument(problem))
        answer = self._scripted(checked["token"])
        status = answer.http_status
        record(status, answer.error_code, validate_only)
        headers = (("retry-after", str(answer.retry_after)),) if answer.retry_after is not None else ()
        if status == 200:
            message_id = "fake_message_id" if validate_only else f"0:{int(time.time() * 1000)}%{secrets.token_hex(8)}"
            return _json_response(
                200, {"name": f"projects/{project}/messages/{message_id}"}, *headers, delay=answer.delay
            )
        if answer.error_code is None:
            body = _google_error(status, "The service returned an error.")
        else:
            details = [{"@type": FCM_ERROR_TYPE, "errorCode": answer.error_code}]
            body = _google_error(status, ERROR_MESSAGES[answer.error_code], details)
        return _json_response(status, body, *headers, delay=answer.delay)

    def _scripted(self, token: str) -> Answer:
        with self._lock:
            scripted = self._scripts.get(token)
            if scripted is None:
                return self._default
            if scripted.times is not None:
                scripted.times -= 1
                if scripted.times <= 0:
                    del self._scripts[token]
            return scripted.answer


def _bearer(authorization: str) -> str | None:
    scheme, _, credentials = authorization.strip().partition(" ")
    if scheme.lower() != "bearer":
        return None
    return credentials.strip() or None
