"""Whether a blob lmspd sealed (``lmspd.core.sealing``) shows its plaintext.

Looking for a word of the plaintext in the base64 text is a test that fails
by chance (random base64 spells any three letters about once per 260,000
positions). Decoded, a sealed blob is a version, a nonce and AES-GCM
ciphertext: random bytes, in which a run of printable ASCII as long as
``RUN`` is as good as impossible by chance (0.37^24 per position), while any
JSON plaintext (``{"summary": "..."}``) would be one such run from end to end.
"""

from __future__ import annotations

import base64
import re

RUN = 24
_PRINTABLE_RUN = re.compile(rb"[\x20-\x7e]{%d,}" % RUN)


def assert_unreadable(blob: str, *plain: str) -> None:
    raw = base64.urlsafe_b64decode(blob.encode())
    body = raw[14:]  # after the version (2 bytes) and the nonce (12)
    assert len(body) > 16, "no ciphertext beside the tag"
    run = _PRINTABLE_RUN.search(body)
    assert run is None, f"the sealed blob holds readable text: {run.group()[:80]!r}"
    for text in plain:
        if len(text.encode()) >= 8:  # shorter words occur in random bytes by chance
            assert text.encode() not in raw, f"the sealed blob holds {text!r}"
