"""Sealed reasoning is bound to the model and to the credential it was issued to."""

from __future__ import annotations

import pytest

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
