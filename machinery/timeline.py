"""The collective log of a traced run (collectives.Recorder's events) written as JSON lines,
and read back into per-step numbers: exposed communication -- the host time spent inside a
collective's wait(), compute that had nothing left to do -- and the overlap fraction, the share
of each collective's launched-to-landed time that compute hid.

On gloo a collective runs on the host beside the compute, so these are host times; on CUDA
the wait is a stream wait and the host times bound the exposure from above (the profiler's
trace, written beside the log, holds the device's own)."""
import json


def write(events, path, rank):
    with open(path, "a") as f:
        for e in events:
            f.write(json.dumps(dict(e, rank=rank)) + "\n")


def read(path):
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def max_in_flight(collectives):
    """The most collectives launched and not yet waited for at any launch."""
    most = 0
    for e in collectives:
        alive = [o for o in collectives if o["launch"] <= e["launch"] and
                 (o["wait"] is None or o["wait"] > e["launch"])]
        most = max(most, len(alive))
    return most


def per_step(events):
    """{step: dict(exposed_s, comm_s, overlap)} over the collectives that were waited for."""
    out = {}
    for e in events:
        if e.get("kind") != "collective" or e.get("done") is None:
            continue
        s = out.setdefault(e["step"], dict(exposed_s=0.0, comm_s=0.0))
        s["exposed_s"] += e["done"] - e["wait"]
        s["comm_s"] += e["done"] - e["launch"]
    for s in out.values():
        s["overlap"] = 1 - s["exposed_s"] / s["comm_s"] if s["comm_s"] > 0 else 0.0
    return out
