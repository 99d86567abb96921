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

It runs on ``tls_loop``'s loop in a background thread. The CA, the server certificate and every
service-account key are generated when it is created or asked; nothing secret lives in the repository.
"""

from __future__ import annotations

import json
import re
import secrets
import time
import urllib.parse
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal, Self

import jwt
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import rsa
from pydantic import AfterValidator, BaseModel, ConfigDict, ValidationError, model_validator
from pydantic.alias_generators import to_camel
from starlette.requests import Request

from .tls_loop import AsgiServer, Reply, Scripts, parsed_json, request_target

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

# FCM's errorCode → the HTTP status it comes with and FCM's message (the google.rpc status follows from the HTTP status).
ERRORS: dict[str, tuple[int, str]] = {
    "UNREGISTERED": (404, "Requested entity was not found."),
    "INVALID_ARGUMENT": (400, "The registration token is not a valid FCM registration token"),
    "QUOTA_EXCEEDED": (429, "Quota exceeded for quota metric 'Send requests' and limit 'Send requests per minute'."),
    "UNAVAILABLE": (503, "The service is currently unavailable."),
    "INTERNAL": (500, "Internal error encountered."),
    "SENDER_ID_MISMATCH": (403, "SenderId mismatch"),
    "THIRD_PARTY_AUTH_ERROR": (401, "Auth error from APNS or Web Push Service"),
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
    (``ERRORS``); an explicit status overrides, and a non-200 status with no ``error_code``
    answers Google's error body without ``details``, as a front end in Google's path may.
    ``retry_after`` is sent as the ``Retry-After`` header (seconds); ``delay`` seconds pass before
    the answer goes out.
    """

    status: int | None = None
    error_code: str | None = None
    retry_after: int | None = None
    delay: float = 0.0

    def __post_init__(self) -> None:
        if self.error_code is not None and self.error_code not in ERRORS:
            raise ValueError(f"unknown FCM errorCode {self.error_code!r}; one of {sorted(ERRORS)}")
        if self.error_code is not None and self.status == 200:
            raise ValueError("an answer with an error_code cannot have status 200")

    @property
    def http_status(self) -> int:
        if self.status is not None:
            return self.status
        return ERRORS[self.error_code][0] if self.error_code is not None else 200


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


def _json_response(status: int, body: Any, *headers: tuple[str, str], delay: float = 0.0) -> Reply:
    return Reply(
        status, (("content-type", "application/json; charset=UTF-8"), *headers), json.dumps(body).encode(), delay
    )


