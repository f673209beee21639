"""Sealed reasoning is bound to the model and to the credential it was issued to."""

from __future__ import annotations

import string

import pytest
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from hypothesis import given, settings
from hypothesis import strategies as st

from lmspd.core.errors import ApiError
from lmspd.core.sealing import Sealer


def test_a_blob_opens_only_for_its_owner_and_gives_its_reasoning_only_to_its_model(tmp_path) -> None:
    sealer = Sealer.from_data_dir(tmp_path)
    blob = sealer.seal("m", "secret thoughts", owner="key_alice")
    assert sealer.open("m", blob, "input[0].encrypted_content", owner="key_alice") == "secret thoughts"
    for owner in ("key_bob", "local", "key_alic", "key_alicee"):
        with pytest.raises(ApiError) as info:
            sealer.open("m", blob, "input[0].encrypted_content", owner=owner)
        assert info.value.status == 400 and info.value.param == "input[0].encrypted_content"
        assert "secret" not in info.value.message
    # Its owner replaying it to another model (a client that switched
    # models): it opens, to nothing for that model.
    assert sealer.open("other", blob, "input[0].encrypted_content", owner="key_alice") is None
    assert sealer.open("m ", blob, "p", owner="key_alice") is None
    # Another key's blob for another model is still another key's.
    with pytest.raises(ApiError):
        sealer.open("other", blob, "p", owner="key_bob")
    # The same key file opens it after a restart.
    assert Sealer.from_data_dir(tmp_path).open("m", blob, "p", owner="key_alice") == "secret thoughts"


def _l2_blob(sealer: Sealer, model: str, hidden: str, owner: str) -> str:
    """A reasoning blob as lmspd sealed them before l3 (bound to model and owner)."""
    import base64
    import json
    import os

    from lmspd.core import sealing

    nonce = os.urandom(12)
    plain = json.dumps({"hidden": hidden}).encode()
    sealed = sealer._aead.encrypt(nonce, plain, sealing._bound_to(model, owner))
    return base64.urlsafe_b64encode(b"l2" + nonce + sealed).decode()


def test_a_blob_sealed_before_l3_still_opens_for_its_model_and_owner(tmp_path) -> None:
    """A conversation carried across the upgrade: its earlier turns' blobs
    (l2) name their model only in the associated data, so another model's
    is refused like another key's, as it was."""
    sealer = Sealer.from_data_dir(tmp_path)
    blob = _l2_blob(sealer, "m", "old thoughts", "key_alice")
    assert Sealer.sealed_by_lmspd(blob)
    assert sealer.open("m", blob, "p", owner="key_alice") == "old thoughts"
    for model, owner in (("m", "key_bob"), ("other", "key_alice")):
        with pytest.raises(ApiError):
            sealer.open(model, blob, "p", owner=owner)
    # The (model, owner) binding cannot be shifted between its two parts.
    shifted = _l2_blob(sealer, "ab", "x", "c")
    with pytest.raises(ApiError):
        sealer.open("a", shifted, "p", owner="bc")


def test_no_other_blob_of_this_key_opens_as_reasoning(tmp_path) -> None:
    """A compaction item's blob (``seal_value``), replayed as reasoning, is
    refused: the two are sealed under different associated data."""
    sealer = Sealer.from_data_dir(tmp_path)
    value = sealer.seal_value("compaction", {"hidden": "h", "model": "m"}, owner="o")
    with pytest.raises(ApiError):
        sealer.open("m", value, "p", owner="o")
    with pytest.raises(ApiError):
        sealer.open_value("compaction", sealer.seal("m", "h", owner="o"), "p", owner="o")


def test_a_server_that_makes_the_key_while_another_does_both_end_with_the_first_key(tmp_path, monkeypatch) -> None:
    """Two servers started at once on a new data dir (two instances, two
    test workers): the second finds no key, and the first writes its own
    before the second writes. The second must take the key that got there
    first, not fail and not overwrite it."""
    real = AESGCM.generate_key
    other: list[Sealer] = []
    calls = []

    def another_server_first(bit_length: int) -> bytes:
        calls.append(bit_length)
        if len(calls) == 1:
            other.append(Sealer.from_data_dir(tmp_path))  # arrives in between and makes its key
        return real(bit_length)

    monkeypatch.setattr(AESGCM, "generate_key", staticmethod(another_server_first))
    sealer = Sealer.from_data_dir(tmp_path)
    blob = other[0].seal("m", "made by the first")
    assert sealer.open("m", blob, "p") == "made by the first"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["reasoning.key"], "no temporary file is left"


