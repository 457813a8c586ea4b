"""XIDs from the kernel log, the way node health checks see them.

NVML delivers XID events only to a process that registered for them before they happened, so a
fresh prolog or epilog never sees the XID that broke the previous job. The NVIDIA driver also
logs every XID to the kernel ring buffer (``NVRM: Xid (PCI:0000:3b:00): 79, pid=...``); we read
``/dev/kmsg`` records (``prio,seq,usec,flags;message``) without blocking and keep the sequence
number of the last record seen, so each check reports the XIDs since the previous one.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

_XID = re.compile(
    r"NVRM: Xid \(PCI:(?:([0-9A-Fa-f]{4,8}):)?([0-9A-Fa-f]{2}):([0-9A-Fa-f]{2})(?:\.\d)?\): (\d+)"
)
#: At most this many records per check: a flood of messages never holds the prolog up.
MAX_RECORDS = 100_000

PciKey = tuple[int, int, int]


@dataclass(frozen=True)
class KernelXid:
    """One XID the driver logged: kernel log sequence number, GPU's PCI address, XID code."""

    seq: int
    pci: PciKey
    xid: int


def pci_key(bus_id: str) -> PciKey | None:
    """``00000000:3B:00.0`` (NVML) or ``0000:3b:00`` (kernel) -> (domain, bus, device)."""
    parts = bus_id.strip().lower().split(":")
    try:
        if len(parts) == 3:
            return int(parts[0], 16), int(parts[1], 16), int(parts[2].split(".")[0], 16)
        if len(parts) == 2:
            return 0, int(parts[0], 16), int(parts[1].split(".")[0], 16)
    except ValueError:
        return None
    return None


def _split(record: str, position: int) -> tuple[int, str]:
    """(sequence number, message) of a ``prio,seq,usec,flags;message`` record; a record
    without that header (dmesg text) gets its position as sequence number."""
    header, sep, message = record.partition(";")
    fields = header.split(",")
    if sep and len(fields) >= 2 and fields[1].isdigit():
        return int(fields[1]), message
    return position, record


def parse_records(records: Iterable[str]) -> list[KernelXid]:
    """The XIDs in kernel log records."""
    found = []
    for position, record in enumerate(records):
        seq, message = _split(record, position)
        match = _XID.search(message)
        if match:
            domain, bus, device, code = match.groups()
            pci = (int(domain or "0", 16), int(bus, 16), int(device, 16))
            found.append(KernelXid(seq, pci, int(code)))
    return found


def read_records(path: Path) -> list[str]:
    """Every record ``path`` holds now: ``/dev/kmsg`` is read record by record without
    blocking (records overwritten while reading are skipped); a plain file line by line."""
    if not path.is_char_device():
        return path.read_text(errors="replace").splitlines()[-MAX_RECORDS:]
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    records: list[str] = []
    try:
        while len(records) < MAX_RECORDS:
            try:
                chunk = os.read(fd, 8192)
            except BlockingIOError:
                break  # no more records now
            except OSError as exc:
                if exc.errno == errno.EPIPE:  # we fell behind the ring buffer: go on
                    continue
                raise
            if not chunk:
                break
            records.append(chunk.decode(errors="replace").rstrip("\n"))
    finally:
        with contextlib.suppress(OSError):
            os.close(fd)
    return records


def new_xids(path: Path, after_seq: int) -> tuple[list[KernelXid], int]:
    """XIDs logged after record ``after_seq`` (-1: since boot) and the newest record's
    sequence number. A newest record below ``after_seq`` means the log restarted (a reboot):
    everything counts again."""
    records = read_records(path)
    newest = max((_split(r, i)[0] for i, r in enumerate(records)), default=after_seq)
    restarted = newest < after_seq
    fresh = [x for x in parse_records(records) if restarted or x.seq > after_seq]
    return fresh, newest
