"""The disk tier under faults: every bad page is caught, counted and dropped, never returned."""

from __future__ import annotations

import errno
import hashlib
import logging
import os
import threading
from pathlib import Path

import pytest

from radixserve.cache.tiers.disk_format import HEADER, HEADER_V1, MAGIC_V1
from radixserve.cache.tiers.disk_store import DiskPageStore

FINGERPRINT = {"weights": "abc", "dtype": "float32", "page_tokens": 16}


def h(i: int) -> bytes:
    return hashlib.blake2b(str(i).encode(), digest_size=16).digest()


def payload(i: int) -> bytes:
    return bytes([i % 251]) * 1000 + i.to_bytes(4, "little")


def store_with(tmp_path: Path, pages: range, capacity: int = 1 << 30) -> DiskPageStore:
    store = DiskPageStore(tmp_path / "dir", capacity, FINGERPRINT)
    for i in pages:
        assert store.put(h(i), payload(i))
    assert store.flush(30)
    return store


def test_round_trip_and_warm_reopen(tmp_path: Path) -> None:
    store = store_with(tmp_path, range(5))
    assert [store.get(h(i)) for i in range(5)] == [payload(i) for i in range(5)]
    assert store.stats.pages_written == 5 and store.state(h(0)) == "on_disk"
    store.close()
    again = DiskPageStore(tmp_path / "dir", 1 << 30, FINGERPRINT)
    assert again.writable and len(again) == 5
    assert again.get(h(3)) == payload(3) and again.get(h(9)) is None
    again.close()


def test_labels_come_back_from_the_headers_alone(tmp_path: Path) -> None:
    store = DiskPageStore(tmp_path / "dir", 1 << 30, FINGERPRINT)
    for i in range(3):
        assert store.put(h(i), payload(i), label=b"label %d" % i)
    assert store.labels() == [(h(i), b"label %d" % i) for i in range(3)]  # queued: from memory
    store.close()
    again = DiskPageStore(tmp_path / "dir", 1 << 30, FINGERPRINT)
    path = again._path(h(1))
    path.write_bytes(path.read_bytes()[: HEADER.size + 6] + b"\0" * (len(payload(1)) + 1))  # label damaged, same size
    assert sorted(again.labels()) == sorted([(h(0), b"label 0"), (h(2), b"label 2")])
    assert again.stats.corrupt == 1 and again.state(h(1)) == "absent" and not path.exists()
    assert again.get(h(2)) == payload(2) and again.stats.bytes_read == len(payload(2))  # labels() read no K/V
    again.close()


def test_version_1_files_still_load_without_a_label(tmp_path: Path) -> None:
    store = store_with(tmp_path, range(1))
    checksum = hashlib.blake2b(payload(0), digest_size=16).digest()
    old = HEADER_V1.pack(MAGIC_V1, h(0), store.digest, checksum, len(payload(0))) + payload(0)
    store._path(h(0)).write_bytes(old)
    assert store.labels() == [(h(0), b"")] and store.get(h(0)) == payload(0)
    store._path(h(0)).write_bytes(old[:-1] + b"x")  # and are checked as before
    assert store.get(h(0)) is None and store.stats.corrupt == 1
    store.close()


def test_pages_are_readable_while_queued(tmp_path: Path) -> None:
    store = DiskPageStore(tmp_path / "dir", 1 << 30, FINGERPRINT)
    release = threading.Event()
    write = store._write_file
    store._write_file = lambda path, data: (release.wait(30), write(path, data))  # type: ignore[method-assign,func-returns-value]
    assert store.put(h(1), payload(1))
    assert store.state(h(1)) == "queued" and store.get(h(1)) == payload(1)
    release.set()
    assert store.flush(30) and store.state(h(1)) == "on_disk" and store.get(h(1)) == payload(1)
    store.close()


