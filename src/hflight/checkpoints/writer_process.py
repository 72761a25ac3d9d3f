"""``save_async``'s large files written by a process of their own: their serialization, hashing and writing off the
training process's interpreter lock.

The background writer thread lets go of the interpreter lock for every large copy, CRC, hash and write, but the
Python between them (torch's pickler over every tensor of the optimizer's state, the per-record and per-tensor calls)
still takes the lock from the training thread, whose speed on a GPU is its Python launching kernels
(``benchmarks/checkpoint_gil.py`` measures it). With a :class:`WriterProcess`, the staging area the snapshot is
copied into is shared memory (``memfd_create``; pinned with ``cudaHostRegister`` for copies from a GPU), and the
files that hold most of the bytes, ``torch.save``'s (``optimizer.pt``) and the model's safetensors files, are
written by a child process from that memory: the writer thread sends it the state's structure, each tensor as its
place in the shared memory (a few kilobytes, pickled), and waits, its lock released, for the checksum of the file
the child wrote (``hflight.checkpoints.torch_file`` and ``hflight.checkpoints.safetensors_file``, the same files,
past the page cache, hashed as written). The rest of the job (small files, ``save_pretrained``'s own files, the
manifest, the fsyncs, the publication) stays on the writer thread.

The child is ``python -m hflight.checkpoints.writer_child`` (no ``multiprocessing``: a user's script is never
imported again in it), started with the first shared memory, talking over a Unix socket pair (length-prefixed
pickles; each shared memory's descriptor passed once with ``SCM_RIGHTS``); it imports torch, not hflight's trainer.
A file the child cannot take (a tensor outside the shared memory, a structure it cannot unpickle) is written by the
thread as before; an error writing it (a full disk, an I/O error) comes back as the exception, with its ``errno`` and
file name, and fails the checkpoint as any write error does; a child that dies fails the write in progress with an
error saying so, and the next file is written by a new child. Linux only (``memfd_create``); elsewhere the thread
writes everything.

May import: ``hflight.checkpoints.torch_file``, ``hflight.checkpoints.safetensors_file`` (the child's imports: torch,
not transformers), nothing else of hflight.
"""

from __future__ import annotations

import dataclasses
import io
import logging
import mmap
import os
import pickle
import socket
import struct
import subprocess
import sys
import threading
from typing import Any

import numpy as np
import torch

logger = logging.getLogger(__name__)

_LENGTH = struct.Struct("<Q")
#: the child's entry
_CHILD = "hflight.checkpoints.writer_child"
#: the area of an empty storage (made anew in the child)
_EMPTY = -1
#: how long the writer thread waits for the child to start and answer its first message, seconds
START_TIMEOUT_S = 120.0


def available() -> bool:
    """Whether a writer process can run here (shared memory by descriptor: Linux's ``memfd_create``)."""
    return hasattr(os, "memfd_create") and hasattr(socket, "send_fds")


class WriterProcessDied(RuntimeError):
    """The checkpoint writer process ended while it wrote a file."""


# ---- framing (both sides) --------------------------------------------------------------------------------------------
def _send(sock: socket.socket, message: Any, fds: list[int] | None = None) -> None:
    data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    frame = _LENGTH.pack(len(data)) + data
    if fds:
        sent = socket.send_fds(sock, [frame[:1]], fds)
        frame = frame[sent:]
    sock.sendall(frame)


def _receive(sock: socket.socket) -> tuple[Any, list[int]]:
    """One message and the descriptors that came with it; raises EOFError when the other side is gone."""
    fds: list[int] = []
    head = b""
    while len(head) < _LENGTH.size:
        data, received, _, _ = socket.recv_fds(sock, _LENGTH.size - len(head), 4)
        if not data:
            raise EOFError("the other side closed the connection")
        head += data
        fds += received
    (length,) = _LENGTH.unpack(head)
    body = bytearray()
    while len(body) < length:
        chunk = sock.recv(min(length - len(body), 1 << 20))
        if not chunk:
            raise EOFError("the other side closed the connection")
        body += chunk
    return pickle.loads(bytes(body)), fds


# ---- the training process's side -------------------------------------------------------------------------------------
@dataclasses.dataclass
class _Area:
    """One block of shared memory: its base address and size in this process, its descriptor (kept: a new child maps
    it again), whether the child has mapped it, whether it was pinned."""

    key: int
    base: int
    nbytes: int
    fd: int
    array: Any
    sent: bool = False
    pinned: bool = False


