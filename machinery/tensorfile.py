"""
Files of tensors written safely: safetensors by hand, one tensor at a time and atomically, and
torch.save with its real error.

A safetensors file is an 8-byte little-endian header length, a JSON header (name -> dtype,
shape, byte range; "__metadata__" -> {str: str}), then the tensors' raw bytes in that order.
Writing it ourselves lets hf.py convert and write one tensor at a time (the safetensors
package's save_file wants every tensor at once: a second copy of the model), and keeps the
metadata in the order given (the package writes it in no fixed order, so the same contents
could give different bytes). Reading is the package's safe_open: it reads one tensor at a time.
"""
import json
import os

import torch

CODES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16",
         torch.uint8: "U8", torch.int8: "I8", torch.int32: "I32", torch.int64: "I64"}


def replace_atomically(path, write):
    """write(f) into a temporary file beside path, fsync, then os.replace: a crash leaves the old
    file or the new one, never half of one."""
    tmp = os.path.join(os.path.dirname(os.path.abspath(path)),
                       f".{os.path.basename(path)}.tmp{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise
    os.replace(tmp, path)


def write_safetensors(path, header, tensors, metadata=None):
    """Write a safetensors file one tensor at a time (atomically). header: {name: (dtype, shape)}
    in file order; tensors yields (name, tensor) in the same order, each of that dtype;
    metadata: {str: str}, kept in the order given, so the bytes depend on the contents only."""
    meta, offset = {"__metadata__": {"format": "pt", **(metadata or {})}}, 0
    for name, (dtype, shape) in header.items():
        n = dtype.itemsize * int(torch.Size(shape).numel())
        meta[name] = {"dtype": CODES[dtype], "shape": list(shape),
                      "data_offsets": [offset, offset + n]}
        offset += n
    head = json.dumps(meta, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)  # the format pads the header to 8-byte alignment with spaces

    def write(f):
        f.write(len(head).to_bytes(8, "little"))
        f.write(head)
        for (name, t), want in zip(tensors, header):
            assert name == want and t.dtype == header[name][0], (name, want)
            f.write(t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())  # LE
    replace_atomically(path, write)


class _Recorder:
    """A file torch.save writes through: torch reports a failed write as an opaque RuntimeError
    ("unexpected pos"); this keeps the OSError behind it (a full disk, a file-size limit)."""

    def __init__(self, f):
        self.f, self.error, self.flush = f, None, f.flush

    def write(self, data):
        try:
            return self.f.write(data)
        except OSError as e:
            self.error = e
            raise


def torch_save(obj, path):
    """torch.save, flushed and fsynced; an OSError (not torch's RuntimeError) when the bytes
    did not reach the disk."""
    with open(path, "wb") as f:
        out = _Recorder(f)
        try:
            torch.save(obj, out)
        except RuntimeError:
            raise out.error or OSError(f"torch.save could not write {path}")
        f.flush()
        os.fsync(f.fileno())
