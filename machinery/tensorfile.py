"""
Files of tensors written safely: safetensors by hand, one tensor at a time and atomically.
(Checkpoints are written by the safetensors package itself: machinery/ckpt_reader.py.)

A safetensors file is an 8-byte little-endian header length, a JSON header (name -> dtype,
shape, byte range; "__metadata__" -> {str: str}), then the tensors' raw bytes in that order.
Writing it ourselves lets hf.py convert and write one tensor at a time (the safetensors
package's save_file wants every tensor at once: a second copy of the model), and keeps the
metadata in the order given (the package writes it in no fixed order, so the same contents
could give different bytes). Reading is the package's safe_open: it reads one tensor at a time.

Every safetensors file we write keeps a crc32 of each tensor's bytes in its metadata ("crc32",
a JSON object of name -> 8 hex digits), filled in once the bytes are written; check_crcs holds
a tensor read back to it. A file from elsewhere (Hugging Face's) has none and is read as it is.
"""
import json
import os
import zlib

import torch

from machinery.validate import crc

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


CRC = "crc32"  # the metadata key of our tensors' checksums


def _crc_text(crcs):
    """The metadata value of the checksums: fixed width, so it can be filled in afterwards."""
    return json.dumps({name: f"{c:08x}" for name, c in crcs.items()}, separators=(",", ":"))


def write_safetensors(path, header, tensors, metadata=None):
    """Write a safetensors file one tensor at a time (atomically). header: {name: (dtype, shape)}
    in file order; tensors yields (name, tensor) in the same order, each of that dtype;
    metadata: {str: str}, kept in the order given, so the bytes depend on the contents only.
    Each tensor's crc32 goes into the metadata, written over its placeholder at the end."""
    blank = _crc_text(dict.fromkeys(header, 0))
    meta = {"__metadata__": {"format": "pt", **(metadata or {}), CRC: blank}}
    offset = 0
    for name, (dtype, shape) in header.items():
        n = dtype.itemsize * int(torch.Size(shape).numel())
        meta[name] = {"dtype": CODES[dtype], "shape": list(shape),
                      "data_offsets": [offset, offset + n]}
        offset += n
    head = json.dumps(meta, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)  # the format pads the header to 8-byte alignment with spaces

    at = 8 + head.index(b'"%s":"' % CRC.encode()) + len(CRC) + 4  # the value, after its quote

    def write(f):
        f.write(len(head).to_bytes(8, "little"))
        f.write(head)
        crcs = {}
        for (name, t), want in zip(tensors, header):
            assert name == want and t.dtype == header[name][0], (name, want)
            data = t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()  # LE
            crcs[name] = zlib.crc32(data)
            f.write(data)
        assert len(crcs) == len(header), "fewer tensors than the header names"
        f.seek(at)  # the same length as the blank: the header's bytes stay where they are
        f.write(json.dumps(_crc_text(crcs))[1:-1].encode())
    replace_atomically(path, write)


def check_crcs(meta, tensors):
    """Tensors read from a safetensors file ({name: tensor}, some or all) against the crc32s
    its metadata keeps (ours); a file without them (from elsewhere) passes as it is. A
    ValueError names the first tensor whose bytes changed."""
    if not meta or CRC not in meta:
        return
    try:
        want = {k: int(v, 16) for k, v in json.loads(meta[CRC]).items()}
    except (ValueError, TypeError, AttributeError):
        raise ValueError("its tensors' checksums are unreadable (an edited file)")
    for name, t in tensors.items():
        if name not in want or crc(t) != want[name]:
            raise ValueError(f"tensor {name} fails its checksum: its bytes changed")