class _Pickler(pickle.Pickler):
    """Pickles a state with each tensor in shared memory as its place there (area, offset, bytes, and its view);
    raises :class:`_Outside` for a tensor that is not."""

    def __init__(self, file: Any, owner: WriterProcess) -> None:
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self.owner, self.used = owner, set()

    def persistent_id(self, obj: Any) -> Any:
        if not isinstance(obj, torch.Tensor):
            return None
        place = self.owner.place(obj)
        if place is None:
            raise _Outside
        self.used.add(place[0])
        return ("tensor", *place, str(obj.dtype).removeprefix("torch."), tuple(obj.shape), tuple(obj.stride()),
                obj.storage_offset())  # fmt: skip


class _Outside(Exception):
    """A tensor of the state is not in shared memory: the file is written by the thread."""


class WriterProcess:
    """The child that writes the large files of ``save_async``'s checkpoints, and the shared memory it reads them
    from. Its methods are called by one thread at a time (the writer thread; :meth:`allocate` by the loop's thread
    while no write is in flight)."""

    def __init__(self) -> None:
        self._areas: dict[int, _Area] = {}
        self._next_key = 0
        self._released: list[int] = []  # areas the child may unmap, told with the next message
        self._process: subprocess.Popen | None = None
        self._sock: socket.socket | None = None
        self._answered = False  # the child answered its first message
        self._said_unavailable = False
        self._lock = threading.Lock()

    # ---- shared memory ---------------------------------------------------------------------------------------------
    @property
    def allocated(self) -> bool:
        """Whether shared memory was allocated (and the child started) for this writer."""
        return self._next_key > 0

    def allocate(self, nbytes: int, pinned: bool) -> np.ndarray:
        """``nbytes`` of shared memory as a numpy array of bytes (pinned for copies from a GPU where pinning
        succeeds); the writer's staging area or overflow buffer. The first call (on the training loop's thread, at
        the first snapshot) starts the child, which is ready by the time the first write needs it."""
        with self._lock:
            self._spawn()
        fd = os.memfd_create(f"hflight-checkpoint-{self._next_key}", getattr(os, "MFD_CLOEXEC", 0))
        try:
            os.ftruncate(fd, max(nbytes, 1))
            mapped = mmap.mmap(fd, max(nbytes, 1))
        except BaseException:
            os.close(fd)
            raise
        array = np.frombuffer(mapped, dtype=np.uint8, count=nbytes)
        area = _Area(self._next_key, array.ctypes.data, nbytes, fd, array)
        if pinned and nbytes:
            area.pinned = _pin(area.base, nbytes)
        self._areas[area.key] = area
        self._next_key += 1
        return array

    def release(self, array: np.ndarray) -> None:
        """The area of ``array`` is no longer used (no write reads it): unpinned, its descriptor closed, the child
        told to unmap it with the next message."""
        area = next((a for a in self._areas.values() if a.array is array), None)
        if area is None:
            return
        del self._areas[area.key]
        if area.pinned:
            _unpin(area.base)
        os.close(area.fd)
        if area.sent:
            self._released.append(area.key)

    def place(self, tensor: torch.Tensor) -> tuple[int, int, int] | None:
        """Where ``tensor``'s storage lies in the shared memory: (area, offset, bytes); an empty storage is
        (:data:`_EMPTY`, 0, 0); None: elsewhere."""
        if type(tensor) is not torch.Tensor or tensor.device.type != "cpu" or tensor.layout != torch.strided:
            return None
        if tensor.is_quantized:
            return None
        storage = tensor.untyped_storage()
        start, nbytes = storage.data_ptr(), storage.nbytes()
        if nbytes == 0:
            return _EMPTY, 0, 0
        for area in self._areas.values():
            if area.base <= start and start + nbytes <= area.base + area.nbytes:
                return area.key, start - area.base, nbytes
        return None

    # ---- the files -------------------------------------------------------------------------------------------------
    def save_torch(self, obj: Any, path: str | os.PathLike) -> str | None:
        """``torch.save(obj, path)``'s file written by the child from the shared memory; returns its checksum (the
        manifest's kind; "": written by ``torch.save`` there, not hashed), or None where the child cannot take it
        (write it here)."""
        payload = self._pickled(obj)
        if payload is None:
            return None
        return self._request(("torch", os.fspath(path), payload[0]), payload[1])

    def save_safetensors(self, tensors: dict[str, torch.Tensor], path: str | os.PathLike, metadata: Any) -> str | None:
        """safetensors' ``save_file(tensors, path, metadata)`` written by the child; returns the file's checksum, or
        None where the child cannot take it, or safetensors must write it (write it here)."""
        if not isinstance(tensors, dict):
            return None
        payload = self._pickled(tensors)
        if payload is None:
            return None
        return self._request(("safetensors", os.fspath(path), payload[0], metadata), payload[1])

    def _pickled(self, obj: Any) -> tuple[bytes, set[int]] | None:
        buffer = io.BytesIO()
        pickler = _Pickler(buffer, self)
        try:
            pickler.dump(obj)
        except Exception:  # noqa: BLE001 - a tensor outside the shared memory, an object pickle refuses: the thread's
            return None
        return buffer.getvalue(), pickler.used

    def _request(self, message: tuple, used: set[int]) -> str | None:
        with self._lock:
            sock = self._ready()
            if sock is None:  # the child could not start: the thread writes the file
                return None
            try:
                for key in self._released:
                    _send(sock, ("unmap", key))
                self._released.clear()
                for key in sorted(used - {_EMPTY}):
                    area = self._areas[key]
                    if not area.sent:
                        _send(sock, ("map", key, area.nbytes), [area.fd])
                        area.sent = True
                _send(sock, message)
                (status, value), _ = _receive(sock)
            except (EOFError, OSError) as exc:
                self._stop()
                raise WriterProcessDied(
                    f"The checkpoint writer process ended while it wrote {message[1]} ({type(exc).__name__}: {exc})"
                ) from exc
        if status == "error":
            raise value
        return value  # a checksum, or None: declined

    def _spawn(self) -> None:
        """The child started, unless one runs (or was started and has not answered yet)."""
        if self._process is not None and self._process.poll() is None:
            return
        self._stop()
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        source = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # hflight's parent
        path = os.pathsep.join(filter(None, [source, os.environ.get("PYTHONPATH")]))
        # Tied to this process's life where the thread starting it is the main one (PR_SET_PDEATHSIG follows the
        # thread that started the child): a child outliving a killed run would go on writing into its folder.
        tie = threading.current_thread() is threading.main_thread()
        try:
            self._process = subprocess.Popen(
                [sys.executable, "-m", _CHILD, str(theirs.fileno()), str(os.getpid()), "tie" if tie else "-"],
                pass_fds=[theirs.fileno()], stdin=subprocess.DEVNULL, start_new_session=True,
                env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": path},
            )  # fmt: skip
        except OSError as exc:
            ours.close()
            self._unavailable(exc)
            return
        finally:
            theirs.close()
        self._sock, self._answered = ours, False
        self._released.clear()
        for area in self._areas.values():  # a new child maps every area again
            area.sent = False

    def _ready(self) -> socket.socket | None:
        """The connection to a child that has answered (started now if none runs); None where none could start."""
        self._spawn()
        sock = self._sock
        if sock is None or self._answered:
            return sock
        sock.settimeout(START_TIMEOUT_S)
        try:
            _send(sock, ("hello",))
            _receive(sock)
        except (EOFError, OSError) as exc:
            self._stop()
            self._unavailable(exc)
            return None
        sock.settimeout(None)
        self._answered = True
        return sock

    def _unavailable(self, exc: BaseException) -> None:
        if not self._said_unavailable:
            self._said_unavailable = True
            logger.warning(f"The checkpoint writer process could not start ({type(exc).__name__}: {exc}): the "
                           "background writer thread writes every file.")  # fmt: skip

    def _stop(self) -> None:
        """The child told to end (processes forked since, a data loader's workers, hold copies of this end of the
        connection: closing it would not end the child), the connection closed, the child killed if it has not ended
        soon."""
        if self._sock is not None:
            if self._process is not None and self._process.poll() is None:
                if not self._answered:  # still starting, nothing written: not waited for
                    self._process.kill()
                try:
                    _send(self._sock, ("exit",))
                except OSError:
                    pass
            self._sock.close()
            self._sock = None
        if self._process is not None:
            try:
                self._process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait()
            self._process = None

    def close(self) -> None:
        """Stop the child (at the end of the run's fit) and release the shared memory."""
        with self._lock:
            self._stop()
        for area in list(self._areas.values()):
            self.release(area.array)
        self._released.clear()


