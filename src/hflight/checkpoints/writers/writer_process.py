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
the child wrote (``hflight.checkpoints.writers.torch_file`` and ``hflight.checkpoints.writers.safetensors_file``, the
same files, past the page cache, hashed as written). The rest of the job (small files, ``save_pretrained``'s own files,
the manifest, the fsyncs, the publication) stays on the writer thread.

The child is ``python -I -c`` :data:`BOOT` (``hflight.checkpoints.writers.writer_child``: the training process's import
path, without the working folder; no ``multiprocessing``: a user's script is never imported again in it), started by the
writer thread, talking over a Unix socket pair (length-prefixed pickles; each shared memory's
descriptor passed once with ``SCM_RIGHTS``); it imports torch, not hflight's trainer. Until it has answered, the
writer thread writes the files itself: its start (its imports take a second or two of CPU) never holds a checkpoint
up. A file the child cannot take (a tensor outside the shared memory, a structure it cannot unpickle) is written by
the thread as before; an error writing it (a full disk, an I/O error) comes back as the exception, with its
``errno`` and file name, and fails the checkpoint as any write error does; a child that dies fails the write in
progress with an error saying so (with the last line it wrote to its standard error), and the next file is written by
a new child. A child that ends before it ever answered could not start (an import that fails, say): none is started
again in the run, and one warning says why (its standard error's last line). The child and the shared memory
belong to :mod:`hflight.checkpoints.writers.resources`: let go of in a forked process (which never talks to the parent's
child), released at :meth:`WriterProcess.close` and at exit. Linux only (``memfd_create``); elsewhere the thread
writes everything.

Why not torch's own: ``torch.distributed.checkpoint``'s process-based asynchronous save and its shared, pinned stager
write its own format (a folder of ``.distcp`` files and a ``.metadata``), need a process group, and serialize in a
process of ``multiprocessing``'s that imports the user's script again; a checkpoint here must be transformers'
files (``optimizer.pt`` as ``torch.save`` writes it, ``model.safetensors`` as safetensors does), hashed as written.

May import: ``hflight.checkpoints.writers.torch_file``, ``hflight.checkpoints.writers.safetensors_file`` (the child's
imports: torch,
not transformers), ``hflight.checkpoints.writers.resources``.
"""

from __future__ import annotations

import dataclasses
import io
import json
import logging
import mmap
import os
import pickle
import select
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any

import numpy as np
import torch

from hflight.checkpoints.writers import resources

logger = logging.getLogger(__name__)

_LENGTH = struct.Struct("<Q")
#: the child's program, run with ``python -I -c`` (``hflight.checkpoints.writers.writer_child``): the training process's
#: import path in its order (:func:`_child_path`), then its ``main``
BOOT = (
    "import json, sys\n"
    "sys.path[:] = json.loads(sys.argv[1])\n"
    "from hflight.checkpoints.writers.writer_child import main\n"
    "main(sys.argv[2:])\n"
)
#: the packages the child imports: the folders the training process has them from are on its path, whatever else
_CHILD_PACKAGES = ("hflight", "torch", "numpy", "safetensors", "xxhash", "isal")
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


@dataclasses.dataclass(frozen=True)
class _Storage:
    """A storage's place in the shared memory (area, offset, bytes; :data:`_EMPTY` for an empty one): pickled as a
    persistent id, made over the same bytes in the child, once per file for every tensor over it."""

    key: int
    offset: int
    nbytes: int


def view_over(storage: Any, dtype: torch.dtype, shape: tuple, stride: tuple, offset: int, requires_grad: bool,
              parameter: bool) -> torch.Tensor:  # fmt: skip
    """A tensor of a state over ``storage`` as ``torch.save`` writes it: its view (dtype, shape, strides, offset), a
    ``Parameter`` where it was one, its ``requires_grad`` (a snapshot's copy; the child's rebuilt tensor)."""
    tensor = torch.empty(0, dtype=dtype).set_(storage, offset, shape, stride)
    if parameter:
        return torch.nn.Parameter(tensor, requires_grad=requires_grad)
    return tensor.requires_grad_(True) if requires_grad else tensor


def _tensor(storage: Any, dtype: str, shape: tuple, stride: tuple, offset: int, requires_grad: bool, parameter: bool,
            state: Any) -> torch.Tensor:  # fmt: skip
    """A tensor of the state rebuilt in the child over its storage (:func:`view_over`), with its Python attributes."""
    tensor = view_over(storage, getattr(torch, dtype), shape, stride, offset, requires_grad, parameter)
    if state:
        tensor.__dict__.update(state)
    return tensor


class _Pickler(pickle.Pickler):
    """Pickles a state with each tensor's storage in shared memory as its place there (tensors over one storage share
    it in the child, as here); raises :class:`_Outside` for a tensor that is not."""

    def __init__(self, file: Any, owner: WriterProcess) -> None:
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self.owner, self.used = owner, set()

    def reducer_override(self, obj: Any) -> Any:
        if not isinstance(obj, torch.Tensor):
            return NotImplemented
        place = self.owner.place(obj)
        if place is None or type(obj) not in (torch.Tensor, torch.nn.Parameter):
            raise _Outside
        self.used.add(place[0])
        state = obj.__dict__ or None
        return _tensor, (_Storage(*place), str(obj.dtype).removeprefix("torch."), tuple(obj.shape), tuple(obj.stride()),
                         obj.storage_offset(), obj.requires_grad, type(obj) is torch.nn.Parameter, state)  # fmt: skip

    def persistent_id(self, obj: Any) -> Any:
        return (obj.key, obj.offset, obj.nbytes) if type(obj) is _Storage else None


class _Outside(Exception):
    """A tensor of the state is not in shared memory: the file is written by the thread."""


def _child_path() -> list[str]:
    """The child's import path: the training process's, in its order (the standard library before site-packages, the
    folders ``PYTHONPATH`` added, an installation's own), without the working folder (``""`` or its path: a module
    planted there never runs in the child), then the folder of each of the child's packages that the training process
    imported from one of those (each once). Entries that are not strings (a ``pathlib.Path`` a script appended) are
    left out, as Python's own imports ignore them."""
    here = os.path.abspath(os.getcwd())
    path = [entry for entry in sys.path if isinstance(entry, str) and entry and os.path.abspath(entry) != here]
    for name in _CHILD_PACKAGES:
        location = getattr(sys.modules.get(name), "__file__", None)
        if location is not None:
            folder = os.path.dirname(os.path.dirname(os.path.abspath(location)))
            if folder not in path:
                path.append(folder)
    return path


#: every writer process of this process: let go of in a forked child, released at close() and at exit
_held = resources.Resources("checkpoint writer processes")


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
        self._wanted = False  # start() was called: a child runs, or is started again at the next file
        self._started = 0.0  # when the child was started
        self._cannot_start = False
        self._stderr: Any = None  # the child's standard error (a file: its last line says why it could not start)
        self._lock = threading.Lock()

    # ---- shared memory ---------------------------------------------------------------------------------------------
    @property
    def allocated(self) -> bool:
        """Whether shared memory was allocated for this writer."""
        return self._next_key > 0

    def allocate(self, nbytes: int, pinned: bool, populate: bool = False) -> np.ndarray:
        """``nbytes`` of shared memory as a numpy array of bytes (pinned for copies from a GPU where pinning
        succeeds); the writer's staging area. ``populate``: its pages made present now (by the calling thread, the
        interpreter lock released), not at the first copies into them. Any thread."""
        fd = os.memfd_create("hflight-checkpoint", getattr(os, "MFD_CLOEXEC", 0))
        try:
            os.ftruncate(fd, max(nbytes, 1))
            mapped = mmap.mmap(fd, max(nbytes, 1), flags=mmap.MAP_SHARED)
        except BaseException:
            os.close(fd)
            raise
        array = np.frombuffer(mapped, dtype=np.uint8, count=nbytes)
        if populate:
            resources.populate(array)
        pinned = bool(pinned and nbytes) and _pin(array.ctypes.data, nbytes)
        with self._lock:
            area = _Area(self._next_key, array.ctypes.data, nbytes, fd, array, pinned=pinned)
            self._areas[area.key] = area
            self._next_key += 1
        _held.hold(self, WriterProcess._release_all, WriterProcess._forget)
        return array

    def release(self, array: np.ndarray) -> None:
        """The area of ``array`` is no longer used (no write reads it): unpinned, its descriptor closed, the child
        told to unmap it with the next message; its memory goes with the last tensor over it (the snapshots'
        copies are dropped by their writer before)."""
        area = next((a for a in self._areas.values() if a.array is array), None)
        if area is None:
            return
        del self._areas[area.key]
        if area.pinned:
            _unpin(area.base)
        resources.close_descriptor(area.fd)
        if area.sent:
            self._released.append(area.key)

    def place(self, tensor: torch.Tensor) -> tuple[int, int, int] | None:
        """Where ``tensor``'s storage lies in the shared memory: (area, offset, bytes); an empty storage is
        (:data:`_EMPTY`, 0, 0); None: elsewhere."""
        if tensor.device.type != "cpu" or tensor.layout != torch.strided or tensor.is_quantized:
            return None
        storage = tensor.untyped_storage()
        start, nbytes = storage.data_ptr(), storage.nbytes()
        if nbytes == 0:
            return _EMPTY, 0, 0
        for area in tuple(self._areas.values()):  # the next area may be added meanwhile (allocate: any thread)
            if area.base <= start and start + nbytes <= area.base + area.nbytes:
                return area.key, start - area.base, nbytes
        return None

    # ---- the files -------------------------------------------------------------------------------------------------
    def save_torch(self, obj: Any, path: str | os.PathLike) -> str | None:
        """``torch.save(obj, path)``'s file written by the child from the shared memory; returns its checksum (the
        manifest's kind; "": written by ``torch.save`` there, not hashed), or None where the child cannot take it
        (write it here)."""
        if not self._wanted:  # no child started (start()): nothing to ask
            return None
        return self._request(lambda: self._pickled(obj), lambda pickled: ("torch", os.fspath(path), pickled))

    def save_safetensors(self, tensors: dict[str, torch.Tensor], path: str | os.PathLike, metadata: Any) -> str | None:
        """safetensors' ``save_file(tensors, path, metadata)`` written by the child; returns the file's checksum, or
        None where the child cannot take it, or safetensors must write it (write it here)."""
        if not self._wanted or not isinstance(tensors, dict):
            return None
        return self._request(
            lambda: self._pickled(tensors), lambda pickled: ("safetensors", os.fspath(path), pickled, metadata)
        )

    def _pickled(self, obj: Any) -> tuple[bytes, set[int]] | None:
        buffer = io.BytesIO()
        pickler = _Pickler(buffer, self)
        try:
            pickler.dump(obj)
        except Exception:  # noqa: BLE001 - a tensor outside the shared memory, an object pickle refuses: the thread's
            return None
        return buffer.getvalue(), pickler.used

    def _request(self, payload: Any, message: Any) -> str | None:
        """The file of ``message(pickled)`` written by the child, ``payload()`` giving (pickled, areas used) or None;
        None where there is no child that has answered (not started, starting, could not start) or the payload
        cannot be had: the thread writes the file (the state is not pickled for nothing)."""
        with self._lock:
            sock = self._ready()
            if sock is None:  # the child is starting, or could not start: the thread writes the file
                return None
            pickled = payload()
            if pickled is None:
                return None
            message, used = message(pickled[0]), pickled[1]
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
                said = _last_line(self._stderr)
                raise WriterProcessDied(
                    f"The checkpoint writer process ended while it wrote {message[1]} ({type(exc).__name__}: {exc}"
                    f"{'; it said: ' + said if said else ''})"
                ) from exc
        if status == "error":
            raise value
        return value  # a checksum, or None: declined

    def _spawn(self) -> None:
        """The child started (from whichever thread: it ties itself to this process, see
        ``hflight.checkpoints.writers.writer_child``), and asked to answer once it is ready; unless one runs. A child
        that
        ended before it ever answered could not start: none is started again in this run (the thread writes)."""
        if not self._wanted or self._cannot_start or (self._process is not None and self._process.poll() is None):
            return  # not started yet (start()), one runs, or one could not start: not again (the thread writes)
        if self._process is not None and not self._answered:
            self._stop()
            self._unavailable(RuntimeError("it ended as it started"))
            return
        self._stop()
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        # the kernel's tie follows the thread that starts the child: only where that thread lives as long as the process
        tie = threading.current_thread() is threading.main_thread()
        command = [sys.executable, "-I", "-c", BOOT, json.dumps(_child_path()), str(theirs.fileno()), str(os.getpid()),
                   "tie" if tie else "-"]  # fmt: skip
        self._stderr = self._stderr or tempfile.TemporaryFile()
        try:
            self._process = subprocess.Popen(
                command, pass_fds=[theirs.fileno()], stdin=subprocess.DEVNULL, stderr=self._stderr,
                start_new_session=True, env={**os.environ, "OMP_NUM_THREADS": "1"},
            )  # fmt: skip
        except OSError as exc:
            ours.close()
            self._unavailable(exc)
            return
        finally:
            theirs.close()
        _held.hold(self, WriterProcess._release_all, WriterProcess._forget)
        self._sock, self._answered, self._started = ours, False, time.monotonic()
        self._released.clear()
        for area in self._areas.values():  # a new child maps every area again
            area.sent = False
        _send(ours, ("hello",))

    def _ready(self, wait: bool = False) -> socket.socket | None:
        """The connection to a child that has answered (started now if none runs); None while it is starting (``wait``:
        it is waited for), or where none could start."""
        self._spawn()
        sock = self._sock
        if sock is None or self._answered:
            return sock
        left = START_TIMEOUT_S - (time.monotonic() - self._started)
        try:
            if not wait and left > 0 and not select.select([sock], [], [], 0)[0]:
                return None
            sock.settimeout(max(left, 0.001))
            _receive(sock)
        except (EOFError, OSError) as exc:
            self._stop()
            self._unavailable(exc)
            return None
        sock.settimeout(None)
        self._answered = True
        return sock

    def start(self) -> None:
        """The child started if none runs (it answers once it is ready; not waited for); from now on a child that dies
        is replaced at the next file."""
        with self._lock:
            self._wanted = True
            self._spawn()

    def ready(self) -> bool:
        """The child started if none runs, and waited for until it answers (False: it could not start)."""
        with self._lock:
            self._wanted = True
            return self._ready(wait=True) is not None

    def _unavailable(self, exc: BaseException) -> None:
        """No child is started again in this run: said once, with the last line the child wrote to its standard
        error (why its start failed: an import, say)."""
        if not self._cannot_start:
            self._cannot_start = True
            said = _last_line(self._stderr)
            logger.warning(f"The checkpoint writer process could not start ({type(exc).__name__}: {exc}"
                           f"{'; it said: ' + said if said else ''}): the background writer thread writes every "
                           "file.")  # fmt: skip

    def _stop(self) -> None:
        """The child ended and reaped, the connection closed. Called with no request in flight (the lock held), so
        the child has nothing left to write: it is killed rather than told to end, which would wait for its
        interpreter's teardown (a few tenths of a second of torch's at the end of every run), or for its start."""
        if self._sock is not None:
            self._sock.close()
            self._sock = None
        if self._process is not None:
            if self._process.poll() is None:
                self._process.kill()
            self._process.wait()
            self._process = None

    def close(self) -> None:
        """Stop the child (at the end of the run's fit) and release the shared memory."""
        _held.let_go(self)
        self._release_all()

    def _release_all(self) -> None:
        with self._lock:
            self._wanted = False
            self._stop()
            if self._stderr is not None:
                self._stderr.close()
                self._stderr = None
        for area in list(self._areas.values()):
            self.release(area.array)
        self._released.clear()

    def _forget(self) -> None:
        """In a forked process: the parent's child and shared memory let go of, untouched (this process's copies of
        their descriptors closed; nothing sent to the child); a later checkpoint here starts its own."""
        if self._sock is not None:
            self._sock.close()
        if self._stderr is not None:
            self._stderr.close()
        for area in self._areas.values():
            resources.close_descriptor(area.fd)
        self._areas, self._released, self._process, self._sock, self._wanted = {}, [], None, None, False
        self._stderr = None
        self._lock = threading.Lock()


def _last_line(file: Any) -> str:
    """The last line of text written to ``file`` (the child's standard error), "" where none."""
    if file is None:
        return ""
    try:
        file.seek(max(os.fstat(file.fileno()).st_size - 4096, 0))
        lines = [line.strip() for line in file.read().decode("utf-8", "replace").splitlines() if line.strip()]
    except OSError:
        return ""
    return lines[-1] if lines else ""


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
    """A state's structure with each storage made over the shared memory it was copied into, once (the tensors over
    it share it, as in the training process); an empty storage is one of its own each time, as there."""

    def __init__(self, data: bytes, areas: dict[int, Any]) -> None:
        super().__init__(io.BytesIO(data))
        self.areas: dict[int, Any] = areas
        self.storages: dict[tuple[int, int, int], Any] = {}

    def persistent_load(self, pid: Any) -> Any:
        key, offset, nbytes = pid
        if key == _EMPTY:
            return torch.UntypedStorage(0)
        storage = self.storages.get(pid)
        if storage is None:
            storage = torch.frombuffer(self.areas[key], dtype=torch.uint8, count=nbytes, offset=offset)
            storage = self.storages[pid] = storage.untyped_storage()
        return storage


def _serve(sock: socket.socket) -> None:
    import xxhash

    from hflight.checkpoints.writers import safetensors_file, torch_file

    new_digest = xxhash.xxh3_128  # the manifest's (manifest.new_digest), without importing what the manifest imports

    areas: dict[int, Any] = {}
    while True:
        try:
            message, fds = _receive(sock)
        except EOFError:
            return
        kind = message[0]
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
        state = _Unpickler(payload, areas).load()
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
    """The child's loop on its end of the connection (``hflight.checkpoints.writers.writer_child`` calls it)."""
    sock = socket.socket(fileno=descriptor)
    try:
        _serve(sock)
    finally:
        sock.close()
