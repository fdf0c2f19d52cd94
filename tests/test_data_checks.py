"""A data folder that is broken, or that changed between a run and its --resume (issue 42).

A broken folder (missing, empty, cut short or odd-sized .bin files, a meta.json that is missing,
not JSON, of the wrong shape or naming another tokenizer, ids outside the vocabulary) is one
line before any work, on every rank, naming the file and the data/prepare.py command that
writes it again. A resume compares the data's identity (each .bin file's size and sha256) with
the checkpoint's: a change is one line, or with --accept-new-data a row in metrics.jsonl.
Most runs here are train.main in this process: a refusal comes before the model is built."""
import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

from checkpoint import list_checkpoints
from conftest import ROOT, TEXT, needs_gpt2_bpe, run_train
from configurator import UserError
from data.prepare import prepare
from train import main

TINY = ["--device", "cpu", "--n-layer", "1", "--n-embd", "16", "--n-head", "2",
        "--block-size", "16", "--batch-size", "2", "--eval-iters", "1", "--log-interval", "1",
        "--dataset", "tiny"]


def own_data(data_root, tmp_path):
    """A copy of the shared "tiny" data set that a test may break: its data root."""
    root = tmp_path / "data"
    shutil.copytree(os.path.join(data_root, "tiny"), root / "tiny")
    return root


def refused(argv, *words, error=UserError):
    """main(argv) raises error, one line holding every word; returns the line."""
    with pytest.raises(error) as e:
        main(argv)
    line = str(e.value)
    assert "\n" not in line and all(w in line for w in words), line
    return line


def snapshot(folder):
    """{relative path: bytes} of every file under folder (a refusal must change none)."""
    files = {}
    for top, _, names in os.walk(folder):
        for name in names:
            path = os.path.join(top, name)
            with open(path, "rb") as f:
                files[os.path.relpath(path, folder)] = f.read()
    return files


def rows(out):
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


# ----------------------------------------------------------------------------------------------
# 2. a broken data folder: one line before any work, naming the file and the command

def cut(n):
    return lambda path: path.write_bytes(path.read_bytes()[:n])


def other_meta(**change):
    def edit(path):
        meta = json.loads(path.read_text())
        meta.update(change)
        path.write_text(json.dumps(meta))
    return edit


def no_key(key):
    def edit(path):
        meta = json.loads(path.read_text())
        del meta[key]
        path.write_text(json.dumps(meta))
    return edit


def id_out_of_vocabulary(path):  # the same size as meta.json says, one id no vocabulary has
    ids = np.fromfile(path, dtype=np.uint16)
    ids[100] = 60000
    ids.tofile(path)


BROKEN = {  # case: (file, how it is broken, what the line says)
    "train.bin odd-sized": ("train.bin", cut(20001), "an odd number"),
    "train.bin cut to half its tokens": ("train.bin", cut(36000), "meta.json says 36,000"),
    "train.bin missing": ("train.bin", os.remove, "no "),
    "val.bin empty": ("val.bin", cut(0), "is empty"),
    "meta.json missing": ("meta.json", os.remove, "no "),
    "meta.json not JSON": ("meta.json", lambda p: p.write_text("{\"tokenizer\": "), "not JSON"),
    "meta.json a list": ("meta.json", lambda p: p.write_text("[1, 2]"), "a JSON list"),
    "meta.json without vocab_size": ("meta.json", no_key("vocab_size"), "vocab_size None"),
    "meta.json vocab_size a string": ("meta.json", other_meta(vocab_size="54"), "'54'"),
    "meta.json without itos": ("meta.json", no_key("itos"), "no itos"),
    "meta.json another tokenizer": ("meta.json", other_meta(tokenizer="sentencepiece"),
                                    "'sentencepiece'"),
    "train.bin id outside the vocabulary": ("train.bin", id_out_of_vocabulary, "holds id 60000"),
}


@pytest.mark.parametrize("case", BROKEN)
def test_a_broken_data_folder_is_one_line_naming_the_file_and_the_command(data_root, tmp_path,
                                                                            case):
    name, breaks, says = BROKEN[case]
    root = own_data(data_root, tmp_path)
    breaks(root / "tiny" / name)
    out = tmp_path / "out"
    refused(TINY + ["--data-root", str(root), "--out-dir", str(out), "--max-iters", "2"],
            str(root / "tiny" / name), says,
            f"`python data/prepare.py --input FILE --name tiny --out-root {root}`")
    assert not list_checkpoints(out) and not (out / "metrics.jsonl").exists()


