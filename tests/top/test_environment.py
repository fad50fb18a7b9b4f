"""fagen.environment.setting reads the environment as os.environ holds it, on every call."""

import os

from fagen.environment import setting


def test_a_setting_follows_os_environ(monkeypatch):
    monkeypatch.delenv("FAGEN_TEST_SETTING", raising=False)
    assert setting("FAGEN_TEST_SETTING") == ""
    monkeypatch.setenv("FAGEN_TEST_SETTING", "1")
    assert setting("FAGEN_TEST_SETTING") == "1"
    os.environ["FAGEN_TEST_SETTING"] = "caf\u00e9"
    assert setting("FAGEN_TEST_SETTING") == "caf\u00e9"
    monkeypatch.delenv("FAGEN_TEST_SETTING")
    assert setting("FAGEN_TEST_SETTING") == ""
