"""
ZeRO++: ZeRO-3 with quantized weight gathers, a node-local second shard and quantized gradients.

Wang et al. 2023, "ZeRO++: Extremely Efficient Collective Communication for Giant Model
Training", arXiv 2306.10209, Sec. 3. On a cluster nearly all of ZeRO-3's 3Ψ a step crosses the
slow links between nodes. ZeRO++ changes three steps of zero3.py's lifecycle, each one a flag
(--zeropp qwz,hpz,qgz, any subset), and leaves (1), (3), (4) and (7) as they are:

  (2) gather          qwZ (Sec. 3.1): each rank quantizes its 16-bit shard in blocks of
                      QWZ_BLOCK (symmetric int8, an fp32 scale per block), the all-gather moves
                      the codes and the scales, every rank dequantizes into the full buffer.
                      Half the forward bytes. The fp32 master and the update are untouched.
  (5) re-gather       hpZ (Sec. 3.2): after the forward gather each rank keeps a second shard,
                      1/k of the full 16-bit weights (k ranks per node); backward re-gathers
                      inside the node only. No backward byte crosses nodes; 2Ψ/k more memory.
                      Without hpZ, qwZ re-gathers the same codes (the shard has not changed:
                      quantizing it again gives bitwise the same codes), so backward sees
                      exactly the weights the forward used, as it does with hpZ.
  (6) reduce-scatter  qgZ (Sec. 3.3): two all-to-alls of blockwise-quantized gradients (int4,
                      or --qgz-bits 8), inside the node first, then across nodes on the
                      node's partial sums, each dequantized and summed in fp32.

Overlapped as zero3.py's collectives are: qgZ's first hop is launched from the gradient hook
and returns at once; its second hop when the next bucket is launched (the first has had a
bucket's backward to land), and the bucket lands where stage 3 lands a reduce-scatter, at most
MAX_IN_FLIGHT in flight. hpZ's re-gather runs on the node's own group, or on one node on the
gather group: not queued behind the reduce-scatters of the default group's stream.

The error of one code (quant.absmax_quantize): |x - x'| <= absmax(block) / (2 qmax), qmax 127
(int8) or 7 (int4). One qwZ gather: that, plus the rounding of x' to the working dtype. One
qgZ reduction of k ranks' gradients on n nodes: at most the sum of that bound over the k codes
of hop 1 and the n codes of hop 2 (tests/test_zeropp.py checks both).

A frozen bucket of quant.py's buffers (a QLoRA base: uint8 codes, fp32 scales) is already 4-bit
and is gathered as it is; qwZ quantizes only buckets of parameters of the working dtype.
The second shard lives from a unit's forward to the end of backward (or the next publish):
checkpoints see only the primary shards, so runs resume across ZeRO-3 and ZeRO++ alike.
"""
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

import collectives
from collectives import Traffic, all_gather_params
from configurator import ZEROPP_PARTS as PARTS, parse_zeropp
from quant import absmax_quantize
from zero import MAX_IN_FLIGHT
from zero3 import ZeRO3

QWZ_BLOCK = 256  # weights: an fp32 scale per 256 int8 codes, 1.6% more bytes
QGZ_BLOCK = 64  # gradients: int4 needs smaller blocks; a scale per 64 codes, 0.5 bits more


# ----------------------------------------------------------------------------------------------
# Bytes by link. A collective on a group whose ranks all sit in one node (node_size consecutive
# ranks) counts as intra-node, any other as inter-node; node_size 0: one node. ZeROpp counts its
# traffic so, and train.py a plain ZeRO-3 run's (metrics.jsonl: comm_bytes_intra, _inter, comm_by).