@pytest.fixture(scope="module")
def sealer(tmp_path_factory) -> Sealer:
    return Sealer.from_data_dir(tmp_path_factory.mktemp("seal"))


@given(cut=st.integers(min_value=0), text=st.text(max_size=4))
@settings(max_examples=300, deadline=None)
def test_only_the_exact_blob_opens(sealer: Sealer, cut: int, text: str) -> None:
    """Base64 decoders skip characters outside the alphabet and bits past the
    last byte, so a string inserted anywhere (a stray '.', '==' after the
    padding, '+' for '-') used to open as the original: "authenticated"
    means the exact string the server issued, nothing else."""
    blob = sealer.seal("m", "thoughts")
    value = sealer.seal_value("compaction", {"summary": "s"})
    for original, opener in ((blob, lambda b: sealer.open("m", b, "p")),
                             (value, lambda b: sealer.open_value("compaction", b, "p"))):
        at = cut % (len(original) + 1)
        edited = original[:at] + text + original[at:]
        if edited == original:
            continue
        with pytest.raises(ApiError) as info:
            opener(edited)
        assert info.value.status == 400 and info.value.param == "p"


_ALPHABET = string.ascii_uppercase + string.ascii_lowercase + string.digits + "-_"


def _flip_a_bit_past_the_data(blob: str) -> str:
    # In a padded blob the last character's lowest bit carries no data.
    body = blob.rstrip("=")
    return body[:-1] + _ALPHABET[_ALPHABET.index(body[-1]) ^ 1] + "=" * (len(blob) - len(body))


@pytest.mark.parametrize("edit", [lambda b: b + "==", lambda b: b[:5] + "." + b[5:], lambda b: " " + b,
                                  lambda b: b.replace("-", "+").replace("_", "/"), _flip_a_bit_past_the_data])
def test_a_blob_edited_where_base64_is_lenient_is_refused(tmp_path, edit) -> None:
    sealer = Sealer.from_data_dir(tmp_path)
    # Summaries of every length mod 3, so that some blob has padding and
    # some has '-' or '_' in it.
    edits = 0
    for summary in ("s", "ss", "sss") * 8:
        blob = sealer.seal_value("compaction", {"summary": summary})
        edited = edit(blob)
        if edited == blob:
            continue
        edits += 1
        with pytest.raises(ApiError):
            sealer.open_value("compaction", edited, "p")
    assert edits


def test_only_a_blob_in_lmspd_form_counts_as_sealed_here(tmp_path, sealer: Sealer) -> None:
    """Another provider's blob is passed over unopened; one of ours (under any
    key, edited or not) is ours to open or refuse."""
    other_key = Sealer.from_data_dir(tmp_path)
    ours = [sealer.seal("m", "thoughts"), other_key.seal("m", "thoughts"), sealer.seal_value("compaction", {})]
    for blob in ours:
        assert Sealer.sealed_by_lmspd(blob)
        # Tampered, cut short, a character dropped: still ours, so refused, not passed over.
        for edited in (blob[:-6] + "AAAAAA", blob[:-5], blob[:20] + blob[21:]):
            assert Sealer.sealed_by_lmspd(edited), edited
    # OpenAI's encrypted_content (a Fernet token), text that is not base64, nothing.
    for foreign in ("gAAAAABo" + "x1Y2_-Zq" * 40, "not base64!", "", "bDI"):
        assert not Sealer.sealed_by_lmspd(foreign), foreign


def test_a_key_left_readable_by_others_is_closed_when_read(tmp_path) -> None:
    """Whoever reads the key can forge and open every owner's sealed
    reasoning: a key copied in (or left by an older version) with 0644 was
    used as it was."""
    import os
    import stat

    key = tmp_path / "reasoning.key"
    key.write_bytes(os.urandom(32))
    key.chmod(0o644)
    Sealer.from_data_dir(tmp_path)
    assert stat.S_IMODE(key.stat().st_mode) == 0o600