@pytest.mark.parametrize("fault", ["truncate", "flip_payload", "flip_header", "swap_files"])
def test_corrupt_page_is_dropped_and_counted(tmp_path: Path, fault: str) -> None:
    store = store_with(tmp_path, range(2))
    path, other = store._path(h(0)), store._path(h(1))
    data = bytearray(path.read_bytes())
    if fault == "truncate":
        data = data[: len(data) // 2]
    elif fault == "flip_payload":
        data[-7] ^= 0x40
    elif fault == "flip_header":
        data[HEADER.size - 3] ^= 1  # the label length
    else:  # a valid page, under the wrong name
        data = bytearray(other.read_bytes())
    path.write_bytes(bytes(data))
    assert store.get(h(0)) is None
    assert store.stats.corrupt == 1 and not path.exists() and store.state(h(0)) == "absent"
    assert store.get(h(1)) == payload(1)
    store.close()


def test_file_deleted_before_read(tmp_path: Path) -> None:
    store = store_with(tmp_path, range(2))
    store._path(h(0)).unlink()
    assert store.get(h(0)) is None and store.stats.missing == 1
    assert store.get(h(1)) == payload(1)
    store.close()


def test_disk_full_turns_writing_off(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    store = store_with(tmp_path, range(1))

    def full(path: Path, data: bytes) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    store._write_file = full  # type: ignore[method-assign]
    with caplog.at_level(logging.WARNING):
        assert store.put(h(1), payload(1))
        assert store.flush(30)
    assert store.stats.write_errors == 1 and not store.writable
    assert "disk full" in caplog.text
    assert not store.put(h(2), payload(2))  # off: nothing queued, nothing fails
    assert store.get(h(1)) is None and store.get(h(0)) == payload(0)  # what landed stays readable
    store.close()


def test_another_models_directory_is_not_used(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    store_with(tmp_path, range(3)).close()
    with caplog.at_level(logging.WARNING):
        other = DiskPageStore(tmp_path / "dir", 1 << 30, {**FINGERPRINT, "weights": "different"})
    assert not other.enabled and not other.writable and other.get(h(0)) is None
    assert "another model" in caplog.text and "weights" in caplog.text
    other.close()
    assert (tmp_path / "dir" / "fingerprint.json").read_text().count("abc") == 1  # left as it was


def test_pages_bind_to_the_fingerprint(tmp_path: Path) -> None:
    """A page copied in from another model's directory fails its header check."""
    store_with(tmp_path / "a", range(1)).close()
    theirs = DiskPageStore(tmp_path / "b" / "dir", 1 << 30, {**FINGERPRINT, "weights": "other"})
    assert theirs.put(h(0), payload(0)) and theirs.flush(30)
    ours = DiskPageStore(tmp_path / "a" / "dir", 1 << 30, FINGERPRINT)
    ours._path(h(0)).write_bytes(theirs._path(h(0)).read_bytes())
    assert ours.get(h(0)) is None and ours.stats.corrupt == 1
    ours.close()
    theirs.close()


def test_second_server_runs_read_only(tmp_path: Path) -> None:
    first = store_with(tmp_path, range(2))
    second = DiskPageStore(tmp_path / "dir", 1 << 30, FINGERPRINT)
    assert second.enabled and not second.writable
    assert not second.put(h(7), payload(7))
    assert second.get(h(1)) == payload(1)
    second.close()
    first.close()
    third = DiskPageStore(tmp_path / "dir", 1 << 30, FINGERPRINT)
    assert third.writable
    third.close()


def test_unusable_directory_degrades(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("not a directory")
    store = DiskPageStore(tmp_path / "file" / "dir", 1 << 30, FINGERPRINT)
    assert not store.enabled and not store.put(h(0), payload(0)) and store.get(h(0)) is None
    store.close()


def test_capacity_evicts_least_recent(tmp_path: Path) -> None:
    size = HEADER.size + len(payload(0))
    store = store_with(tmp_path, range(2), capacity=2 * size)
    assert store.get(h(0)) is not None  # 0 is now more recent than 1
    assert store.put(h(2), payload(2)) and store.flush(30)
    assert store.state(h(1)) == "absent" and store.get(h(0)) == payload(0) and store.get(h(2)) == payload(2)
    assert store.stats.evicted == 1 and store.used_bytes == 2 * size
    store.close()


def test_leftover_temp_files_are_removed(tmp_path: Path) -> None:
    store_with(tmp_path, range(1)).close()
    stray = tmp_path / "dir" / "pages" / "ab" / "ab.kv.123.tmp"
    stray.parent.mkdir(exist_ok=True)
    stray.write_bytes(b"torn")
    DiskPageStore(tmp_path / "dir", 1 << 30, FINGERPRINT).close()
    assert not stray.exists()


def test_clear_drops_every_page_and_its_file_behind_queued_writes(tmp_path: Path) -> None:
    """``clear`` (a flush) answers at once; the writer thread skips writes it dropped and deletes the files."""
    store = store_with(tmp_path, range(4))
    gate, dropped = threading.Event(), []
    store.on_drop = dropped.append
    real_write = store._write_file

    def slow_write(path: Path, data: bytes) -> None:
        gate.wait(30)
        real_write(path, data)

    store._write_file = slow_write  # type: ignore[method-assign]
    assert store.put(h(4), payload(4)) and store.put(h(5), payload(5))  # h(4) held at its write (or queued)
    assert store.clear() == 6 and len(store) == 0 and store.used_bytes == 0
    assert sorted(dropped) == sorted(h(i) for i in range(6))
    assert store.get(h(0)) is None and store.get(h(5)) is None and store.state(h(4)) == "absent"
    assert store.put(h(1), payload(1))  # stored again after the clear: kept
    gate.set()
    assert store.flush(30)
    files = sorted(p.name for p in (tmp_path / "dir" / "pages").rglob("*.kv"))
    assert len(files) == 1 and store.get(h(1)) == payload(1) and len(store) == 1
    assert store.stats.pages_written == 5  # the four before, h(1) again: h(4)'s write was dropped after it ran
    store.close()
    again = DiskPageStore(tmp_path / "dir", 1 << 30, FINGERPRINT)
    assert again.writable and len(again) == 1 and again.get(h(1)) == payload(1)
    again.close()


def test_clear_on_a_store_gone_read_only_still_deletes_and_another_servers_store_only_forgets(tmp_path: Path) -> None:
    owner = store_with(tmp_path, range(3))
    reader = DiskPageStore(tmp_path / "dir", 1 << 30, FINGERPRINT)  # the lock is taken: read-only
    assert not reader.writable and len(reader) == 3
    assert reader.clear() == 3 and len(reader) == 0 and reader.get(h(0)) is None
    assert reader.flush(30) and len(list((tmp_path / "dir" / "pages").rglob("*.kv"))) == 3  # not its files
    reader.close()
    owner.writable = False  # as after a failed write (disk full)
    assert owner.clear() == 3 and owner.flush(30)
    assert not list((tmp_path / "dir" / "pages").rglob("*.kv"))
    owner.close()


def test_a_directory_in_a_pages_place_is_dropped_and_counted_not_raised(tmp_path: Path) -> None:
    """Issue 37: a page file replaced by a directory raised IsADirectoryError out of get (500, then the scheduler
    stopped). Under a running server it is dropped and counted; at a start it is skipped (and removed, so the page
    can be written again)."""
    store = store_with(tmp_path, range(3))
    path = store._path(h(1))
    path.unlink()
    path.mkdir()
    assert store.get(h(1)) is None and store.stats.unreadable == 1 and store.state(h(1)) == "absent"
    assert sorted(store.labels()) == sorted((h(i), b"") for i in (0, 2))
    assert not path.exists() and store.put(h(1), payload(1)) and store.flush(30) and store.get(h(1)) == payload(1)
    assert store.writable  # the directory did not turn writing off
    path = store._path(h(2))
    store.close()
    path.unlink()
    path.mkdir()
    again = DiskPageStore(tmp_path / "dir", 1 << 30, FINGERPRINT)
    assert again.stats.unreadable == 1 and again.state(h(2)) == "absent" and not path.exists()
    assert again.labels() and again.get(h(0)) == payload(0)
    assert again.put(h(2), payload(2)) and again.flush(30) and again.get(h(2)) == payload(2)
    again.close()


def test_stray_names_in_the_pages_folder_are_skipped(tmp_path: Path) -> None:
    """Issue 37: a stray pages/zz/<non-hex name>.kv made the start fail (bytes.fromhex)."""
    store_with(tmp_path, range(2)).close()
    stray = tmp_path / "dir" / "pages" / "zz"
    stray.mkdir()
    (stray / ("z" * 32 + ".kv")).write_bytes(b"junk")
    (stray / "notes.txt").write_bytes(b"junk")
    again = DiskPageStore(tmp_path / "dir", 1 << 30, FINGERPRINT)
    assert again.enabled and again.writable and len(again) == 2 and again.stats.unreadable == 2
    assert again.get(h(1)) == payload(1)
    again.close()


def test_an_unreadable_page_is_dropped(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A page whose read fails with an I/O error (EIO, EACCES) is dropped and counted, and the others still serve."""
    store = store_with(tmp_path, range(2))
    bad = store._path(h(0))
    real = Path.read_bytes

    def read_bytes(self: Path) -> bytes:
        if self == bad:
            raise OSError(errno.EIO, "Input/output error")
        return real(self)

    monkeypatch.setattr(Path, "read_bytes", read_bytes)
    assert store.get(h(0)) is None and store.stats.unreadable == 1 and store.get(h(1)) == payload(1)
    store.close()


def test_a_read_only_directory_is_read_not_ignored(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 37: a cache directory that cannot be written (a read-only mount) was ignored entirely; the README
    says only writing is turned off. Simulated with EROFS on the lock file (root ignores permission bits)."""
    store_with(tmp_path, range(3)).close()
    real_open = os.open

    def read_only_open(path: str | os.PathLike[str], flags: int, *args: int) -> int:
        if flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT):
            raise OSError(errno.EROFS, "Read-only file system", str(path))
        return real_open(path, flags, *args)

    monkeypatch.setattr(os, "open", read_only_open)
    store = DiskPageStore(tmp_path / "dir", 1 << 30, FINGERPRINT)
    assert store.enabled and not store.writable and len(store) == 3
    assert [store.get(h(i)) for i in range(3)] == [payload(i) for i in range(3)]
    assert not store.put(h(7), payload(7))
    store.close()