def _pin(base: int, nbytes: int) -> bool:
    """Page-lock host memory for copies from a GPU (``cudaHostRegister``); False where that is not possible."""
    if not torch.cuda.is_available():
        return False
    try:
        code = int(torch.cuda.cudart().cudaHostRegister(base, nbytes, 1))  # cudaHostRegisterPortable, as torch's DCP
    except Exception as exc:  # noqa: BLE001 - an old or odd CUDA runtime binding: copies stay pageable
        code = exc
    if code != 0:
        logger.warning(f"Could not pin the checkpoints' shared staging memory ({code}): copies from the GPU into it "
                       "hold the training loop until each is made.")  # fmt: skip
        return False
    return True


def _unpin(base: int) -> None:
    try:
        torch.cuda.cudart().cudaHostUnregister(base)
    except Exception:  # noqa: BLE001 - best effort: the memory is freed with its mapping
        pass


# ---- the child -------------------------------------------------------------------------------------------------------
class _Unpickler(pickle.Unpickler):
    """A state's structure with each tensor made over the shared memory it was copied into (tensors of one storage
    share it, as in the training process)."""

    def __init__(self, data: bytes, areas: dict[int, Any], storages: dict[tuple[int, int, int], Any]) -> None:
        super().__init__(io.BytesIO(data))
        self.areas, self.storages = areas, storages

    def persistent_load(self, pid: Any) -> Any:
        _, key, offset, nbytes, dtype, shape, stride, storage_offset = pid
        storage = self.storages.get((key, offset, nbytes)) if key != _EMPTY else None
        if storage is None:
            if key == _EMPTY:
                storage = torch.UntypedStorage(0)
            else:
                storage = torch.frombuffer(self.areas[key], dtype=torch.uint8, count=nbytes, offset=offset)
                storage = storage.untyped_storage()
                self.storages[(key, offset, nbytes)] = storage
        return torch.empty(0, dtype=getattr(torch, dtype)).set_(storage, storage_offset, shape, stride)


