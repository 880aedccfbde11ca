"""A tensorizer-compatible `.tensors` codec, faster than tensorizer.

Files are CoreWeave tensorizer's format (data versions 1, 2, 4, 5); tensorizer
2.x reads what we write and we read what it writes. See
``/work/shared/docs/tensorizer-format.md`` for the byte layout.

Writing (:func:`save_file`, :func:`write_file`)
    * Data version is the minimum the content needs, as tensorizer chooses it:
      1 (numpy dtypes), 2 (bf16/fp8/complex32 present), 4 (meta tensors present),
      5 (a dimension >= 2**32; u64 shapes and versioned metadata entries).
    * ``align=1`` writes exactly the bytes of tensorizer 2.12.1's
      ``write_state_dict`` (tensor type 2, module index 0, 256 KiB metadata
      reservation, grown when more entries need it). ``align=4096`` (default)
      pads inside each tensor header, between the hash block and data_length,
      so every tensor's data starts on a 4 KiB boundary; every tensorizer
      release reads such files (it takes data_length from the header's last
      8 bytes, and the hashes cover the padding). The metadata section is then
      sized to fit and ends on a 4 KiB boundary; there is no tensor-count cap.
    * CRC32 (ISA-L) and SHA-256 per tensor, computed exactly as tensorizer does:
      over the header with the hash values zeroed, then the data.
    * Refused with :class:`~megashard.errors.FormatError` because tensorizer's own
      reader (2.12.1) cannot open the result: an empty state dict ("Tensor index
      in the file is empty"), and zero-element or meta tensors whose dtype numpy
      lacks (bf16, fp8, complex32: ``TypeError: data type '<V2...' not
      understood``). Keep zero-element tensors out of files (the checkpoint
      layer records them in its manifest instead). Zero-element and meta
      tensors of numpy dtypes (e.g. float32) are fine.
    * Also refused: non-str or empty names, names starting with ``\\x1e``
      (tensorizer's marker for nested paths), sparse/quantized tensors.
      Non-contiguous tensors are written as their contiguous copy.

Reading (:func:`open_file`, :func:`load_file`, :func:`parallel_read`)
    * Everything in the prologue and metadata index is validated against the
      file size before any allocation. Malformed files raise
      :class:`~megashard.errors.FormatError`, hash mismatches (with
      ``verify=True`` or ``verify()``) :class:`~megashard.errors.ChecksumError`,
      encrypted files and unknown versions/flags
      :class:`~megashard.errors.UnsupportedFormatError`.
    * Meta tensors (data version 4, e.g. vLLM's ``.vllm_tensorized_marker``)
      are returned as tensors on the ``meta`` device (tensorizer materialises
      zeros; do ``torch.zeros_like(t, device="cpu")`` if you need that). Reading
      one into ``out=`` zero-fills it. This way a hostile shape can never make
      us allocate memory the file does not hold.
    * Nested paths written by tensorizer (``\\x1e["model","layers",0,"w"]``)
      appear as dotted keys (``model.layers.0.w``).
    * Without verification reads trust the metadata index (offsets and
      lengths, already validated); headers are parsed for ``info()``/``infos()``
      and verification.
    * ``load_file`` returns CPU tensors that are views into one fresh buffer,
      pre-faulted in parallel in 512 KiB steps right before each ``preadv``
      (``MADV_POPULATE_WRITE``, see :func:`~megashard.format.fastio.prefault`;
      huge pages where they help, ``MEGASHARD_HUGEPAGES=0/1`` overrides, see
      :func:`~megashard.format.fastio.hugepages_enabled`); the buffer is freed
      when the last view is. (``torch.save`` of a single view would save the
      whole buffer: ``.clone()`` it first.) ``read(key, out=t)`` and
      :func:`parallel_read` fill existing tensors with no allocation at all: the
      fastest path, used by the checkpoint loader.
    * ``load_file(..., mmap=True)`` / ``open_file(p).read(key, mmap=True)``: no
      copy; tensors are views of one private, copy-on-write mapping of the whole
      file (``MAP_PRIVATE``, as safetensors and ``torch.load(mmap=True)`` do),
      made after the index has been validated against the file size and the size
      checked again. Pages come from the page cache when first touched; writes to
      the tensors stay private to the process. Caveat: the file must not be
      modified or truncated while such tensors live (untouched pages show the new
      contents; pages past a new end of file raise SIGBUS). Tensors whose data is
      not aligned to their element size in the file (``align=1`` and
      tensorizer-written files, whose headers have any length) are read into
      fresh memory instead, so no tensor has a misaligned pointer; with the
      default ``align=4096`` every tensor is mapped. ``verify=True`` hashes the
      mapped bytes. The mapping holds no file descriptor.

Threads: writes use one thread per CPU (hashing is CPU-bound), reads one per
CPU (page-cache copies are CPU-bound); both at least 2, at most 8.
"""
from __future__ import annotations

from .fastio import empty_buffer, parallel_read
from .layout import TensorInfo
from .reader import MissingTensorError, TensorFileReader, load_file, open_file
from .writer import save_file, write_file

__all__ = [
    "save_file",
    "write_file",
    "load_file",
    "open_file",
    "TensorInfo",
    "TensorFileReader",
    "MissingTensorError",
    "parallel_read",
    "empty_buffer",
]
