"""scripts.data.tcia.client: where the API is, and what happens when it cannot be reached."""

from __future__ import annotations

import socket

import pytest
from fake_nbia import COLLECTION, FAST
from scripts.data.tcia import TciaError, download, resolve_base_url


def test_unreachable_server_fails_the_listing_after_retries(tmp_path):
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(TciaError, match="gave up after 2 attempt"):
        download(tmp_path, base_url=f"http://127.0.0.1:{port}/", retries=1, **FAST)
    assert not (tmp_path / COLLECTION).exists()


def test_base_url_comes_from_argument_then_environment(monkeypatch):
    monkeypatch.setenv("TCIA_BASE_URL", "https://example.org/nbia-api/services/v4")
    assert resolve_base_url() == "https://example.org/nbia-api/services/v4/"
    assert resolve_base_url("http://127.0.0.1:9/") == "http://127.0.0.1:9/"
    monkeypatch.delenv("TCIA_BASE_URL")
    assert resolve_base_url().startswith("https://services.cancerimagingarchive.net/nbia-api/services/")
