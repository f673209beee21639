"""Sealed reasoning is bound to the model and to the credential it was issued to."""

from __future__ import annotations

import pytest
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from lmspd.core.errors import ApiError
from lmspd.core.sealing import Sealer


def test_a_blob_opens_only_for_its_model_and_owner(tmp_path) -> None:
    sealer = Sealer.from_data_dir(tmp_path)
    blob = sealer.seal("m", "secret thoughts", owner="key_alice")
    assert sealer.open("m", blob, "input[0].encrypted_content", owner="key_alice") == "secret thoughts"
    for model, owner in (("m", "key_bob"), ("m", "local"), ("other", "key_alice")):
        with pytest.raises(ApiError) as info:
            sealer.open(model, blob, "input[0].encrypted_content", owner=owner)
        assert info.value.status == 400 and info.value.param == "input[0].encrypted_content"
        assert "secret" not in info.value.message
    # The (model, owner) binding cannot be shifted between its two parts.
    blob = sealer.seal("ab", "x", owner="c")
    with pytest.raises(ApiError):
        sealer.open("a", blob, "p", owner="bc")
    # The same key file opens it after a restart.
    assert Sealer.from_data_dir(tmp_path).open("ab", blob, "p", owner="c") == "x"



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
