"""hflight.checkpoints.writers.safetensors_file: inside a checkpoint's steps, the model's safetensors files written as
safetensors writes them, byte for byte, past the page cache and hashed as they are written; everywhere else, and for
what safetensors refuses or treats its own way, safetensors' own ``save_file``. And a checkpoint's large files
(``model.safetensors``, ``optimizer.pt``) are hashed as they are written, not read back (issue 56, item 4)."""

from __future__ import annotations

import json
import logging
import struct
import threading
from pathlib import Path

import pytest
import torch
from safetensors.torch import save as safetensors_bytes
from safetensors.torch import save_file as safetensors_save_file
from transformers import BertConfig, BertForQuestionAnswering, GPT2Config, GPT2LMHeadModel

from hflight.checkpoints import manifest
from hflight.checkpoints.manifest import Checksums, file_digest, verify_checkpoint
from hflight.checkpoints.writers import safetensors_file

from .checkpoint_runs import make_trainer


def _models():
    torch.manual_seed(0)
    yield "gpt2 (tied lm_head)", GPT2LMHeadModel(GPT2Config(n_embd=32, n_layer=2, n_head=2, vocab_size=100))
    bert = BertConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64, vocab_size=100)
    yield "bert", BertForQuestionAnswering(bert).to(torch.bfloat16)


@pytest.fixture
def no_read_back(monkeypatch):
    """The checksums computed by reading a file back, recorded by name (file_digest as manifest uses it)."""
    read = []
    real = manifest.file_digest
    monkeypatch.setattr(manifest, "file_digest", lambda path: read.append(path.name) or real(path))
    return read


@pytest.mark.parametrize("name, model", list(_models()))
def test_save_pretrained_in_a_checkpoint_step_writes_safetensors_bytes_hashed_as_written(
    tmp_path, no_read_back, name, model
):
    safetensors_file.install()
    model.save_pretrained(tmp_path / "theirs")
    with Checksums() as checksums, safetensors_file.hashed_into(checksums):
        model.save_pretrained(tmp_path / "ours")
        ours = tmp_path / "ours" / "model.safetensors"
        digest = checksums.digest(ours)
    assert ours.read_bytes() == (tmp_path / "theirs" / "model.safetensors").read_bytes()
    assert digest == file_digest(ours)
    assert no_read_back == []  # the digest came from the writer


def test_only_the_thread_inside_a_step_is_routed(tmp_path, monkeypatch):
    """Another thread's save_pretrained (a user's, beside a background checkpoint write) is safetensors' own."""
    safetensors_file.install()
    written = []
    real = safetensors_file.save
    monkeypatch.setattr(
        safetensors_file, "save", lambda tensors, path, *a: written.append(path) or real(tensors, path, *a)
    )
    model = next(_models())[1]
    with Checksums() as checksums, safetensors_file.hashed_into(checksums):
        other = threading.Thread(target=model.save_pretrained, args=(tmp_path / "other",))
        other.start()
        other.join()
        model.save_pretrained(tmp_path / "step")
    model.save_pretrained(tmp_path / "after")
    assert [Path(path).parent.name for path in written] == ["step"]
    expected = (tmp_path / "step" / "model.safetensors").read_bytes()
    assert all((tmp_path / folder / "model.safetensors").read_bytes() == expected for folder in ("other", "after"))


def test_outside_a_step_the_function_transformers_called_before_is_called(tmp_path, monkeypatch):
    """Someone else's wrapper around save_file (a library's, a user's), installed in transformers' modeling_utils
    before hflight's route, still writes every file outside a checkpoint step, and the files hflight's writer leaves
    to safetensors inside one: the route replaces it only where hflight writes the file itself."""
    from transformers import modeling_utils

    called = []

    def wrapper(tensors, filename, metadata=None):
        called.append(Path(filename).parent.name)
        safetensors_save_file(tensors, filename, metadata=metadata)

    monkeypatch.setattr(modeling_utils, "safe_save_file", wrapper)
    monkeypatch.setattr(safetensors_file, "_replaced", None)
    safetensors_file.install()
    assert modeling_utils.safe_save_file is safetensors_file.save_file
    model = next(_models())[1]
    model.save_pretrained(tmp_path / "outside")
    with Checksums() as checksums, safetensors_file.hashed_into(checksums):
        model.save_pretrained(tmp_path / "inside")
        (tmp_path / "declined").mkdir()  # a tensor whose memory is not its elements: safetensors' to write
        safetensors_file.save_file({"a": torch._neg_view(torch.ones(2))}, tmp_path / "declined" / "x.safetensors")
    assert called == ["outside", "declined"]


@pytest.mark.parametrize("metadata", [None, {}, {"format": "pt", 'é "quoted"\n': "ü\t\x01"}])
def test_headers_are_safetensors_own_for_any_names_and_metadata(tmp_path, metadata):
    tensors = {
        "layer.10.w": torch.randn(3, 5),
        "layer.9.w": torch.randn(2).to(torch.bfloat16),
        'naïve "name"': torch.arange(4, dtype=torch.int32),
        "empty": torch.empty(0, 3, dtype=torch.float16),
        "flag": torch.tensor(True),
    }
    assert safetensors_file.save(tensors, tmp_path / "ours.safetensors", metadata, None)
    ours, theirs = (tmp_path / "ours.safetensors").read_bytes(), safetensors_bytes(tensors, metadata=metadata)
    if metadata is None or len(metadata) < 2:
        assert ours == theirs
    else:  # safetensors orders several metadata keys anew in each call (a Rust HashMap): the rest is byte for byte
        assert _parts(ours) == _parts(theirs)


