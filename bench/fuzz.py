"""
A random-flag fuzzer of every entry point: train.py, sample.py, memory.py and export.py with
flags drawn from valid and hostile values, and odd files dropped into run folders. Every case
must end in exit 0 or in one line on stderr (exit 2): never a traceback, a hang, a half-written
folder or a changed file.

    python -m bench.fuzz                      # --cases 200 --seed 0 --timeout 120 --mem-gb 3

Each case runs its script as the command does (the script run as __main__) in a process forked
from a server that imported torch and the project once, so a case starts in well under a
second; about one train.py case in ten runs under torchrun on 2 gloo ranks instead. Every case's
memory is capped (--mem-gb): a size nothing checked fails at once instead of swapping the
machine. The cap is RLIMIT_DATA (the private writable memory a process maps: its heap, its
tensors), not RLIMIT_AS (all its address space): a CUDA build of torch maps gigabytes of
libraries, and a CUDA context reserves ~10 GB of address space it never writes (pytorch#23441),
so an address-space cap fails every case on a GPU machine. Linux counts mappings under
RLIMIT_DATA since 4.7.

A case is bad when it prints a Python traceback, exits with anything but 0 or 2, refuses in
more than one line, outlives --timeout, leaves a folder it created behind after a
refusal, leaves a lock or a .tmp save behind, or changes a file it must not: a checkpoint's
bytes (rotation may delete one), metrics.jsonl other than by appending to it, or anything at
all in a folder that sample.py, memory.py or export.py only read.
"""
import multiprocessing
import os
import random
import re
import resource
import runpy
import shutil
import subprocess
import sys
import tempfile
import time
import traceback

if __package__ in (None, ""):  # run as a script: import from the repository root
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SMALL = ["--device", "cpu", "--dataset", "fuzz", "--n-layer", "1", "--n-head", "2", "--n-embd",
         "16", "--block-size", "16", "--batch-size", "2", "--max-iters", "2", "--eval-iters", "1",
         "--eval-interval", "1000", "--log-interval", "1", "--warmup-iters", "1",
         "--lr-decay-iters", "4"]
HOSTILE = ["0", "-1", "nan", "inf", "1e308", "1e-320", str(10**23), "abc", ""]
TOGGLES = ["--resume", "--archive", "--take-over-lock", "--lora", "--double-quant", "--fp8",
           "--bf16", "--fp16", "--no-chunked-loss"]
TRAIN = {"--zero": ["0", "1", "2", "3", "4"], "--batch-size": ["1", "3", "100000", "10**9"],
         "--n-layer": ["1", "2", "100000"], "--n-embd": ["16", "24", "30", "1000000"],
         "--n-head": ["1", "2", "3"], "--block-size": ["8", "16", "100000"],
         "--max-iters": ["1", "3"], "--learning-rate": ["1e-3", "1e4", "-1"],
         "--bucket-mb": ["0.001", "25", "1e308"], "--loss-scale": ["dynamic", "none", "1e-320",
                                                                    "1e300", "1024", "x"],
         "--min-loss-scale": ["1", "0.5", "1e-300", "1e39"],
         "--dtype": ["fp32", "bf16", "fp16", "fp8"],
         "--grad-ckpt": ["none", "full", "selective"], "--grad-ckpt-every": ["1", "2", "0"],
         "--quantize": ["", "nf4", "int8", "fp4"], "--lora-rank": ["1", "4", "100000"],
         "--lora-targets": ["q,v", "all", "z"], "--ckpt-format": ["consolidated", "sharded", "zip"],
         "--keep-last": ["1", "2", "0"], "--save-interval": ["0", "1", "2"],
         "--grad-accum": ["1", "2", "0"], "--batch-tokens": ["0", "64", "65"],
         "--warmup-iters": ["0", "3"], "--lr-decay-iters": ["1", "9"],
         "--dropout": ["0", "0.1", "1"], "--zeropp": ["qwz", "hpz,qgz", "bogus"],
         "--optimizer": ["adamw", "sgd", "lion", "adam"], "--seed": ["0", "5", "-5"],
         "--eval-iters": ["1", "2", "0"], "--fp8-scaling": ["dynamic", "delayed"],
         "--node-size": ["0", "1", "3"], "--nan-at": ["-1", "0"],
         "--config": ["config/no-such-preset", "no-such-preset"]}
