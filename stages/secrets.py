"""Keep credentials out of every record the project writes.

Settings travel into MLflow parameters, run records, dataset manifests and the
run folders' saved settings. :func:`mask_secrets` returns a copy of a settings
tree (dicts, lists, strings) in which credentials are replaced by ``***``:

* by value, wherever they sit in a string: the password of a URI
  (``http://user:***@host``, ``postgresql://u:***@h/db``), credential query
  parameters (``?token=***``, ``password=***``, ``X-Amz-Signature=***``),
  ``Authorization`` values (``Bearer ***``), and tokens whose format names them
  (AWS access key ids ``AKIA...``, Hugging Face ``hf_...``, GitHub ``ghp_...``,
  OpenAI-style ``sk-...``, Slack ``xox?-...``, JSON web tokens, PEM private keys);
* by key, when the key's own name says it holds a secret: a name made of whole
  words among ``password``, ``secret``, ``credential(s)``, ``api_key``,
  ``token``... (``db_password``, ``hf_token``, ``client_secret``), never a mere
  substring, so ``max_new_tokens``, ``tokenizer`` and ``pad_token_id`` stay visible.

Only strings change; numbers, booleans and ``None`` under ordinary keys pass
through, and the masked tree keeps its shape, so readers of a manifest's
``config`` find every field they use.

The patterns are specific formats rather than an entropy guess: a general
scanner (detect-secrets) flags hex digests and ordinary words as high-entropy
strings and knows neither URI query parameters nor Hugging Face tokens, while a
record full of false alarms would hide the settings a reader came for.
"""

from __future__ import annotations

import re
from typing import Any

MASK = "***"

# Words that make a key name secret on their own (compared with the name's words).
_SECRET_WORDS = frozenset({"password", "passwd", "passphrase", "secret", "secrets", "credential", "credentials",
                           "apikey", "authorization"})
# A final word "token"/"key" is secret after these words, or as the whole name.
_TOKEN_QUALIFIERS = frozenset({"auth", "access", "refresh", "api", "bearer", "session", "security", "id", "hf", "github",
                               "gh", "oauth", "private", "secret", "signing", "encryption", "client", "ray", "mlflow",
                               "prefect", "personal"})

# Query or form parameters that carry credentials: name=value up to the next separator.
_PARAM_NAMES = (r"password|passwd|pwd|pass|secret|client_secret|token|access_token|refresh_token|id_token|auth_token"
                r"|api_key|apikey|key|sig|signature|x-amz-signature|x-amz-credential|x-amz-security-token"
                r"|sas_token|auth|authorization")

_VALUE_PATTERNS: list[tuple[re.Pattern[str], str]] = [
    # PEM private keys, whole block.
    (re.compile(r"-----BEGIN [A-Z ]*PRIVATE KEY-----.*?-----END [A-Z ]*PRIVATE KEY-----", re.S), MASK),
    # scheme://user:password@host -> the password part; it may hold '@' but no '/'.
    (re.compile(r"([A-Za-z][A-Za-z0-9+.\-]*://[^\s:/?#@]*):([^\s/?#]*)@"), r"\1:" + MASK + "@"),
    # ?token=...&password=... and the same in form or header-like text.
    (re.compile(r"(?i)(^|[?&;,\s\"'])(" + _PARAM_NAMES + r")=([^&;#\s\"',]+)"), r"\1\2=" + MASK),
    # Authorization: <scheme> <credentials>, and a bearer token anywhere.
    (re.compile(r"(?i)(\bauthorization\s*[:=]\s*)(?:[A-Za-z]+\s+)?[^\s\"',;]+"), r"\1" + MASK),
    (re.compile(r"(?i)\b(bearer\s+)[A-Za-z0-9\-._~+/]{16,}=*"), r"\1" + MASK),
    # Token formats that name themselves.
    (re.compile(r"\b(?:AKIA|ASIA|ABIA|ACCA|AGPA|AIDA|AROA|ANPA|ANVA|AIPA)[0-9A-Z]{16}\b"), MASK),
    (re.compile(r"\bhf_[A-Za-z0-9]{30,}\b"), MASK),
    (re.compile(r"\b(?:gh[pousr]_[A-Za-z0-9]{30,}|github_pat_[A-Za-z0-9_]{30,})\b"), MASK),
    (re.compile(r"\bsk-(?:proj-|ant-)?[A-Za-z0-9_\-]{20,}"), MASK),
    (re.compile(r"\bxox[abposr]-[A-Za-z0-9\-]{10,}"), MASK),
    (re.compile(r"\beyJ[A-Za-z0-9_\-]{8,}\.eyJ[A-Za-z0-9_\-]{8,}\.[A-Za-z0-9_\-]{8,}"), MASK),
]


def _words(name: str) -> list[str]:
    name = re.sub(r"([a-z0-9])([A-Z])", r"\1_\2", name)  # camelCase -> camel_Case
    return [w for w in re.split(r"[^A-Za-z0-9]+", name.lower()) if w]


def is_secret_key(key: Any) -> bool:
    """Whether a setting's name says it holds a secret. For a dotted name
    (``tracking.db_password``) the last part decides."""
    words = _words(str(key).rsplit(".", 1)[-1])
    if not words:
        return False
    if any(w in _SECRET_WORDS for w in words):
        return True
    if words[-1] in ("token", "key"):
        return len(words) == 1 and words[0] == "token" or (len(words) > 1 and words[-2] in _TOKEN_QUALIFIERS)
    return False


def mask_text(text: str) -> str:
    """``text`` with every credential the value patterns recognise replaced by ``***``."""
    for pattern, replacement in _VALUE_PATTERNS:
        text = pattern.sub(replacement, text)
    return text


def mask_secrets(obj: Any) -> Any:
    """A copy of a settings tree (dicts, lists, tuples, strings, scalars) with secrets masked.

    Values under a secret key become ``***`` (``None`` and empty values stay as they
    are: there is nothing to hide); every other string is masked by value.
    """
    if isinstance(obj, dict):
        out = {}
        for k, v in obj.items():
            if is_secret_key(k) and v not in (None, "", [], {}):
                out[k] = MASK
            else:
                out[k] = mask_secrets(v)
        return out
    if isinstance(obj, (list, tuple)):
        return type(obj)(mask_secrets(v) for v in obj)
    if isinstance(obj, str):
        return mask_text(obj)
    return obj