def _parts(blob: bytes) -> tuple:
    """A safetensors file's header length, its header as a dict (tensors' offsets give their order), its data."""
    (length,) = struct.unpack("<Q", blob[:8])
    return length, json.loads(blob[8 : 8 + length]), blob[8 + length :]


_SHARED = torch.randn(4, 4)


@pytest.mark.parametrize(
    "tensors, metadata",
    [
        pytest.param({"a": _SHARED, "b": _SHARED}, None, id="shared storage"),
        pytest.param({"a": torch.randn(4, 4).t()}, None, id="not contiguous"),
        pytest.param({"a": torch.randn(3)}, {"step": 3}, id="metadata not text"),
    ],
)
def test_what_safetensors_refuses_it_refuses_with_its_own_error(tmp_path, tensors, metadata):
    with pytest.raises(Exception) as theirs:
        safetensors_save_file(tensors, tmp_path / "theirs.safetensors", metadata=metadata)
    with Checksums() as checksums, safetensors_file.hashed_into(checksums):
        with pytest.raises(type(theirs.value)) as ours:
            safetensors_file.save_file(tensors, tmp_path / "ours.safetensors", metadata=metadata)
    assert str(ours.value) == str(theirs.value)


def _every_dtype():
    """Every dtype this torch has, by name."""
    found = {getattr(torch, name) for name in dir(torch) if isinstance(getattr(torch, name), torch.dtype)}
    return sorted(found, key=str)


def _of_dtype(dtype, shape=(3, 4)):
    """A tensor of ``dtype`` and ``shape`` made from a count of bytes; None where torch cannot view bytes as it."""
    try:
        size = torch.empty(0, dtype=dtype).element_size()
        count = torch.arange(size * 12, dtype=torch.int64) % 7
        return count.to(torch.uint8).view(dtype).reshape(shape)
    except Exception:  # noqa: BLE001
        return None


def _lazy_bits():
    """Tensors whose bytes are not their elements: a conjugate and a negative bit (safetensors writes the memory)."""
    values = torch.arange(6, dtype=torch.float32).reshape(3, 2)
    complex_ = torch.view_as_complex(values.contiguous())
    return {"conj": complex_.conj(), "neg": torch._neg_view(values)}


@pytest.mark.parametrize("dtype", [*_every_dtype(), "conjugate bit", "negative bit"], ids=str)
def test_every_dtype_is_written_as_safetensors_writes_it_or_by_safetensors(tmp_path, dtype):
    """For every dtype torch has, the file inside a checkpoint step is safetensors' own, byte for byte, or safetensors'
    own error: a float4 pair of shape (3, 4) is ``"shape":[3,8]`` in safetensors' header, which the writer took from
    torch's shape (an unreadable file whose checksum verified). Lazy bits: safetensors writes the memory as it lies,
    where the writer raised."""
    if isinstance(dtype, str):
        tensor = _lazy_bits()["conj" if dtype.startswith("conj") else "neg"]
        assert tensor.is_conj() or tensor.is_neg()
    else:
        tensor = _of_dtype(dtype)
    if tensor is None:
        pytest.skip(f"torch cannot make a {dtype} tensor from bytes")
    tensors = {"w": tensor, "b": torch.ones(2)}
    theirs, ours = tmp_path / "theirs.safetensors", tmp_path / "ours.safetensors"
    try:
        safetensors_save_file(tensors, theirs)
    except Exception as exc:  # noqa: BLE001
        refused = exc
    else:
        refused = None
    with Checksums() as checksums, safetensors_file.hashed_into(checksums):
        if refused is not None:
            with pytest.raises(type(refused)) as raised:
                safetensors_file.save_file(tensors, ours)
            assert str(raised.value) == str(refused)
            return
        safetensors_file.save_file(tensors, ours)
        digest = checksums.digest(ours)
    assert ours.read_bytes() == theirs.read_bytes()
    assert digest == file_digest(ours)


def test_a_safetensors_whose_header_differs_writes_the_file_itself(tmp_path, monkeypatch, caplog):
    """Where this module's serializer does not give safetensors' header (checked on a probe at first use), safetensors'
    save_file writes every file, said once in the log."""
    real = safetensors_file._serialized
    monkeypatch.setattr(safetensors_file, "_serialized", lambda header: real(header).replace(b'":', b'" :'))
    safetensors_file._agrees.cache_clear()
    try:
        with caplog.at_level(logging.WARNING, logger=safetensors_file.__name__):
            assert not safetensors_file.save({"a": torch.ones(2)}, tmp_path / "x.safetensors", None, None)
        assert "its header is serialized otherwise" in caplog.text
        with Checksums() as checksums, safetensors_file.hashed_into(checksums):
            safetensors_file.save_file({"a": torch.ones(2)}, tmp_path / "y.safetensors")
        assert (tmp_path / "y.safetensors").read_bytes() == safetensors_bytes({"a": torch.ones(2)})
    finally:
        safetensors_file._agrees.cache_clear()


@pytest.mark.parametrize("save_async", [False, True], ids=["synchronous", "save_async"])
def test_a_checkpoint_s_model_and_optimizer_files_are_hashed_as_written_not_read_back(
    tmp_path, factory, no_read_back, save_async
):
    """The synchronous save read both files back to hash them; save_async read model.safetensors back."""
    trainer = make_trainer(tmp_path, factory, max_steps=3, save_async=save_async)
    trainer.train()
    folder = tmp_path / "checkpoint-3"
    verify_checkpoint(folder)
    assert {"model.safetensors", "optimizer.pt"} <= {p.name for p in folder.iterdir()}
    assert not {"model.safetensors", "optimizer.pt"} & set(no_read_back), no_read_back