SAMPLE = {"--num-samples": ["1", "2", "100000000", "0"], "--max-new-tokens": ["3", "0", "10**11"],
          "--temperature": ["0.8", "0", "1e-4", "1e-300"], "--top-k": ["0", "5", "-1"],
          "--seed": ["1", "7", "-1", str(10**23)],
          "--start": ["\n", "To be", "", "zzz~", "FILE:nowhere"],
          "--dtype": ["fp32", "bf16", "fp8"], "--device": ["cpu", "auto", "cuda"]}
MEMORY = {"--params": ["1e9", "1e12", "1e15", "0"], "--world-size": ["1", "8", "0", "10**9"],
          "--vocab": ["65", "50257", "0", "10**9"],
          "--gpu-mem": ["80GB", "24GiB", "0", "1e400GB", "x"],
          "--host-mem": ["256GB", "1TB", "-1GB"], "--n-layer": ["2", "12", "100000"],
          "--n-embd": ["64", "768", "1000000"], "--n-head": ["2", "4", "5"],
          "--block-size": ["64", "1024", "10**9"],
          "--batch-size": ["1", "4096", "0"], "--zero": ["0", "2", "3"],
          "--dtype": ["fp32", "bf16", "fp16"], "--grad-ckpt": ["none", "full", "selective"],
          "--quantize": ["", "nf4", "int8"], "--advise": None, "--lora": None, "--fp8": None}
EXPORT_TO = ["hf", "safetensors", "bogus"]


def value(pool, clean):
    """A value from a flag's pool, whose first two are valid: clean, one of those; else any,
    sometimes a hostile value of any flag."""
    if clean:
        v = random.choice(pool[:2])
    else:
        v = random.choice(HOSTILE) if random.random() < 0.15 else random.choice(pool)
    return str(10 ** int(v[4:])) if v.startswith("10**") else v  # 10**9 written out


def draw(flags, k, clean=False):
    """k flags of a table, each with a value (or alone: a toggle)."""
    out = []
    for flag in random.sample(sorted(flags), k):
        out += [flag] if flags[flag] is None else [flag, value(flags[flag], clean)]
    return out


# ----------------------------------------------------------------------------------------------
# odd files in a run folder

def _flip(path):
    data = bytearray(open(path, "rb").read())
    data[len(data) // 2] ^= 0xFF
    open(path, "wb").write(bytes(data))


def _replace_with_folder(path):
    if os.path.isdir(path):
        shutil.rmtree(path)
    elif os.path.exists(path):
        os.remove(path)
    os.makedirs(path)


def _write(text):
    def write(path):
        if os.path.isdir(path):
            shutil.rmtree(path)
        os.makedirs(os.path.dirname(path), exist_ok=True)  # adapter/'s file in a plain run
        with open(path, "w") as f:
            f.write(text)
    return write


ODD = {  # what may be found in a run folder: (the file, what is done to it)
    "metrics row of iter null": ("metrics.jsonl", lambda p: open(p, "a").write(
        '{"iter": null, "loss": 1}\n{"iter": "4"}\n[1]\n')),
    "metrics cut short": ("metrics.jsonl", lambda p: open(p, "a").write('{"iter": 9, "lo')),
    "metrics binary": ("metrics.jsonl", _write("\x00\xff garbage")),
    "metrics a folder": ("metrics.jsonl", _replace_with_folder),
    "lock a list": ("lock", _write("[1, 2]")), "lock a number": ("lock", _write("7")),
    "lock garbage": ("lock", _write("\x00{")), "lock empty": ("lock", _write("")),
    "lock another host": ("lock", _write('{"pid": 1, "host": "elsewhere"}')),
    "lock a dead pid": ("lock", _write('{"pid": 4194000, "host": "%s"}' % os.uname()[1])),
    "lock a folder": ("lock", _replace_with_folder),
    "checkpoint a file": ("ckpt-0000009", _write("x")),
    "empty checkpoint": ("ckpt-0000009", os.makedirs),
    "stale save": ("ckpt-0000009.tmp", os.makedirs),
    "stale save a file": ("ckpt-0000009.tmp", _write("x")),
    "header flipped": ("HEADER", _flip), "header gone": ("HEADER", os.remove),
    "header a folder": ("HEADER", _replace_with_folder),
    "header truncated": ("HEADER", lambda p: os.truncate(p, 100)),
    "shard flipped": ("SHARD", _flip), "shard gone": ("SHARD", os.remove),
    "adapter garbage": ("adapter/adapter_model.safetensors", _write("garbage")),
    "adapter a file": ("adapter", _write("x")),
    "archive-1 a file": ("archive-1", _write("x")),
}


def make_odd(folder, kind):
    """Do ODD[kind] to the folder: HEADER is the newest checkpoint's checkpoint.json, SHARD its
    first shard."""
    name, edit = ODD[kind]
    newest = os.path.join(folder, sorted(n for n in os.listdir(folder)
                                         if n.startswith("ckpt-") and "." not in n)[-1])
    where = {"HEADER": "checkpoint.json", "SHARD": "shard-00000.safetensors"}
    edit(os.path.join(newest, where[name]) if name in where else os.path.join(folder, name))


# ----------------------------------------------------------------------------------------------
# one case

def cap_memory(mem_bytes):
    """Cap this process's private writable memory (RLIMIT_DATA): what it allocates, not the
    address space it reserves or the libraries it maps (see the docstring)."""
    resource.setrlimit(resource.RLIMIT_DATA, (mem_bytes, mem_bytes))


def _run_script(script, argv, out, err, mem_bytes):
    """The forked process: the script as `python SCRIPT ARGV` runs it, its output into files."""
    for fd, path in ((1, out), (2, err)):
        f = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        os.dup2(f, fd)
        os.close(f)
    cap_memory(mem_bytes)
    os.chdir(ROOT)
    sys.argv = [script] + argv
    code = 0
    try:
        runpy.run_path(os.path.join(ROOT, script), run_name="__main__")
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def run_case(ctx, script, argv, work, timeout, mem_bytes, nproc=1):
    """(exit code or None for a hang, stderr): the script in a forked process, or under
    torchrun on nproc gloo ranks."""
    out, err = os.path.join(work, "stdout"), os.path.join(work, "stderr")
    if nproc > 1:
        limit = lambda: cap_memory(mem_bytes)
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc_per_node={nproc}", script] + argv
        with open(out, "w") as o, open(err, "w") as e:
            p = subprocess.Popen(cmd, cwd=ROOT, stdout=o, stderr=e, preexec_fn=limit,
                                 start_new_session=True, env=dict(os.environ, OMP_NUM_THREADS="1"))
            try:
                rc = p.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, 9)
                p.wait()
                rc = None
        return rc, open(err, errors="replace").read()
    p = ctx.Process(target=_run_script, args=(script, argv, out, err, mem_bytes))
    p.start()
    p.join(timeout)
    if p.is_alive():
        p.kill()
        p.join()
        return None, open(err, errors="replace").read()
    return p.exitcode, open(err, errors="replace").read()