def test_data_files_that_are_not_files_are_one_line_before_any_is_opened(data_root, tmp_path):
    """A FIFO, a folder or a dangling symlink where meta.json, train.bin or val.bin belongs: one
    line naming it and the command that writes it again, before it is opened. A FIFO meta.json
    held the run in open() for ever; a folder train.bin was a traceback from np.memmap; a FIFO
    val.bin of a built-in data set was taken for a missing one and prepared over."""
    from test_robust import ODD, refused_in_time
    cases = [("meta.json", "a FIFO"), ("train.bin", "a folder"), ("val.bin", "a FIFO"),
             ("train.bin", "a dangling symlink")]
    for i, (name, kind) in enumerate(cases):
        root = own_data(data_root, tmp_path / str(i))
        os.remove(root / "tiny" / name)
        ODD[kind](root / "tiny" / name)
        line = refused_in_time(TINY + ["--data-root", str(root), "--out-dir",
                                       str(tmp_path / str(i) / "out"), "--max-iters", "1"],
                               tmp_path / f"err-{i}")
        assert f"{root / 'tiny' / name} is {kind}, not a file: rebuild it with" in line, line
        assert not os.path.exists(tmp_path / str(i) / "out")  # a refused run leaves none
    root = tmp_path / "built-in" / "data"  # a built-in data set: not prepared over it
    (root / "shakespeare_char").mkdir(parents=True)
    os.mkfifo(root / "shakespeare_char" / "val.bin")
    line = refused_in_time(TINY[:-2] + ["--data-root", str(root), "--out-dir",
                                        str(tmp_path / "built-in" / "out"), "--max-iters", "1"],
                           tmp_path / "err-built-in")
    assert "val.bin is a FIFO, not a file: rebuild it with `python data/prepare.py --dataset " \
           "shakespeare_char" in line, line
    assert os.listdir(root / "shakespeare_char") == ["val.bin"]


def test_a_broken_folder_refuses_a_resume_and_changes_nothing_in_the_run(data_root, tmp_path):
    root, out = own_data(data_root, tmp_path), tmp_path / "out"
    main(TINY + ["--data-root", str(root), "--out-dir", str(out), "--max-iters", "2"])
    before = snapshot(out)
    (root / "tiny" / "meta.json").write_text("[]")
    refused(TINY + ["--data-root", str(root), "--out-dir", str(out), "--max-iters", "4",
                    "--resume"], "meta.json holds a JSON list")
    assert snapshot(out) == before


def test_a_built_in_data_set_names_its_own_command(tmp_path):
    root = tmp_path / "data"
    (root / "shakespeare_char").mkdir(parents=True)
    (root / "shakespeare_char" / "val.bin").write_bytes(b"\0\0" * 10)  # prepared, it seems
    refused(TINY[:-2] + ["--data-root", str(root), "--out-dir", str(tmp_path / "out")],
            "meta.json", f"`python data/prepare.py --dataset shakespeare_char --out-root {root}`")