def _serve(sock: socket.socket) -> None:
    import xxhash

    from hflight.checkpoints import safetensors_file, torch_file

    new_digest = xxhash.xxh3_128  # the manifest's (manifest.new_digest), without importing what the manifest imports

    areas: dict[int, Any] = {}
    while True:
        try:
            message, fds = _receive(sock)
        except EOFError:
            return
        kind = message[0]
        if kind == "exit":
            return
        if kind == "hello":
            _send(sock, ("ok", None))
        elif kind == "map":
            _, key, nbytes = message
            mapped = mmap.mmap(fds[0], max(nbytes, 1))
            os.close(fds[0])
            areas[key] = mapped
        elif kind == "unmap":
            areas.pop(message[1], None)  # unmapped once the last tensor over it is gone
        else:
            _send(sock, _write(message, areas, torch_file, safetensors_file, new_digest))


def _write(message: tuple, areas: dict[int, Any], torch_file: Any, safetensors_file: Any, new_digest: Any) -> tuple:
    """One file: ("ok", its checksum), ("ok", "") written by ``torch.save``, ("ok", None) where it is not taken (for
    the writer thread to write), ("error", the exception)."""
    kind, path, payload = message[:3]
    try:
        state = _Unpickler(payload, areas, {}).load()
    except Exception:  # noqa: BLE001 - a structure this process cannot rebuild: the thread writes the file
        return ("ok", None)
    hasher = new_digest()
    try:
        if kind == "torch":
            wrote = torch_file.save(state, path, hasher)
        else:
            wrote = safetensors_file.save(state, path, message[3], hasher)
    except BaseException as exc:  # noqa: BLE001 - returned: raised by the writer thread
        try:
            pickle.dumps(exc)
        except Exception:  # noqa: BLE001
            exc = RuntimeError(f"{type(exc).__name__}: {exc}")
        return ("error", exc)
    if not wrote:  # torch: torch.save wrote it (hashed by the checksums' thread); safetensors: it must write it
        return ("ok", "" if kind == "torch" else None)
    return ("ok", hasher.hexdigest())


def serve(descriptor: int) -> None:
    """The child's loop on its end of the connection (``hflight.checkpoints.writer_child`` calls it)."""
    sock = socket.socket(fileno=descriptor)
    try:
        _serve(sock)
    finally:
        sock.close()