def _google_error(status: int, message: str, details: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    error: dict[str, Any] = {"code": status, "message": message, "status": RPC_STATUS.get(status, "UNKNOWN")}
    if details:
        error["details"] = details
    return {"error": error}


class _OAuthError(Exception):
    """A token request Google refuses: ``reply`` is its OAuth error body."""

    def __init__(self, status: int, error: str, description: str) -> None:
        super().__init__(description)
        self.reply = _json_response(status, {"error": error, "error_description": description})


class _Invalid(Exception):
    """A send body FCM would refuse with 400 INVALID_ARGUMENT."""

    def __init__(self, description: str, field: str | None = None) -> None:
        super().__init__(description)
        self.field = field

    def body(self) -> dict[str, Any]:
        details: list[dict[str, Any]] = [{"@type": FCM_ERROR_TYPE, "errorCode": "INVALID_ARGUMENT"}]
        if self.field is not None:
            violation = {"field": self.field, "description": str(self)}
            details.append({"@type": BAD_REQUEST_TYPE, "fieldViolations": [violation]})
        return _google_error(400, str(self), details)


# -- the send body, as FCM's proto3 JSON parser sees it -------------------------------------------


def _duration(value: str) -> str:
    """A proto3 Duration, decimal seconds ending in ``s``; FCM's TTL is not negative and at most 4 weeks."""
    match = DURATION.match(value)
    if match is None:
        raise ValueError(f"Illegal duration format; it must end with 's' and be a decimal number of seconds: {value!r}")
    seconds = int(match["seconds"]) + int((match["fraction"] or "0").ljust(9, "0")) / 1e9
    if match["sign"] and seconds > 0:
        raise ValueError(f"TTL cannot be negative, {value}")
    if seconds > MAX_TTL_SECONDS:
        raise ValueError(f"TTL cannot exceed {MAX_TTL_SECONDS}s (4 weeks), {value}")
    return value


def _data(value: dict[str, str]) -> dict[str, str]:
    """FCM's data map: none of the keys FCM keeps for itself."""
    for key in value:
        if key in ("from", "message_type") or key.lower().startswith(("google", "gcm")):
            raise ValueError(f"Invalid data payload key: {key}")
    return value


Duration = Annotated[str, AfterValidator(_duration)]
Data = Annotated[dict[str, str], AfterValidator(_data)]


class _Proto(BaseModel):
    """A proto3 JSON object as FCM parses it: known fields only, each under its proto name or its
    lowerCamelCase JSON name, of its exact JSON type; null leaves a field unset. A field typed
    ``dict[str, Any]`` is FCM's (so known) but not used by the pipeline: any JSON object passes."""

    model_config = ConfigDict(
        extra="forbid", strict=True, alias_generator=to_camel, validate_by_name=True, loc_by_alias=False
    )


class _Notification(_Proto):
    title: str | None = None
    body: str | None = None
    image: str | None = None


class _AndroidConfig(_Proto):
    collapse_key: str | None = None
    priority: Literal["NORMAL", "HIGH"] | None = None
    ttl: Duration | None = None
    restricted_package_name: str | None = None
    data: Data | None = None
    notification: dict[str, Any] | None = None
    fcm_options: dict[str, Any] | None = None
    direct_boot_ok: bool | None = None
    bandwidth_constrained_ok: bool | None = None
    restricted_satellite_ok: bool | None = None


class _Message(_Proto):
    name: str | None = None
    data: Data | None = None
    notification: _Notification | None = None
    android: _AndroidConfig | None = None
    webpush: dict[str, Any] | None = None
    apns: dict[str, Any] | None = None
    fcm_options: dict[str, Any] | None = None
    token: str | None = None
    topic: str | None = None
    condition: str | None = None

    @model_validator(mode="after")
    def _one_target(self) -> Self:
        """The oneof ``target``: one of token, topic and condition; this mock sends to tokens only."""
        targets = [name for name in ("token", "topic", "condition") if getattr(self, name)]
        if len(targets) > 1:
            raise ValueError(f"oneof field 'target' is already set. Cannot set '{targets[1]}'")
        if not targets:
            raise ValueError("Recipient of the message is not set.")
        if targets != ["token"]:
            raise ValueError(f"This mock sends to registration tokens only; message.{targets[0]} is not supported")
        return self


class _SendMessageRequest(_Proto):
    message: _Message
    validate_only: bool | None = None


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    result: dict[str, Any] = {}
    for key, value in pairs:
        if key in result:
            raise _Invalid(f'Invalid JSON payload received. Duplicate name "{key}".')
        result[key] = value
    return result


def _parse_send_body(content_type: str, body: bytes) -> tuple[str, bool]:
    """``(token, validate_only)`` of a valid send body; raises ``_Invalid`` as FCM would refuse it."""
    if content_type != "application/json":
        raise _Invalid(f"Invalid Content-Type {content_type or '(none)'!r}: the body must be application/json.")
    try:
        sent = json.loads(body.decode("utf-8"), object_pairs_hook=_no_duplicates)
    except ValueError as exc:  # UnicodeDecodeError too
        raise _Invalid(f"Invalid JSON payload received. {exc}") from None
    try:
        request = _SendMessageRequest.model_validate(sent)
    except ValidationError as exc:
        error = exc.errors()[0]
        where = ".".join(str(part) for part in error["loc"])
        raise _Invalid(f"Invalid value at '{where}': {error['msg']}", where or None) from None
    payload = {key: value for key, value in sent["message"].items() if key != "token"}
    size = len(json.dumps(payload, separators=(",", ":"), ensure_ascii=False).encode())
    if size > MAX_PAYLOAD_BYTES:
        raise _Invalid(
            f"Message is too big: {size} bytes of payload, the limit is {MAX_PAYLOAD_BYTES} bytes.", "message"
        )
    return request.message.token or "", bool(request.validate_only)


# -- the server ----------------------------------------------------------------------------------


class MockFcm(AsgiServer[RecordedSend]):
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

    # -- configuration ---------------------------------------------------------------------

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
            self._scripts.set(token, answer, times)

    def script_default(self, answer: Answer) -> None:
        """The answer for every token without a script of its own (``Answer()``, a 200, until set)."""
        with self._lock:
            self._scripts.default = answer

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

    def _reset_state(self) -> None:
        super()._reset_state()
        self._scripts = Scripts(Answer())
        self.tokens_issued = 0
        self.token_requests = 0  # every POST /token, refused ones included
        self._token_script = None

    # -- called from the server thread -----------------------------------------------------

    async def _respond(self, request: Request, protocol: str) -> Reply:
        body = await request.body()
        received_at = time.time()
        path = urllib.parse.unquote(request_target(request).split("?", 1)[0])
        if path == "/token":
            if request.method != "POST":
                return _OAuthError(405, "invalid_request", f"Method {request.method} is not allowed; use POST.").reply
            return self._token(request, body)
        match = SEND_PATH.match(path)
        if match is None or request.method != "POST":
            return _json_response(404, _google_error(404, "Method not found."))
        reply, error_code, validate_only = self._send(request, body, match["project"])
        sent = parsed_json(body)
        message = sent.get("message") if isinstance(sent, dict) else None
        token = message.get("token") if isinstance(message, dict) else None
        record = RecordedSend(
            token=token if isinstance(token, str) else "",
            status=reply.status,
            message=message if isinstance(message, dict) else None,
            access_token=_bearer(_header(request, "authorization")),
            at=received_at,
            project=match["project"],
            error_code=error_code,
            protocol=protocol,
            validate_only=validate_only,
        )
        self._record(record)
        return reply

    def _token(self, request: Request, body: bytes) -> Reply:
        with self._lock:
            self.token_requests += 1
            scripted = self._token_script
        if scripted is not None:
            status, delay = scripted
            error = "temporarily_unavailable" if status >= 500 else "invalid_grant"
            return _json_response(status, {"error": error, "error_description": f"scripted {status}"}, delay=delay)
        try:
            account = self._verify_grant(request, body)
        except _OAuthError as refused:
            return refused.reply
        access_token = "ya29.mock-" + secrets.token_urlsafe(32)
        with self._lock:
            lifetime = self.token_lifetime
            self._issued[access_token] = _Issued(account, time.time() + lifetime)
            self.tokens_issued += 1
        issued = {"access_token": access_token, "expires_in": lifetime, "token_type": "Bearer"}
        no_store = ("cache-control", "no-cache, no-store, max-age=0, must-revalidate")
        return _json_response(200, issued, no_store, ("pragma", "no-cache"))

    def _verify_grant(self, request: Request, body: bytes) -> ServiceAccount:
        """Google's checks of a JWT-bearer grant: the service account it is for, or ``_OAuthError``."""
        if _media_type(request) != "application/x-www-form-urlencoded":
            raise _OAuthError(400, "invalid_request", "Content-Type must be application/x-www-form-urlencoded.")
        try:
            pairs = urllib.parse.parse_qsl(body.decode("utf-8"), keep_blank_values=True, strict_parsing=True)
        except ValueError:  # UnicodeDecodeError too
            raise _OAuthError(400, "invalid_request", "Malformed form body.") from None
        form = dict(pairs)
        if len(form) != len(pairs):
            raise _OAuthError(400, "invalid_request", "A parameter is repeated.")
        if form.get("grant_type") != JWT_BEARER:
            raise _OAuthError(400, "unsupported_grant_type", f"Invalid grant_type: {form.get('grant_type', '')}")
        assertion = form.get("assertion")
        if not assertion:
            raise _OAuthError(400, "invalid_request", "Missing required parameter: assertion")
        try:
            header = jwt.get_unverified_header(assertion)
            issuer = jwt.decode(assertion, options={"verify_signature": False}).get("iss")
        except jwt.PyJWTError:
            raise _OAuthError(400, "invalid_grant", "Invalid JWT: malformed token.") from None
        if header.get("alg") != "RS256":
            raise _OAuthError(400, "invalid_grant", "Invalid JWT Signature.")
        with self._lock:
            accounts = [account for account in self._accounts.values() if account.client_email == issuer]
        if not accounts:
            raise _OAuthError(400, "invalid_grant", "Invalid grant: account not found")
        for account in accounts:
            if header.get("kid") not in (None, account.key_id):
                continue
            try:
                claims = jwt.decode(
                    assertion,
                    account.public_key,
                    algorithms=["RS256"],
                    audience=[self.token_uri, GOOGLE_TOKEN_URI],
                    issuer=account.client_email,
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
                expected = f"Invalid JWT: Failed audience check. The expected audience is {self.token_uri}."
                raise _OAuthError(400, "invalid_grant", expected) from None
            except jwt.PyJWTError as exc:
                raise _OAuthError(400, "invalid_grant", f"Invalid JWT: {exc}") from None
            break
        else:  # no key of the account's signed it
            raise _OAuthError(400, "invalid_grant", "Invalid JWT Signature.")
        iat, exp = claims["iat"], claims["exp"]
        now = time.time()
        if (
            not all(isinstance(value, int | float) and not isinstance(value, bool) for value in (iat, exp))
            or exp <= iat
            or exp - iat > ASSERTION_MAX_LIFETIME
            or iat > now + CLOCK_SKEW_SECONDS
            or exp < now - CLOCK_SKEW_SECONDS
        ):
            raise _OAuthError(400, "invalid_grant", JWT_TIMES_MESSAGE)
        if "sub" in claims and claims["sub"] != account.client_email:
            raise _OAuthError(
                401,
                "unauthorized_client",
                "Client is unauthorized to retrieve access tokens using this method, or client not authorized for any of the scopes requested.",
            )
        scopes = claims.get("scope")
        if not isinstance(scopes, str) or not {FCM_SCOPE, CLOUD_PLATFORM_SCOPE} & set(scopes.split()):
            raise _OAuthError(
                400, "invalid_scope", f"Invalid OAuth scope or ID token audience provided; FCM needs {FCM_SCOPE}."
            )
        return account

    def _send(self, request: Request, body: bytes, project: str) -> tuple[Reply, str | None, bool]:
        """FCM's answer to one send, the errorCode it carries, and whether the send was validate_only."""
        access_token = _bearer(_header(request, "authorization"))
        with self._lock:
            issued = self._issued.get(access_token) if access_token else None
        if issued is None or issued.expires_at <= time.time():
            challenge = ("www-authenticate", 'Bearer realm="https://accounts.google.com/", error="invalid_token"')
            return _json_response(401, _google_error(401, UNAUTHENTICATED_MESSAGE), challenge), None, False
        if issued.account.project_id != project:
            denied = (
                f"Permission 'cloudmessaging.messages.create' denied on resource "
                f"'//cloudresourcemanager.googleapis.com/projects/{project}' (or it may not exist)."
            )
            info = {
                "@type": "type.googleapis.com/google.rpc.ErrorInfo",
                "reason": "IAM_PERMISSION_DENIED",
                "domain": "cloudresourcemanager.googleapis.com",
            }
            return _json_response(403, _google_error(403, denied, [info])), None, False
        try:
            token, validate_only = _parse_send_body(_media_type(request), body)
        except _Invalid as problem:
            return _json_response(400, problem.body()), "INVALID_ARGUMENT", False
        with self._lock:
            answer = self._scripts.next(token)
        status = answer.http_status
        headers = (("retry-after", str(answer.retry_after)),) if answer.retry_after is not None else ()
        if status == 200:
            message_id = "fake_message_id" if validate_only else f"0:{int(time.time() * 1000)}%{secrets.token_hex(8)}"
            answered = {"name": f"projects/{project}/messages/{message_id}"}
        elif answer.error_code is None:
            answered = _google_error(status, "The service returned an error.")
        else:
            details = [{"@type": FCM_ERROR_TYPE, "errorCode": answer.error_code}]
            answered = _google_error(status, ERRORS[answer.error_code][1], details)
        return _json_response(status, answered, *headers, delay=answer.delay), answer.error_code, validate_only


def _header(request: Request, name: str) -> str:
    """A header's value; a repeated header's values joined by ", "."""
    return ", ".join(request.headers.getlist(name))


def _media_type(request: Request) -> str:
    return _header(request, "content-type").split(";")[0].strip().lower()


def _bearer(authorization: str) -> str | None:
    scheme, _, credentials = authorization.strip().partition(" ")
    if scheme.lower() != "bearer":
        return None
    return credentials.strip() or None