LOCKED = "\0lock"  # a snapshot's key: whether OUT_DIR/lock was there, a file or a folder


def snapshot(folder):
    """{relative path: bytes} of every file under folder ({} when there is none), and LOCKED."""
    files = {LOCKED: os.path.lexists(os.path.join(folder, "lock"))} if os.path.isdir(folder) else {}
    for d, _, names in os.walk(folder):
        for n in names:
            path = os.path.join(d, n)
            if os.path.isfile(path):
                files[os.path.relpath(path, folder)] = open(path, "rb").read()
    return files


def verdict(script, rc, err, nproc, before, folder, existed, read_only):
    """None for a good case, else what went wrong."""
    lines = [line for line in err.splitlines() if line.strip()]
    ours = f"{script}: error:"
    if rc is None:
        return "hang"
    ours_traced = re.search(r'File "%s/(?!\.venv)' % re.escape(ROOT), err)  # not torchrun's
    if "Traceback" in err and (nproc == 1 or ours_traced):
        return "traceback: " + next((ln for ln in reversed(lines) if ln.strip()), "")[:160]
    if nproc > 1 and rc != 0:  # torchrun's own report follows; a rank_local error: each rank's
        if not 1 <= sum(line.startswith(ours) for line in lines) <= nproc:
            return f"exit {rc} without one {ours} line"
    elif rc not in (0, 2):
        return f"exit {rc}"
    elif rc == 2 and (len(lines) != 1 or not lines[0].startswith(ours)):
        return f"a refusal of {len(lines)} lines: {lines[:2]}"
    if folder is None:
        return None
    if not existed:
        if rc != 0 and os.path.exists(folder):
            return "a refused run left the folder it created"
        return None
    after = snapshot(folder)
    if os.path.exists(os.path.join(folder, "lock")) and not before.get(LOCKED):
        return "a lock left behind"
    if any(n.endswith(".tmp") or ".tmp" in n.split(os.sep)[0] for n in after
           if n.split(os.sep)[0] not in {p.split(os.sep)[0] for p in before}):
        return "a .tmp save left behind"
    for name, data in before.items():
        now = after.get(name)
        if name == LOCKED or now != data and _archived(name, data, after):
            continue  # --archive moved the earlier run aside, whole
        if read_only or rc != 0 and not _trained(after, before):
            if now != data:
                return f"{name} changed" if now is not None else f"{name} deleted"
        elif name.endswith("metrics.jsonl") and now is not None and not now.startswith(data):
            return f"{name} rewritten, not appended to"
        elif name.split(os.sep)[0].startswith("ckpt-") and now is not None and now != data:
            return f"{name} changed in place"
    return None


