"""`transfer.download_dir` on the real SeaweedFS server: parallel ranged GETs per file, files
fetched at once, each file hashed as it is written, and the old guarantees (a refused copy
leaves nothing, a missing object is one line, a store that goes away mid-file is waited
for). Which GETs went out is watched through botocore's own event hooks on the library's
client; nothing is mocked."""

from __future__ import annotations

import hashlib
import os
import threading
import time
from pathlib import Path

import pytest

from replayrl.errors import ReplayRLError
from replayrl.storage import objects, s3, transfer

pytestmark = pytest.mark.integration

PART = 1 << 20  # downloads accept any part size; uploads need 5 MiB (S3's smallest part)


def _digest(blob: bytes) -> objects.Digest:
    return objects.Digest(len(blob), hashlib.sha256(blob).hexdigest())


@pytest.fixture
def gets(s3_env):
    """Every GetObject's parameters sent by the library's client during the test."""
    client = s3.client(objects.s3_settings())
    seen: list[dict] = []

    def hook(params, **kwargs):
        seen.append(dict(params))

    client.meta.events.register("provide-client-params.s3.GetObject", hook)
    yield seen
    client.meta.events.unregister("provide-client-params.s3.GetObject", hook)


def _upload(tmp_path: Path, uri: str, blobs: dict[str, bytes]) -> dict[str, objects.Digest]:
    src = tmp_path / "src"
    src.mkdir()
    for name, blob in blobs.items():
        (src / name).write_bytes(blob)
    return transfer.upload_dir(src, uri)


def test_a_file_of_many_parts_comes_in_parallel_ranged_gets_byte_for_byte(
    s3_root, tmp_path, monkeypatch, gets
):
    monkeypatch.setattr(transfer, "DOWNLOAD_PART_BYTES", PART)
    blob = os.urandom(5 * PART + 7)  # 6 ranged GETs, the last one 7 bytes
    _upload(tmp_path, f"{s3_root}/w", {"model.safetensors": blob})
    seen: dict[str, objects.Digest] = {}
    local = transfer.download_dir(f"{s3_root}/w", tmp_path / "got", check=seen.update)
    assert (local / "model.safetensors").read_bytes() == blob
    assert seen == {"model.safetensors": _digest(blob)}
    ranges = sorted(g["Range"] for g in gets if g["Key"].endswith("/w/model.safetensors"))
    want = [f"bytes={i * PART}-{i * PART + PART - 1}" for i in range(5)] + [f"bytes={5 * PART}-"]
    assert ranges == sorted(want)
    assert all(g.get("IfMatch") for g in gets), "parts are pinned to one version of the object"


