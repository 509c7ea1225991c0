"""Read what is intact in a damaged bag: a recorder killed mid-write leaves an mcap without its summary and
footer, or a sqlite3 file shorter than its header says. rosbags refuses to open both; these readers walk the
storage from the front and stop at the damage, so replay can still report on what came before it.

mcap records (little endian): opcode u8, length u64, body. Schema 0x03 (id u16, name, encoding, data),
Channel 0x04 (id u16, schema u16, topic, encoding, metadata), Message 0x05 (channel u16, sequence u32,
log time u64, publish time u64, data), Chunk 0x06 (start u64, end u64, size u64, crc u32, compression,
records with a u64 length). Strings carry a u32 length. An uncompressed chunk cut short still yields the
whole records before the cut.
"""
from __future__ import annotations

import shutil
import sqlite3
import struct
import tempfile
from dataclasses import dataclass
from pathlib import Path

MCAP_MAGIC = b"\x89MCAP0\r\n"
_DATA_END, _FOOTER = 0x0F, 0x02


class Damage(Exception):
    """Where the readable part of a storage file ends."""


@dataclass(frozen=True)
class SalvagedConnection:
    id: int
    topic: str
    msgtype: str


def _string(buf: bytes, pos: int) -> tuple[str, int]:
    (n,) = struct.unpack_from("<I", buf, pos)
    return buf[pos + 4:pos + 4 + n].decode(), pos + 4 + n


def _records(buf: bytes, where: str):
    pos = 0
    while pos < len(buf):
        if pos + 9 > len(buf):
            raise Damage(f"{where}: record header cut at byte {pos}")
        op, length = buf[pos], struct.unpack_from("<Q", buf, pos + 1)[0]
        if pos + 9 + length > len(buf):
            raise Damage(f"{where}: record 0x{op:02x} at byte {pos} cut ({len(buf) - pos - 9} of {length} bytes)")
        yield op, buf[pos + 9:pos + 9 + length]
        pos += 9 + length


def _chunk_records(body: bytes, length: int, offset: int):
    """Records inside one chunk record `body` (which may be shorter than its declared `length`)."""
    if len(body) < 28 + 4:
        raise Damage(f"chunk at byte {offset}: header cut")
    usize, crc = struct.unpack_from("<QI", body, 16)
    compression, pos = _string(body, 28)
    (rlen,) = struct.unpack_from("<Q", body, pos)
    data = body[pos + 8:pos + 8 + rlen]
    if compression:
        if len(data) < rlen:
            raise Damage(f"{compression} chunk at byte {offset} cut")
        from rosbags.rosbag2.storage_mcap import decompress

        data = decompress(data, compression, usize, crc)
    yield from _records(data, f"chunk at byte {offset}")
    if len(body) < length:
        raise Damage(f"chunk at byte {offset} cut ({len(body)} of {length} bytes)")


def mcap_records(path: Path):
    """Every record of the data section, chunks unpacked, in file order; raises Damage at the first cut."""
    with path.open("rb") as f:
        if f.read(8) != MCAP_MAGIC:
            raise Damage(f"{path}: not an mcap file (bad magic)")
        while True:
            offset = f.tell()
            head = f.read(9)
            if not head:
                return
            if len(head) < 9:
                raise Damage(f"record header cut at byte {offset}")
            op, length = head[0], struct.unpack_from("<Q", head, 1)[0]
            if op in (_DATA_END, _FOOTER):
                return
            body = f.read(length)
            if op == 0x06:
                yield from _chunk_records(body, length, offset)
            elif len(body) < length:
                raise Damage(f"record 0x{op:02x} at byte {offset} cut ({len(body)} of {length} bytes)")
            else:
                yield op, body


class SalvageReader:
    """Connections and a message generator (raising Damage where the file ends) over one storage file."""

    def __init__(self, path: Path):
        self.path = path
        self.connections: list[SalvagedConnection] = []
        self._tmp = None
        if path.suffix == ".mcap":
            self._open_mcap()
        elif path.suffix == ".db3":
            self._open_sqlite()
        else:
            raise ValueError(f"{path}: no salvage reader for {path.suffix!r} files")

    # ---- mcap --------------------------------------------------------------------------------------------
    def _open_mcap(self) -> None:
        schemas, channels = {}, {}
        try:
            for op, body in mcap_records(self.path):
                if op == 0x03:
                    (sid,) = struct.unpack_from("<H", body, 0)
                    schemas[sid], _ = _string(body, 2)
                elif op == 0x04:
                    cid, sid = struct.unpack_from("<HH", body, 0)
                    topic, _ = _string(body, 4)
                    channels[cid] = SalvagedConnection(cid, topic, schemas.get(sid, "?"))
        except Damage:
            pass
        self.connections = list(channels.values())
        self.messages = self._mcap_messages

    def _mcap_messages(self, connections):
        wanted = {c.id: c for c in connections}
        for op, body in mcap_records(self.path):
            if op == 0x05:
                cid, _, log_ns = struct.unpack_from("<HIQ", body, 0)
                if cid in wanted:
                    yield wanted[cid], log_ns, body[22:]

    # ---- sqlite3 -----------------------------------------------------------------------------------------
    def _open_sqlite(self) -> None:
        # SQLite refuses a file shorter than its header's page count; a zero-padded copy reads up to the
        # first missing page. Messages go in rowid (insertion) order: the timestamp index may be cut too.
        head = self.path.read_bytes()[:100]
        page = struct.unpack_from(">H", head, 16)[0] if len(head) == 100 else 0
        pages = struct.unpack_from(">I", head, 28)[0] if len(head) == 100 else 0
        self._tmp = tempfile.TemporaryDirectory(prefix="flashrt_salvage_")
        copy = Path(self._tmp.name) / self.path.name
        shutil.copyfile(self.path, copy)
        size = (65536 if page == 1 else page) * pages
        if size > copy.stat().st_size:
            with copy.open("r+b") as f:
                f.truncate(size)
        self._con = sqlite3.connect(f"file:{copy}?mode=ro", uri=True)
        rows = self._con.execute("SELECT id, name, type FROM topics ORDER BY id").fetchall()
        self.connections = [SalvagedConnection(int(i), name, msgtype) for i, name, msgtype in rows]
        self.messages = self._sqlite_messages

    def _sqlite_messages(self, connections):
        wanted = {c.id: c for c in connections}
        try:
            for topic_id, stamp, data in self._con.execute("SELECT topic_id, timestamp, data FROM messages "
                                                           "ORDER BY id"):
                if topic_id in wanted:
                    yield wanted[topic_id], int(stamp), bytes(data)
        except sqlite3.DatabaseError as e:
            raise Damage(f"sqlite3: {e}") from None

    def close(self) -> None:
        if getattr(self, "_con", None) is not None:
            self._con.close()
            self._con = None
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None


def storage_file(path: Path) -> Path | None:
    """The storage file of a bag path (a folder's first .mcap/.db3, or the file itself)."""
    if path.is_file():
        return path
    files = sorted(p for p in path.iterdir() if p.suffix in (".mcap", ".db3")) if path.is_dir() else []
    return files[0] if files else None