def _archived(name, data, after):
    """Whether a file of the earlier run is in an archive-N/ folder, as it was."""
    return any(k.split(os.sep, 1)[0].startswith("archive-") and k.split(os.sep, 1)[1] == name
               and v == data for k, v in after.items() if os.sep in k)


def _trained(after, before):
    """Whether a run logged steps: metrics.jsonl grew by a row with a loss."""
    new = after.get("metrics.jsonl", b"")[len(before.get("metrics.jsonl", b"")):]
    return b'"loss"' in new


# ----------------------------------------------------------------------------------------------
# the runs the cases start from

def prepare(tmp, ctx, timeout, mem_bytes):
    """A small character data set and two finished runs to copy: plain (consolidated, 2
    checkpoints) and LoRA (sharded, with its adapter)."""
    from data.prepare import prepare as prepare_data
    text = open(os.path.join(ROOT, "data", "tinyshakespeare.txt"), encoding="utf-8").read()
    with open(os.path.join(tmp, "fuzz.txt"), "w", encoding="utf-8") as f:
        f.write(text[:30000])
    prepare_data(input_path=os.path.join(tmp, "fuzz.txt"), name="fuzz",
                 out_root=os.path.join(tmp, "data"))
    runs = {"plain": ["--save-interval", "1"],
            "lora": ["--lora", "--ckpt-format", "sharded", "--save-interval", "1"]}
    for name, flags in runs.items():
        argv = SMALL + ["--data-root", os.path.join(tmp, "data"), "--out-dir",
                        os.path.join(tmp, name)] + flags
        rc, err = run_case(ctx, "train.py", argv, tmp, timeout, mem_bytes)
        assert rc == 0, err[-2000:]
    return os.path.join(tmp, "data")


def make_case(i, tmp, data_root):
    """(script, argv, the run folder the case uses or None, whether it existed, whether the
    case only reads it, nproc, the odd file dropped into the folder or None)."""
    script = random.choices(["train.py", "sample.py", "memory.py", "export.py"],
                            weights=[6, 2, 2, 2])[0]
    clean = random.random() < 0.4  # valid values only: the paths that run, not only refusals
    case = os.path.join(tmp, f"case-{i}")
    base = random.choice(["plain", "lora"])
    if script == "memory.py":
        return script, draw(MEMORY, random.randint(1, 4), clean), None, False, True, 1, None
    folder = os.path.join(case, "run")
    existed, odd = script != "train.py" or random.random() < 0.6, None
    if existed:
        shutil.copytree(os.path.join(tmp, base), folder)
        if random.random() < 0.4 and not clean:
            odd = random.choice(sorted(ODD))
            make_odd(folder, odd)
    newest = lambda: (sorted(n for n in os.listdir(folder) if n.startswith("ckpt-")
                             and "." not in n and os.path.isdir(os.path.join(folder, n)))
                      or ["none"])[-1]
    if script == "train.py":
        argv = SMALL + ["--data-root", data_root, "--out-dir", folder]
        if existed and random.random() < 0.7:
            argv.append("--resume")
        if base == "lora" and existed and "--resume" in argv:
            argv += ["--lora", "--ckpt-format", "sharded"]
        argv += draw(TRAIN, random.randint(0, 3), clean)
        argv += random.sample(TOGGLES, random.randint(0, 1 if clean else 2))
        if random.random() < 0.1:
            argv += ["--init-from", os.path.join(tmp, random.choice(["plain", "lora"]),
                                                 "ckpt-0000002")]
        nproc = 2 if random.random() < 0.1 else 1
        return script, argv, folder, existed, False, nproc, odd
    if script == "sample.py":
        argv = (["--out-dir", folder] if random.random() < 0.7 else
                ["--ckpt", os.path.join(folder, newest())])
        if base == "lora" and random.random() < 0.5:
            argv += ["--adapter", os.path.join(folder, "adapter")]
        argv += draw(SAMPLE, random.randint(0, 3), clean)
        if "--max-new-tokens" not in argv:
            argv += ["--max-new-tokens", "3"]
        return script, argv, folder, True, True, 1, odd
    out = os.path.join(case, random.choice(["out", "out.safetensors", "run", "run/x/y"]))
    argv = [os.path.join(folder, newest()), "--to", random.choice(EXPORT_TO), out]
    argv += random.sample(["--merge", "--dtype bf16", "--dtype fp8"], random.randint(0, 1))
    return script, " ".join(argv).split(" "), folder, True, True, 1, odd