def test_a_folder_of_several_files_downloads_with_the_digests_of_its_upload(
    s3_root, tmp_path, monkeypatch, gets
):
    monkeypatch.setattr(transfer, "DOWNLOAD_PART_BYTES", PART)
    monkeypatch.setattr(transfer, "DOWNLOAD_FILES", 3)
    blobs = {
        "model-00001-of-00003.safetensors": os.urandom(3 * PART + 11),
        "model-00002-of-00003.safetensors": os.urandom(2 * PART),
        "model-00003-of-00003.safetensors": os.urandom(PART - 1),  # one plain GET
        "config.json": b'{"a": 1}',
        "empty.txt": b"",
        "optimizer.pt": os.urandom(PART // 2),
    }
    uploaded = _upload(tmp_path, f"{s3_root}/v1", blobs)
    seen: dict[str, objects.Digest] = {}
    local = transfer.download_dir(
        f"{s3_root}/v1",
        tmp_path / "cache" / "v1",
        skip=lambda name: name == "optimizer.pt",
        check=seen.update,
    )
    kept = {n: b for n, b in blobs.items() if n != "optimizer.pt"}
    assert seen == {n: uploaded[n] for n in kept} == {n: _digest(b) for n, b in kept.items()}
    assert sorted(p.name for p in local.iterdir()) == sorted(kept)
    for name, blob in kept.items():
        assert (local / name).read_bytes() == blob
    assert not any(g["Key"].endswith("optimizer.pt") for g in gets)
    assert sum("Range" in g for g in gets) == 4 + 2  # the two multipart shards' parts
    assert [p.name for p in (tmp_path / "cache").iterdir()] == ["v1"]  # no temp folder left

    # a check that refuses leaves neither the copy nor its temp folder
    def refuse(digests):
        raise ReplayRLError("no")

    with pytest.raises(ReplayRLError, match="no"):
        transfer.download_dir(f"{s3_root}/v1", tmp_path / "cache" / "v2", check=refuse)
    assert [p.name for p in (tmp_path / "cache").iterdir()] == ["v1"]


def test_an_object_deleted_after_the_listing_is_one_line_that_it_does_not_exist(
    s3_root, s3_env, tmp_path, monkeypatch
):
    monkeypatch.setattr(transfer, "DOWNLOAD_PART_BYTES", PART)
    _upload(tmp_path, f"{s3_root}/gone", {"a.bin": os.urandom(2 * PART), "b.json": b"{}"})
    bucket, key = s3.split(f"{s3_root}/gone/a.bin")
    client = s3.client(objects.s3_settings())

    def delete_first(params, **kwargs):  # the real object goes, between list and HEAD
        if params.get("Key") == key:
            s3_env.client().delete_object(Bucket=bucket, Key=key)

    client.meta.events.register("provide-client-params.s3.HeadObject", delete_first)
    try:
        with pytest.raises(ReplayRLError) as err:
            transfer.download_dir(f"{s3_root}/gone", tmp_path / "got")
    finally:
        client.meta.events.unregister("provide-client-params.s3.HeadObject", delete_first)
    message = str(err.value)
    assert "does not exist" in message and "\n" not in message
    assert s3_env.secret_key not in message
    assert not (tmp_path / "got").exists()
    assert [p.name for p in tmp_path.iterdir()] == ["src"]


@pytest.mark.slow
def test_a_part_get_that_finds_the_store_gone_is_retried_until_it_is_back(
    private_s3_server, tmp_path, monkeypatch
):
    """The third ranged GET stops the real server (restarted 2 s later) before it is sent:
    that GET, and the parts in flight, fail; the file is fetched again once the server is
    back, and its bytes and sha256 are whole."""
    monkeypatch.setattr(transfer, "DOWNLOAD_PART_BYTES", PART)
    monkeypatch.setattr(transfer, "DOWNLOAD_STREAMS", 2)
    uri = f"s3://{private_s3_server.bucket}/outage"
    blob = os.urandom(8 * PART + 3)
    _upload(tmp_path, uri, {"model.safetensors": blob, "config.json": b"{}"})
    client = s3.client(objects.s3_settings())
    calls = {"n": 0, "stopped_at": None}
    restarted = threading.Event()

    def stop_at_the_third(params, **kwargs):
        if "Range" not in params:
            return
        calls["n"] += 1
        if calls["n"] == 3:
            private_s3_server.stop()
            calls["stopped_at"] = time.monotonic()

            def restart():
                private_s3_server.start()
                restarted.set()

            threading.Timer(2.0, restart).start()

    client.meta.events.register("provide-client-params.s3.GetObject", stop_at_the_third)
    seen: dict[str, objects.Digest] = {}
    try:
        local = transfer.download_dir(uri, tmp_path / "got", check=seen.update)
    finally:
        client.meta.events.unregister("provide-client-params.s3.GetObject", stop_at_the_third)
    assert calls["stopped_at"] is not None, "no ranged GET went out"
    assert restarted.wait(60) and time.monotonic() - calls["stopped_at"] >= 2.0
    assert calls["n"] > 9, "the file was fetched again after the failed part"
    assert (local / "model.safetensors").read_bytes() == blob
    assert seen == {"model.safetensors": _digest(blob), "config.json": _digest(b"{}")}