def test_the_line_is_printed_as_every_user_error_is(data_root, tmp_path):
    # before: UserError as a traceback, the right words printed as a crash
    root = own_data(data_root, tmp_path)
    os.remove(root / "tiny" / "meta.json")
    r = subprocess.run([sys.executable, "train.py", *TINY, "--data-root", str(root),
                        "--out-dir", str(tmp_path / "out"), "--max-iters", "1"],
                       cwd=ROOT, capture_output=True, text=True, timeout=120,
                       env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert r.stderr.strip().count("\n") == 0, r.stderr
    assert r.stderr.startswith(f"train.py: error: no {root / 'tiny' / 'meta.json'}: rebuild it")


def _each_rank_its_data(main, argv):
    """In a forked rank: its own data root (nodes that share no disk), the one line of a
    refusal written beside it."""
    base, rank = argv[-1], os.environ["RANK"]
    os.environ["LOCAL_RANK"] = "0"
    try:
        main(argv[:-1] + ["--data-root", os.path.join(base, f"node{rank}")])
    except Exception as e:
        with open(os.path.join(base, f"error-{rank}.txt"), "w") as f:
            f.write(f"{type(e).__name__}: {e}")
        import torch.distributed as dist
        if dist.is_initialized():
            dist.destroy_process_group()


def test_every_rank_refuses_what_one_rank_reads(data_root, tmp_path):
    """Rank 1 alone has broken, then changed, data: every rank stops with rank 1's line (none
    waits in a collective)."""
    for r in (0, 1):
        shutil.copytree(os.path.join(data_root, "tiny"), tmp_path / f"node{r}" / "tiny")
    args = TINY + ["--out-dir", str(tmp_path / "out"), "--max-iters"]
    (tmp_path / "node1" / "tiny" / "val.bin").write_bytes(b"\0\0\0")
    run_train(args + ["2", str(tmp_path)], 2, wrap=_each_rank_its_data)
    lines = [(tmp_path / f"error-{r}.txt").read_text() for r in (0, 1)]
    assert lines[0] == lines[1] and lines[0].startswith("UserError: rank 1 of 2: "), lines
    assert "node1/tiny/val.bin has 3 bytes, an odd number" in lines[0]
    for r in (0, 1):
        os.remove(tmp_path / f"error-{r}.txt")

    shutil.copy(tmp_path / "node0" / "tiny" / "val.bin", tmp_path / "node1" / "tiny" / "val.bin")
    run_train(args + ["2", str(tmp_path)], 2, wrap=_each_rank_its_data)
    assert not (tmp_path / "error-0.txt").exists() and list_checkpoints(tmp_path / "out")
    val = tmp_path / "node1" / "tiny" / "val.bin"
    val.write_bytes(val.read_bytes()[2:] + val.read_bytes()[:2])  # the same size, other bytes
    run_train(args + ["4", "--resume", str(tmp_path)], 2, wrap=_each_rank_its_data)
    lines = [(tmp_path / f"error-{r}.txt").read_text() for r in (0, 1)]
    assert lines[0] == lines[1] and lines[0].startswith("UserError: --resume: rank 1 of 2: "
                                                        "the data changed"), lines
    assert "val.bin has other bytes of the same size" in lines[0]


# ----------------------------------------------------------------------------------------------
# 1. a resume on changed data: one line, or --accept-new-data and a row in metrics.jsonl

def test_a_resume_on_data_prepared_again_is_one_line_or_accepted_and_logged(data_root,
                                                                                tmp_path):
    root, out = own_data(data_root, tmp_path), tmp_path / "out"
    args = TINY + ["--data-root", str(root), "--out-dir", str(out)]
    main(args + ["--max-iters", "2"])
    before = snapshot(out)
    # the data set prepared again under its name, from another text of the same characters
    text = (TEXT * 100)[:40000]
    (tmp_path / "input.txt").write_text(text[::-1])
    prepare(input_path=str(tmp_path / "input.txt"), name="tiny", out_root=str(root))
    refused(args + ["--max-iters", "4", "--resume"], "--resume: the data changed since",
            "ckpt-0000002", "train.bin has other bytes of the same size (sha256 ",
            "val.bin", "--accept-new-data")
    assert snapshot(out) == before
    main(args + ["--max-iters", "4", "--resume", "--accept-new-data"])
    new = [r for r in rows(out) if r.get("event") == "new_data"]
    assert len(new) == 1 and new[0]["iter"] == 2 and "train.bin" in new[0]["change"]
    with open(root / "tiny" / "train.bin", "rb") as f:
        import hashlib
        assert new[0]["data"]["train.bin"]["sha256"] == hashlib.sha256(f.read()).hexdigest()
    # the new checkpoint holds the data it now trains on: a resume on it is quiet again
    main(args + ["--max-iters", "6", "--resume"])
    assert len([r for r in rows(out) if r.get("event") == "new_data"]) == 1


def test_a_resume_on_a_shorter_consistent_train_bin_is_one_line(data_root, tmp_path):
    # train.bin cut to half its tokens, meta.json's count mended to match: only the
    # checkpoint's identity can tell
    root, out = own_data(data_root, tmp_path), tmp_path / "out"
    args = TINY + ["--data-root", str(root), "--out-dir", str(out)]
    main(args + ["--max-iters", "2"])
    cut(36000)(root / "tiny" / "train.bin")
    other_meta(train_tokens=18000)(root / "tiny" / "meta.json")
    refused(args + ["--max-iters", "4", "--resume"], "train.bin 72,000 -> 36,000 bytes")


def test_an_edited_input_file_is_noticed_on_resume(data_root, tmp_path):
    # train.py prepares --input every run: the edited text becomes another train.bin
    notes, out = tmp_path / "notes.txt", tmp_path / "out"
    notes.write_text((TEXT * 30)[:12000])
    args = TINY[:-2] + ["--data-root", str(tmp_path / "data"), "--input", str(notes),
                        "--out-dir", str(out)]
    main(args + ["--max-iters", "2"])
    main(args + ["--max-iters", "3", "--resume"])  # the same text: the same bytes, resumed
    notes.write_text((TEXT * 30)[:12000].replace("question", "noitseuq"))
    refused(args + ["--max-iters", "4", "--resume"], "the data changed", "train.bin")


def test_a_checkpoint_from_before_data_identities_resumes_as_before(data_root, tmp_path,
                                                                     monkeypatch):
    from machinery import checked_ckpt
    save = checked_ckpt.save

    def save_as_before(out_dir, it, zero, model, scaler, header, *args):
        return save(out_dir, it, zero, model, scaler,
                    {k: v for k, v in header.items() if k != "data"}, *args)
    root, out = own_data(data_root, tmp_path), tmp_path / "out"
    args = TINY + ["--data-root", str(root), "--out-dir", str(out)]
    with monkeypatch.context() as m:
        m.setattr(checked_ckpt, "save", save_as_before)
        main(args + ["--max-iters", "2"])
    (tmp_path / "input.txt").write_text((TEXT * 100)[:40000][::-1])
    prepare(input_path=str(tmp_path / "input.txt"), name="tiny", out_root=str(root))
    main(args + ["--max-iters", "4", "--resume"])  # nothing to compare: no error, as today
    assert [r["iter"] for r in rows(out) if r.get("event") == "resume"] == [2]
    assert not [r for r in rows(out) if r.get("event") == "new_data"]


def test_the_saved_identity_is_read_as_data_from_disk():
    from data.loader import changed_data
    now = {"vocab": "char:ab", "train.bin": {"bytes": 8, "sha256": "f" * 64},
           "val.bin": {"bytes": 4, "sha256": "e" * 64}}
    assert changed_data(None, now, "ckpt", 1) is None  # from before identities: no compare
    assert changed_data(dict(now), now, "ckpt", 1) is None
    odd = {"vocab": "char:ab", "train.bin": {"bytes": "8"}, "val.bin": [4]}
    assert changed_data(odd, now, "ckpt", 1) == ("the data changed since ckpt was saved: "
                                                 "train.bin ? -> 8 bytes; val.bin ? -> 4 bytes")
    assert "a list, not a dict" in changed_data([], now, "ckpt", 1)
    other = dict(now, vocab="char:ba", **{"val.bin": {"bytes": 4, "sha256": "d" * 64}})
    assert changed_data(other, now, "ckpt", 1) == (
        "the data changed since ckpt was saved: vocabulary char:ba -> char:ab; val.bin has "
        "other bytes of the same size (sha256 dddddddddddd... -> eeeeeeeeeeee...)")


# ----------------------------------------------------------------------------------------------
# what already held, and holds

def test_too_few_tokens_for_the_block_is_one_line_at_exactly_the_boundary(tmp_path):
    (tmp_path / "short.txt").write_text((TEXT * 2)[:200])  # 180 train, 20 val tokens
    prepare(input_path=str(tmp_path / "short.txt"), name="tiny", out_root=str(tmp_path))
    args = TINY + ["--data-root", str(tmp_path), "--max-iters", "1"]
    refused(args + ["--block-size", "19", "--out-dir", str(tmp_path / "a")],
            "too few tokens for --block-size 19")
    main(args + ["--block-size", "18", "--out-dir", str(tmp_path / "b")])  # 20 > 18 + 1


@needs_gpt2_bpe
def test_a_tokenizer_changed_under_the_data_sets_name_is_one_line(data_root, tmp_path):
    root, out = own_data(data_root, tmp_path), tmp_path / "out"
    args = TINY + ["--data-root", str(root), "--out-dir", str(out)]
    main(args + ["--max-iters", "1"])
    (tmp_path / "input.txt").write_text((TEXT * 100)[:40000])
    prepare(input_path=str(tmp_path / "input.txt"), tokenizer="gpt2", name="tiny",
            out_root=str(root))
    refused(args + ["--max-iters", "2", "--resume"], "is for another model",
            "vocab_size 54 vs 50257", error=UserError)