def fuzz(cases, seed, timeout=120, mem_gb=3.0, log=print, torchrun=True):
    """Run the cases; returns ({script: [tried, exit 0, refused in one line, bad]}, [bad]);
    counts["kinds"] says how many ran under torchrun and how many had an odd file.
    torchrun=False keeps every case in a forked process (the test suite's slice)."""
    random.seed(seed)
    ctx = multiprocessing.get_context("forkserver")
    counts, bad, mem_bytes = {}, [], int(mem_gb * 2**30)
    kinds = {"torchrun": 0, "odd": 0}  # cases on 2 ranks, cases with an odd file
    tmp = tempfile.mkdtemp(prefix="fuzz-")
    try:
        data_root = prepare(tmp, ctx, timeout, mem_bytes)
        for i in range(cases):
            script, argv, folder, existed, read_only, nproc, odd = make_case(i, tmp, data_root)
            nproc = nproc if torchrun else 1
            kinds["torchrun"] += nproc > 1
            kinds["odd"] += odd is not None
            work = os.path.join(tmp, f"case-{i}")
            os.makedirs(work, exist_ok=True)
            before = snapshot(folder) if folder and existed else {}
            out = argv[3] if script == "export.py" and len(argv) > 3 else None
            out_existed = out is not None and os.path.exists(out)
            rc, err = run_case(ctx, script, argv, work, timeout, mem_bytes, nproc)
            why = verdict(script, rc, err, nproc, before, folder, existed, read_only)
            if why is None and out and not out_existed and rc != 0 and os.path.exists(out):
                why = f"a refused export left {out}"
            row = counts.setdefault(script, [0, 0, 0, 0])
            row[0] += 1
            row[1 if why is None and rc == 0 else 2 if why is None else 3] += 1
            if why:
                bad.append((script, nproc, argv, why))
                log(f"BAD {script} x{nproc} {' '.join(argv)}\n    {why}")
            shutil.rmtree(work, ignore_errors=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    counts["kinds"] = kinds
    return counts, bad


def main(argv=None):
    from bench.common import Stopwatch, command, machine, parser, table, write_section
    p = parser("fuzz", __doc__, writes=False)
    p.add_argument("--cases", type=int, default=200)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=120, help="seconds a case may take")
    p.add_argument("--mem-gb", type=float, default=3.0, help="each case's memory (RLIMIT_DATA)")
    p.add_argument("--no-write", action="store_true", help="print only, leave BENCHMARKS.md alone")
    args = p.parse_args(argv)
    if args.cases < 1 or not args.timeout > 0 or not args.mem_gb > 0:
        p.error("--cases, --timeout and --mem-gb must be positive")
    watch = Stopwatch()
    multiprocessing.set_forkserver_preload(["torch", "numpy", "train", "sample", "memory",
                                            "export"])
    counts, bad = fuzz(args.cases, args.seed, args.timeout, args.mem_gb)
    kinds = counts.pop("kinds")
    rows = [[s, *counts[s]] for s in sorted(counts)]
    rows.append(["all", *(sum(r[i] for r in rows) for i in range(1, 5))])
    body = table(["entry point", "cases", "exit 0", "refused in one line", "bad"], rows)
    numbers = (f"Seed {args.seed}, timeout {args.timeout:g} s, {args.mem_gb:g} GB per case; "
               f"{kinds['torchrun']} train.py cases on 2 ranks under torchrun, {kinds['odd']} "
               "with an odd file in the run folder. " +
               ("No case gave a traceback, a hang, a half-written folder or a changed file."
                if not bad else f"{len(bad)} bad: " + "; ".join(
                    f"{s} {' '.join(a)[-120:]} -> {w}" for s, _, a, w in bad[:5])))
    wall, other = watch.read()  # a check of behaviour: the time is not a measurement
    busy = "" if other is None else f", other processes using {other:.0%} of the CPUs"
    text = (f"`{command('fuzz', argv)}` on {machine()}, {time.strftime('%Y-%m-%d')}, "
            f"{wall:.0f} s{busy}\n\n{body}\n\n{numbers}")
    print(f"[fuzz]\n{text}\n", flush=True)
    if not args.no_write:
        write_section("fuzz", text, heading="Fuzzing every entry point")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
