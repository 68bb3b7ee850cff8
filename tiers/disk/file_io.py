"""Reading and writing an object file's bytes with as few system calls as the
kernel allows."""

from __future__ import annotations

import errno
import mmap
import os

from tiercache.tiers.format import DATA_ALIGN, CorruptObject, ObjectHeader


class DiskPages:
    """One object open for reading, its header checked: the pages are read piece by
    piece at offsets into them. The file stays readable while open, even if the tier
    evicts it meanwhile (the unlink frees it at the close)."""

    def __init__(self, key: str, fd: int, header: ObjectHeader, offset: int):
        self.key = key
        self.header = header
        self._fd = fd
        self._offset = offset  # of the pages in the file

    def read(self, at: int, views: list[memoryview]) -> None:
        """Fill `views`, in order, from the pages' byte `at` on; CorruptObject where
        the file ends first."""
        views = [view for view in views if len(view)]
        while views:
            got = os.preadv(self._fd, views, self._offset + at)
            if got == 0:
                raise CorruptObject(f"object {self.key} truncated before byte {at} of its pages")
            at += got
            while views and got >= len(views[0]):
                got -= len(views[0])
                views.pop(0)
            if got:
                views[0] = views[0][got:]

    def close(self) -> None:
        os.close(self._fd)


def is_aligned(data: memoryview) -> bool:
    if len(data) % DATA_ALIGN:
        return False
    import ctypes

    address = ctypes.addressof(ctypes.c_char.from_buffer(data)) if not data.readonly else 1
    return address % DATA_ALIGN == 0


def write_all(fd: int, *parts: bytes | memoryview | mmap.mmap) -> None:
    """Write `parts` in order with as few system calls as the kernel allows."""
    views = [memoryview(part).cast("B") for part in parts if len(part)]
    while views:
        written = os.writev(fd, views)
        if written <= 0:
            raise OSError(errno.EIO, "write made no progress")
        while views and written >= len(views[0]):
            written -= len(views[0])
            views.pop(0)
        if written:
            views[0] = views[0][written:]