@dataclass
class LinkTraffic(Traffic):
    """collectives.Traffic, its bytes split by link, and qgZ's all-to-alls beside the rest."""
    all_to_all: int = 0
    bytes_intra: int = 0  # of `bytes`, on groups inside one node
    bytes_inter: int = 0  # ... and on groups that span nodes
    node_size: int = 0  # ranks per node (0: every rank in one node)
    by: dict = field(default_factory=dict)  # "all_gather/inter" -> bytes, and so on

    @property
    def elements(self):
        return super().elements + self.all_to_all

    def count(self, kind, elements, nbytes, group=None):
        super().count(kind, elements, nbytes, group)
        intra = self.node_size == 0 or len({r // self.node_size for r in _ranks(group)}) == 1
        link = "intra" if intra else "inter"
        setattr(self, "bytes_" + link, getattr(self, "bytes_" + link) + nbytes)
        key = f"{kind}/{link}"
        self.by[key] = self.by.get(key, 0) + nbytes


_group_ranks = {}  # group -> its global ranks, asked once


def _ranks(group):
    group = dist.group.WORLD if group is None else group  # a re-init: a new default group
    if group not in _group_ranks:
        _group_ranks[group] = dist.get_process_group_ranks(group)
    return _group_ranks[group]


def all_to_all(out, inp, traffic, group_size, group=None, label=None):
    """Chunk i of inp (inp.numel() / group_size elements) goes to the group's i-th rank, which
    puts it at chunk [this rank] of its out; an all-to-all moves its n-element input. gloo runs
    it on CPU tensors of any dtype (int8 and uint8 codes included, checked on torch 2.13)."""
    if group_size == 1:
        out.copy_(inp)
        return None
    traffic.count("all_to_all", inp.numel(), inp.numel() * inp.element_size(), group)
    return collectives.launch("all_to_all", label, inp, dist.all_to_all_single, out, inp,
                              group=group)


# ----------------------------------------------------------------------------------------------
# Node groups (ZeRO++'s hierarchy). Ranks r = node * k + local, k ranks per node.
# Every rank must call dist.new_group for every subgroup, in the same order, even for the
# groups it is not in: so all of them are made at once, once per process (each waits the run's
# --collective-timeout from its first collective on: machinery/hangs.py).

_node_groups = {}  # (the default group, world size, k) -> (this rank's node group, cross group)


def node_groups(world_size, node_size, rank):
    """(the group of this rank's node, the group of the ranks with its local rank on every
    node). A group of one rank, or the whole world, is None: nothing to make."""
    key = (dist.group.WORLD, world_size, node_size)
    if key not in _node_groups:
        k, nodes = node_size, world_size // node_size
        mine = [None, None]
        if 1 < k < world_size:
            for m in range(nodes):
                g = dist.new_group(list(range(m * k, (m + 1) * k)))
                mine[0] = g if rank // k == m else mine[0]
            for j in range(k):
                g = dist.new_group(list(range(j, world_size, k)))
                mine[1] = g if rank % k == j else mine[1]
        _node_groups[key] = tuple(mine)
    return _node_groups[key]


# -- blockwise codes, packed with their scales into one int8 row per destination -------------

def pack(x, bits, block):
    """x (rows, L) -> (rows, P) int8: each row's codes (blocks of `block`, int8, or int4 two
    to a byte) followed by its fp32 scales as bytes. One message per row, one collective."""
    rows, L = x.shape
    x = torch.nn.functional.pad(x.float(), (0, -L % block))  # (rows, nblocks * block)
    q, scale = absmax_quantize(x.view(rows, -1, block), 127 if bits == 8 else 7)
    q = q.view(rows, -1)
    if bits == 4:  # -7..7 -> 1..15 in a nibble, two to a byte (sent as int8: the same bytes)
        u = (q + 8).to(torch.uint8)
        q = (u[:, 0::2] << 4 | u[:, 1::2]).view(torch.int8)
    return torch.cat([q, scale.contiguous().view(torch.int8)], dim=1)


def unpack(packed, bits, block, L):
    """pack's inverse: (rows, P) int8 -> (rows, L) fp32, dequantized."""
    rows, nblocks = packed.shape[0], -(-L // block)
    ncodes = nblocks * block * bits // 8
    q, scale = packed[:, :ncodes], packed[:, ncodes:].contiguous().view(torch.float32)
    if bits == 4:
        u = q.view(torch.uint8)
        q = torch.stack([u >> 4, u & 15], dim=-1).view(rows, -1).to(torch.int8) - 8
    x = q.view(rows, nblocks, block).float() * scale[:, :, None]
    return x.view(rows, -1)[:, :L]


class _Landing:
    """A gather's work handle whose wait() also finishes it (dequantize, keep the second
    shard): zero3.py waits for it like any handle."""

    def __init__(self, work, then):
        self.work, self.then = work, then

    def wait(self):
        if self.work is not None:
            self.work.wait()
        self.then()


class _TwoHops:
    """qgZ's reduction of one bucket as a work handle: hop 1 (inside the node) is launched at
    construction, hop 2 (across nodes) by advance() once hop 1 has landed, and wait() lands
    whatever is left into `out`, this rank's slice of the mean (fp32). Every rank calls
    advance() and wait() at the same points, so the all-to-alls keep one order everywhere."""

    def __init__(self, zero, flat, out):
        n, k, self.zero, self.out = zero.nodes, zero.node_size, zero, out
        S = flat.numel() // zero.world_size
        x = flat.float().div_(zero.world_size).view(n, k, S)
        self.hops = []  # (size, group, then) of the hops not launched yet
        if n > 1:  # hop 2: row m to node m, summed into this rank's slice
            self.hops.append((n, zero.cross_group, lambda x: x.sum(0, keepdim=True)))
        if k > 1:  # hop 1: (k, n * S), row j to local rank j, summed: (n, S)
            self.hops.append((k, zero.node_group, lambda x: x.sum(0).reshape(n, S)))
            x = x.transpose(0, 1).reshape(k, n * S)
        else:
            x = x.reshape(n, S)
        self.x, self.flying = x, None
        self._launch()

    def _launch(self):
        """Start the next hop's all-to-all on self.x (codes), or finish if none is left."""
        if not self.hops:
            self.out.copy_(self.x.view(-1))
            return
        size, group, then = self.hops.pop()
        rows = pack(self.x, self.zero.qgz_bits, QGZ_BLOCK)
        received = torch.empty_like(rows)
        work = all_to_all(received, rows, self.zero.traffic, size, group)
        self.flying = (work, rows, received, self.x.shape[1], then)

    def _land(self):
        work, _, received, L, then = self.flying
        if work is not None:
            work.wait()
        self.x, self.flying = then(unpack(received, self.zero.qgz_bits, QGZ_BLOCK, L)), None

    def advance(self):
        """Hop 1 has had a bucket's backward to land: land it, launch hop 2."""
        if self.flying is not None and self.hops:
            self._land()
            self._launch()

    def wait(self):
        while self.flying is not None:
            self._land()
            self._launch()


class ZeROpp(ZeRO3):
    """ZeRO-3 with any of qwZ, hpZ, qgZ (zeropp: a tuple of PARTS) on nodes of node_size
    ranks (ranks node * k + local). With none of them it is ZeRO-3, its bytes split by link."""

    def __init__(self, model, stage=3, zeropp=(), node_size=None, qgz_bits=4, **kwargs):
        rank, N = kwargs.get("rank", 0), kwargs.get("world_size", 1)
        k = node_size or N
        if k < 1 or N % k:
            raise ValueError(f"--node-size {k} does not divide the world size {N}")
        if qgz_bits not in (4, 8):
            raise ValueError(f"--qgz-bits {qgz_bits}: use 4 or 8")
        self.qwz, self.hpz, self.qgz = (p in zeropp for p in PARTS)
        self.node_size, self.nodes, self.qgz_bits = k, N // k, qgz_bits
        self.local_rank = rank % k
        # made once per process, by every rank in the same order (node_groups)
        self.node_group, self.cross_group = node_groups(N, k, rank) if N > 1 else (None, None)
        super().__init__(model, stage, **kwargs)
        self.traffic = LinkTraffic(node_size=k)
        for b in self._every_bucket():
            b.secondary = None  # hpZ's node-local shard, while one exists

    def _every_bucket(self):
        return [b for u in self.all_units for b in u.buckets]

    def _quantized(self, b):
        """qwZ quantizes parameters of the working dtype, not quant.py's buffers."""
        return self.qwz and self.world_size > 1 and b.flat.dtype == self.dtype and \
            all(isinstance(t, torch.nn.Parameter) for t in b.params)

    # -- (2) gather and (5) re-gather ----------------------------------------------------------

    def _launch_gather(self, b):
        if b.secondary is not None:  # (5) hpZ: re-gather inside the node, 16-bit, on the
            # node's group; on one node that is the world: its gather group, then
            group = self.node_group if self.nodes > 1 else self.gather_group
            return all_gather_params(b.flat, b.secondary, self.traffic, self.node_size, group)
        if not self._quantized(b):  # (2) as ZeRO-3 does
            return self._then(super()._launch_gather(b), lambda: self._keep_secondary(b))
        # (2) qwZ: this rank's shard as int8 codes + scales; every rank's, gathered
        rows = pack(b.shard.view(1, -1), 8, QWZ_BLOCK)  # (1, P) int8
        codes = torch.empty(self.world_size, rows.shape[1], dtype=torch.int8, device=self.device)
        extra = rows.numel() + codes.numel()  # int8: bytes, counted as gathered while alive
        self._add_gathered(extra)
        work = all_gather_params(codes.view(-1), rows.view(-1), self.traffic, self.world_size,
                                 self.gather_group)

        def land():  # dequantize every rank's shard into the full buffer, in the working dtype
            S = b.shard.numel()
            b.flat.view(self.world_size, S).copy_(unpack(codes, 8, QWZ_BLOCK, S))
            self._add_gathered(-extra)  # rows and codes go with this closure
            self._keep_secondary(b)
        return self._then(work, land)

    def _then(self, work, land):
        if work is None:  # already done (one rank)
            land()
            return None
        return _Landing(work, land)

    def _keep_secondary(self, b):
        """hpZ: keep this rank's 1/k of the full buffer gathered for a forward that backward
        follows (not the root's: it stays gathered until the end of backward)."""
        if not self.hpz or b.unit.root or not torch.is_grad_enabled() or b.secondary is not None:
            return
        n = b.flat.numel() // self.node_size
        b.secondary = b.flat[self.local_rank * n:(self.local_rank + 1) * n].clone()
        self._add_gathered(b.secondary.numel() * b.secondary.element_size())

    def _drop_secondaries(self):
        for b in self._every_bucket():
            if b.secondary is not None:
                self._add_gathered(-b.secondary.numel() * b.secondary.element_size())
                b.secondary = None

    def _add_gathered(self, nbytes):
        self.gathered_bytes += nbytes
        self.peak_gathered_bytes = max(self.peak_gathered_bytes, self.gathered_bytes)

    def finish_backward(self):
        super().finish_backward()
        self._drop_secondaries()  # the next forward gathers (and keeps) afresh

    @torch.no_grad()
    def publish(self, wait=True):
        super().publish(wait)
        self._drop_secondaries()  # stale after the step (no backward followed a forward)

    # -- (6) reduce-scatter --------------------------------------------------------------------

    def _reduce(self, b):
        if not self.qgz or self.world_size == 1:
            return super()._reduce(b)
        for work, *_ in self.in_flight:  # the hops 1 launched a bucket ago: their hops 2
            work.advance()
        while len(self.in_flight) >= MAX_IN_FLIGHT:
            self._land_one(*self.in_flight.pop(0))
        send = self._grads_to_flat(b)  # the bucket's full gradient, a temporary
        reduced = torch.empty(b.grad_shard.numel(), device=self.device)  # fp32, when landed
        work = self.launch_quantized_reduce_scatter(send, reduced)  # hop 1 on its way
        self.in_flight.append((work, send, reduced, b.grad_shard, b))  # landed as stage 3 lands
        if not b.unit.root:
            self._free([b])  # (6) ...and free, as ZeRO-3 does

    def launch_quantized_reduce_scatter(self, flat, out):
        """qgZ: launch the reduction of `flat` into out, this rank's slice (flat.numel() / N) of
        the mean of every rank's flat; returns its handle (_TwoHops: wait() lands it).
        Hop 1, inside the node: flat seen as (nodes, k, S), local rank j is sent [:, j, :], the
        slices of the ranks (m, j) on every node m, and sums what its k node mates sent.
        Hop 2, across nodes, among the ranks of local rank j: row m of that partial sum goes to
        node m's rank j, which sums the `nodes` rows into its own slice. Each hop moves codes."""
        return _TwoHops(self, flat, out)

    # -- measurement ---------------------------------------------------------------------------

    def weight_bytes(self):
        """ZeRO-3's (the shards and what is gathered now) plus hpZ's second shards."""
        every = self._every_bucket()
        return super().weight_bytes() + sum(b.secondary.numel() * b.secondary.element_size()
                                            for b in every if b.secondary is not None)


def expected_bytes(psi, world_size, node_size, parts=(), qgz_bits=4, dtype_bytes=2,
                   reduce_bytes=None):
    """The paper's volumes per rank per micro-step, in bytes, by link, counted as LinkTraffic
    counts them (a gather: its output; a reduction or an all-to-all: its input), for Ψ = psi
    trainable parameters of dtype_bytes each (the root's skipped re-gather left out):
    {(collective, link): bytes}, link 'intra' or 'inter'."""
    k, nodes = node_size, world_size // node_size
    world = "inter" if nodes > 1 else "intra"
    e, g = dtype_bytes, reduce_bytes or dtype_bytes
    q8 = psi * (1 + 4 / QWZ_BLOCK)  # int8 codes + an fp32 scale per block
    out = {("forward gather", world): q8 if "qwz" in parts else e * psi}
    if "hpz" in parts:  # a node of one rank re-gathers by a local copy
        out[("backward gather", "intra")] = e * psi if k > 1 else 0
    else:
        out[("backward gather", world)] = q8 if "qwz" in parts else e * psi
    if "qgz" in parts:
        code = qgz_bits / 8 + 4 / QGZ_BLOCK  # bytes per gradient element on the wire
        if k > 1:
            out[("gradient all-to-all", "intra")] = psi * code
        if nodes > 1:
            out[("gradient all-to-all", "inter")] = psi / k * code
    else:
        out[("reduce-scatter", world)] = g * psi
    return out


def expected_by_link(psi, world_size, node_size, parts=(), **kwargs):
    """expected_bytes summed by link: {'intra': bytes, 'inter': bytes}."""
    out = {"intra": 0.0, "inter": 0.0}
    for (_, link), nbytes in expected_bytes(psi, world_size, node_size, parts, **kwargs).items():
        out[link] += nbytes
    return out


def link_theory(zero, zeropp, qgz_bits, grad_accum=1):
    """train.py's log: expected_by_link for this run's step (stage 3 and ZeRO++ only; None
    for the other stages, whose 2Ψ all crosses the world group), as our ZeRO-3 sends it: the
    root unit (zero3.py) is gathered once a step, kept across the micro-steps and through
    backward, never re-gathered; a frozen base is gathered with its unit."""
    if zero.stage != 3 or zero.world_size == 1:
        return {"intra": None, "inter": None}
    node_size = zero.traffic.node_size or zero.world_size
    e = torch.tensor([], dtype=zero.dtype).element_size()
    g = torch.tensor([], dtype=zero.reduce_dtype).element_size()
    parts = parse_zeropp(zeropp)
    out = expected_by_link(zero.psi, zero.world_size, node_size, parts, qgz_bits=qgz_bits,
                           dtype_bytes=e, reduce_bytes=g)
    world = "inter" if zero.world_size > node_size else "intra"
    root = 0.0  # the root's bytes, gathered once a step
    for unit in zero.all_units:
        for b in unit.buckets:
            raw = b.numel * b.flat.element_size()
            codes = "qwz" in parts and b.flat.dtype == zero.dtype and \
                all(isinstance(t, torch.nn.Parameter) for t in b.params)
            sent = b.numel * (1 + 4 / QWZ_BLOCK) if codes else raw
            again = ("intra", raw if node_size > 1 else 0) if "hpz" in parts else (world, sent)
            if unit.root:  # out of the micro-steps' count (expected_by_link has its Ψ)
                root += sent
                sign = 0 if b.frozen else -1
            else:  # a block's: expected_by_link has the trainable ones, not a frozen base
                sign = 1 if b.frozen else 0
            out[world] += sign * sent
            out[again[0]] += sign * again[1]  # the backward gather, in its link
    out = {link: v * grad_accum for link, v in out.items()}
    out[world] += root
    return {link: round(v) for link, v in out.items()}


def working_bytes(block_numels, world_size, node_size, dtype_bytes, parts):
    """What ZeRO++ gathers beyond ZeRO-3's root and blocks (memory.py's estimate; held to the
    measured peak by the tests): hpZ's second shards, 1/k of every block's padded buffer, all
    kept at the end of the forward (2Ψ/k in 16 bits); qwZ's code buffers while a gather is in
    flight, this rank's codes and every rank's (N + 1 rows): one block's at a time, as the
    block in use has landed before the next is prefetched. An upper bound: the second shards
    are all there only once the last block's forward is done."""
    N, out = world_size, 0
    padded = [-(-n // N) * N for n in block_numels]
    if "hpz" in parts:
        out += sum(dtype_bytes * n // node_size for n in padded)
    if "qwz" in parts and N > 1 and padded:
        S = max(padded) // N
        row = -(-S // QWZ_BLOCK) * (QWZ_BLOCK + 4)  # int8 codes (padded) + fp32 scales
        out += (N + 1) * row
    return out
