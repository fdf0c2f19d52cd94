"""
A loop of one's own, guarded: the engine a forker imports (machinery/engines.py) is the lecture's
engine with this layer over it, composed as beyond/offload_optimizer.py composes offload.

The lecture's engine (zero.py, zero3.py) expects train.py's loop. A loop of one's own may call it
in any order plain PyTorch allows: model.zero_grad() anywhere, two backwards before a step, a
step without finish_backward(), torch's clip_grad_norm_ on p.grad. Here the engine knows where
the step is (its phase) and, at each entry point (the gradient hooks, the model's forward,
finish_backward, the step's calls, zero_grad), does what plain PyTorch means on one process or
refuses in one line. The phase follows from the loop's calls alone: every rank decides alike,
none waits in a collective the others skip. docs/forking.md's table is what each misuse means,
stage by stage (tests/test_misuse.py).

Also here, checked before the engine is built: the model (ranks that built other weights, a
persistent buffer the engine would shard, no trainable parameter), the optimizer (one that
reads tensors whole, which zero.ZeRO would hand flat pieces), a list of parameters for a module.
"""
import sys

import torch
from torch._subclasses.fake_tensor import is_fake
from torch.utils._pytree import tree_leaves

import optim
from collectives import all_gather_list, all_reduce_max, broadcast
from machinery import hangs
from zero import frozen_tensors
from zero3 import ZeRO3, before_backward

STEPPED = "stepped"    # no gradient since the last step() or zero_grad() (or the start)
BACKWARD = "backward"  # a backward's gradients arrive and are reduced; not all landed yet
LOCAL = "local"        # gradients accumulated on this rank only (no_sync at stages 0-1)
FINISHED = "finished"  # every gradient reduced and landed: step() may run


# ----------------------------------------------------------------------------------------------
# before the engine is built

# optimizers whose step treats every element alone: flat pieces of buckets step as the whole
# (any other, Adafactor say, needs beyond/muon.py's WholeZeRO)
ELEMENTWISE = (torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD, torch.optim.Adagrad,
               torch.optim.RMSprop, torch.optim.Adamax, torch.optim.NAdam, torch.optim.RAdam,
               torch.optim.Adadelta, torch.optim.Rprop, torch.optim.ASGD)


def elementwise(optimizer):
    """Whether the optimizer's step treats every element alone, so that zero.py may hand it flat
    pieces: our names but Muon, torch's elementwise classes, a class that says so (`elementwise
    = True`, as beyond/lion.py's Lion), a partial's class too. A function of the groups is taken
    as elementwise: nothing more can be known of it."""
    if isinstance(optimizer, str):
        return optimizer != "muon"
    cls = getattr(optimizer, "func", optimizer)  # functools.partial(torch.optim.SGD, ...)
    return not isinstance(cls, type) or issubclass(cls, ELEMENTWISE) or \
        getattr(cls, "elementwise", False)


@torch.no_grad()
def check_same_weights(tensors, world_size, group=None):
    """Every rank must start from the same weights: ZeRO would otherwise mix them, shard by
    shard. One all-gather of each tensor's sum and sum of squares (float64); a mismatch is one
    line, on every rank. A fake tensor (memory.py --measure) has a shape and no values: skipped."""
    if world_size == 1 or not tensors or is_fake(tensors[0]):
        return
    mine = torch.stack([torch.stack([t.double().sum(), t.double().square().sum()])
                        for t in tensors]).reshape(-1)
    every = all_gather_list([torch.empty_like(mine) for _ in range(world_size)], mine,
                            world_size, group, label="same weights")
    bad = [r for r, theirs in enumerate(every) if not torch.equal(theirs, every[0])]
    if bad:
        raise ValueError(f"rank {bad[0]} holds other initial weights than rank 0: build the "
                         "model alike on every rank (the same torch.manual_seed before it)")


@torch.no_grad()
def broadcast_weights(tensors, src, world_size, group=None):
    """Rank src's values into every rank's tensors, as DDP does when it wraps a model: ranks
    that built their weights apart (another seed each) then start from one model."""
    if world_size == 1:
        return
    for t in tensors:
        buf = t.detach().contiguous()  # t itself when contiguous
        broadcast(buf, src, world_size, group, label="broadcast weights")
        if buf.data_ptr() != t.data_ptr():
            t.detach().copy_(buf)


def check_buffers(model):
    """A persistent buffer of a module whose buffers are not a weight (zero.frozen_tensors'
    BUFFERS_ARE_STATE) would be cast with the model, and left out of the shards and the
    checkpoints in silence: one line says what to do instead."""
    for name, m in model.named_modules():
        if getattr(m, "BUFFERS_ARE_STATE", False):
            continue
        for key, b in m._buffers.items():
            if b is not None and key not in m._non_persistent_buffers_set:
                raise ValueError(f"{name}.{key} is a persistent buffer: ZeRO would shard, cast "
                                 "and checkpoint it as model state. Register it with "
                                 "persistent=False if it is recomputed, or make it a frozen "
                                 "nn.Parameter")


class Params(torch.nn.Module):
    """A list of parameters as a module, for ZeRO(model.parameters(), ...) as torch's
    ZeroRedundancyOptimizer(params, ...) takes them (names "0", "1", ...). Nothing calls its
    forward, so the engine cannot wait for new weights there: step() publishes them at once."""

    def __init__(self, params):
        super().__init__()
        params = list(params)
        if not all(isinstance(p, torch.nn.Parameter) for p in params):
            raise ValueError("ZeRO takes a module or its nn.Parameters (model.parameters()); "
                             "param group dicts: pass decay= and the optimizer's own settings")
        for i, p in enumerate(params):
            self.register_parameter(str(i), p)


# ----------------------------------------------------------------------------------------------
# what p.grad is while the engine holds the gradient

class HeldGrad(torch.Tensor):
    """p.grad while the engine holds p's gradient where p.grad cannot be a view of it (stages
    2-3: this rank's shard of the sum; fp32 accumulation: the fp32 bucket). p's shape, no
    storage, and any use is one line. Were p.grad None instead, a loop that scales it, or
    torch.nn.utils.clip_grad_norm_, would find nothing there and silently do nothing.
    model.zero_grad() sets it to None: the engine sees that the loop cleared the gradient.
    From step() (zero_grad()) to the next backward the engine holds none: p.grad is None."""

    @staticmethod
    def __new__(cls, p, name):
        held = torch.Tensor._make_wrapper_subclass(cls, p.shape, dtype=p.dtype, device=p.device)
        held.param_name = name
        return held

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        held = [a for a in tree_leaves((args, kwargs)) if isinstance(a, HeldGrad)]  # out= too
        raise touched(f"{held[0].param_name}.grad", "read or changed")

    def __repr__(self):
        return f"HeldGrad({self.param_name}: held by ZeRO until step())"


def touched(what, how):
    """The one line for a gradient the loop changed while the engine held it."""
    return RuntimeError(f"{what} was {how} after loss.backward(): from backward to step() the "
                        "engine holds the gradients (stages 2-3: a shard of each). Clip with "
                        "zero.clip_grad_norm_(max_norm); change gradients in place through "
                        "zero.master_grads(), this rank's fp32 pieces")


def compiled_whole():
    raise RuntimeError("torch.compile(model) traces the engine's forward hooks (gathers, waits "
                       "for new weights): compile each block's forward instead, before or after "
                       "the engine (for block in model.blocks(): block.forward = "
                       "torch.compile(block.forward))")


def surgery(before, now):
    """The first change between two lists of (name, id) of a model's parameters, in words."""
    was, names = dict(before), dict(now)
    for name, i in now:
        if name not in was:
            return f"{name} was added"
        if was[name] != i:
            return f"{name} was replaced"
    gone = [name for name, _ in before if name not in names]
    return f"{gone[0]} was removed" if gone else "the parameters were reordered"


# ----------------------------------------------------------------------------------------------
# the layer

UNUSED = ("zero", "skip")  # a parameter no rank used this step: stepped with zeros (DDP), or not


class Guard:
    """Put before an engine class (guarded() does): its entry points keep the phase."""
    STAGE3 = "machinery.engines.ZeRO3"  # what ZeRO(model, 3) is asked to build instead
    WHOLE = False  # the engine deals whole tensors to the ranks (beyond/muon.py's WholeZeRO)

    def __init__(self, model, stage, optimizer="adamw", broadcast_from=None,
                 master_weights=None, unused="zero", **kwargs):
        if not hangs.installed():  # a loop of one's own: its hangs named, a clean exit
            hangs.install()
        if unused not in UNUSED:
            raise ValueError(f"unused={unused!r}: one of {', '.join(map(repr, UNUSED))}")
        if stage not in self.STAGES:
            also = f": stage 3 shards the weights too, {self.STAGE3} (the same arguments)" \
                if stage == 3 else ""
            raise ValueError(f"{type(self).__name__} runs ZeRO stages {self.STAGES}, not "
                             f"{stage}{also}")
        self.publish_in_step = not isinstance(model, torch.nn.Module)  # no forward waits
        model = model if isinstance(model, torch.nn.Module) else Params(model)
        self.check_optimizer(optimizer, stage)
        named = [p for p in model.parameters() if p.requires_grad]
        if not named:
            raise ValueError("the model has no trainable parameters")
        check_buffers(model)
        world_size, group = kwargs.get("world_size", 1), kwargs.get("group")
        frozen = frozen_tensors(model)
        if broadcast_from is not None:  # rank broadcast_from's weights, for every rank
            broadcast_weights(named + frozen, broadcast_from, world_size, group)
            if master_weights is not None:
                broadcast_weights([master_weights[k] for k in sorted(master_weights)],
                                  broadcast_from, world_size, group)
        else:
            check_same_weights(named + frozen, world_size, group)
        super().__init__(model, stage, optimizer=optimizer, master_weights=master_weights,
                         **kwargs)
        self.phase, self.fresh = STEPPED, True
        self.unpublished = False  # a step's new weights not yet published
        self.arrived = set()  # ids of the parameters whose gradient arrived in this backward
        # what p.grad is while the engine holds the gradient: its view into the bucket (stages
        # 0-1, set by zero.py's _new_bucket), or a HeldGrad
        self.held = {id(p): p.grad if self._viewed(b) else HeldGrad(p, self.names[id(p)])
                     for b in self.buckets for p in b.params}
        self.pieces = {}  # id(p) -> the segments of p this rank owns
        for s in self.segments:
            self.pieces.setdefault(id(s.param), []).append(s)
        for b in self.buckets:
            b.carry = None  # stage 1, a second backward before a step: the first's reduced slice
            b.version = 0  # stages 0-1: flat_grad's version when the engine last wrote it
        model.register_forward_pre_hook(lambda m, args: self._before_forward(), prepend=True)
        for b in self.buckets:
            for p in b.params:
                p.register_hook(lambda grad, p=p: self._grad_arriving(p))
        # what the engine packed, held to the model at each step and each state_dict() (a save)
        self.model, self.built = model, [(n, id(p)) for n, p in model.named_parameters()]
        self.frozen_at_build = [p for p in model.parameters() if not p.requires_grad]
        self.packed = [p for b in self.buckets for p in b.params]
        model.register_state_dict_pre_hook(lambda m, prefix, keep_vars: self.check_model())
        self.unused, self.touched = unused, set()  # ids of the parameters with a gradient
        self.owed = False  # zero.step() is stepping the optimizer
        self.opt.register_step_pre_hook(self._optimizer_step)

    @property
    def optimizer(self):
        """The torch optimizer over this rank's fp32 master pieces, for what a torch user hands
        it to (a scheduler: StepLR(zero.optimizer, ...)) and its param_groups. zero.step()
        steps it; zero.optimizer_name is its name."""
        return self.opt

    def check_optimizer(self, optimizer, stage):
        """zero.ZeRO hands the optimizer flat 1-D pieces of buckets, one group for all matrices:
        an optimizer whose step reads a tensor whole (Muon orthogonalises each matrix, Adafactor
        factors its statistics) would silently step the wrong thing. One line instead."""
        if elementwise(optimizer) or self.WHOLE:
            return
        name = optimizer if isinstance(optimizer, str) else \
            getattr(getattr(optimizer, "func", optimizer), "__name__", "custom")
        if stage == 3:
            raise ValueError(f"{name} steps each tensor whole, and ZeRO-3 shards every tensor "
                             "over the ranks: use machinery.engines.WholeZeRO3, which deals "
                             "whole tensors")
        raise ValueError(f"{name} steps each tensor whole, and zero.ZeRO steps flat pieces of "
                         "buckets: use machinery.engines.WholeZeRO, which deals whole tensors")

    def make_optimizer(self, optimizer, groups, lr=None, betas=(0.9, 0.95), **hyper):
        """Our names of optimizers from after the lecture too: "lion" (beyond/lion.py)."""
        if optimizer == "lion":
            from beyond.lion import Lion
            return Lion(groups, lr=optim.LR if lr is None else lr, betas=betas)
        return super().make_optimizer(optimizer, groups, lr=lr, betas=betas, **hyper)

    def _viewed(self, b):  # stages 0-1 (no fp32 accumulation): p.grad views into the bucket
        return b.flat_grad is not None and b.flat_grad.dtype == self.dtype

    # -- the entry points --------------------------------------------------------------------

    def _before_forward(self):
        """The model's forward pre-hook. A backward the loop did not finish ends where the next
        forward begins (ZeRO-3 frees what it gathered); the new weights are published."""
        if self.stage and torch.compiler.is_compiling():  # torch.compile(model) traces this
            # a function dynamo may not trace runs as it is, after a graph break: the line
            sys.modules["torch._dynamo"].disable(compiled_whole)()  # loaded: it is tracing
        if self.phase == BACKWARD:
            self.finish_backward()
        if self.unpublished:
            self.publish(wait=False)

    def _grad_arriving(self, p):
        """Autograd's hook just before p's gradient is added into p.grad; the first of a
        backward begins it. A p.grad the loop changed since the engine left it (None after
        model.zero_grad(), or a tensor put there) is the loop's gradient so far, as plain
        PyTorch reads it: the engine's copy takes its value (_take)."""
        if not self.arrived or id(p) in self.arrived:  # p again: a new backward, no finish
            self._begin_backward()
        self.arrived.add(id(p))
        held = self.held[id(p)]
        if p.grad is not held:
            self._take(p)
        elif isinstance(held, HeldGrad):
            p.grad = None  # the sum so far stays where the engine holds it; autograd adds anew
        self.touched.add(id(p))

    def _grad_ready(self, p):
        held = self.held[id(p)]
        if self._viewed(self.where[id(p)][0]) and p.grad is not held:
            # autograd replaced the view (create_graph=True adds out of place): stages 0-1
            # reduce the bucket, not p.grad, so it is copied in, as DDP's reducer does
            held.copy_(p.grad)
            p.grad = held
        super()._grad_ready(p)
        if p.grad is None:  # fp32 accumulation took it in
            p.grad = held

    def _grads_to_flat(self, b):
        for p in b.params:  # a HeldGrad: nothing new arrived for p in this backward
            if isinstance(p.grad, HeldGrad):
                p.grad = None
        flat = super()._grads_to_flat(b)
        for p in b.params:
            p.grad = self.held[id(p)]
        return flat

    def _reduce(self, b):
        super()._reduce(b)
        if self._viewed(b):  # from here the loop must not change it: _check_held
            b.version = b.flat_grad._version

    def _land_one(self, work, send, reduced, into, b):
        self._check_held(b)  # the loop changed nothing the collective was reducing
        super()._land_one(work, send, reduced, into, b)
        if b.carry is not None:  # stage 1: the backwards before this one, reduced then
            b.flat_grad[b.lo:b.hi] += b.carry
            b.carry = None
        if self._viewed(b):
            b.version = b.flat_grad._version

    def _begin_backward(self):
        """A backward begins, before any of its gradients is added in."""
        if self.phase == BACKWARD:  # the last one was not finished: it is, before this one
            self.finish_backward()
        if self.prepared:
            raise RuntimeError("a backward after master_grads() or clip_grad_norm_() and before "
                               "step(): its gradient would miss the unscale and the clip already "
                               "applied. Call step() first, or run every backward before them")
        if self.phase == FINISHED and self.stage == 1:
            self._carry()
        self.fresh = self.phase == STEPPED  # every gradient buffer is zero
        self.phase = BACKWARD if self.sync else LOCAL
        self.arrived.clear()

    def finish_backward(self):
        """Once a backward: again, it does nothing. A loop may leave it to step() or to the next
        forward. A parameter unused in this backward keeps what p.grad holds, or zero."""
        active = self.phase == BACKWARD or (self.phase == LOCAL and self.sync)
        if active:
            for b in self.buckets[self.next_bucket:]:  # buckets with unused parameters
                for p in b.params:
                    if id(p) not in self.arrived and p.grad is not self.held[id(p)]:
                        self._take(p)
                        if p.grad is None:
                            p.grad = self.held[id(p)]
        else:
            self.next_bucket = len(self.buckets)  # nothing of this backward left to launch
        super().finish_backward()
        if active:
            self.phase = FINISHED
        self.arrived.clear()

    def master_grads(self):
        self._to_step()
        if not self.prepared:
            for b in self.buckets:
                self._check_held(b, stepping=True)
        return super().master_grads()

    def step(self, lr=None, found_inf=None):
        self.check_model()
        self.master_grads()  # the backward finished, the master gradients prepared
        skipped = self._skipped()
        for s in self.segments:
            if id(s.param) in skipped:
                s.master.grad = None  # torch's optimizers step no tensor without a gradient
        self.owed = True
        try:
            super().step(lr, found_inf)
        finally:  # unless the delayed update's thread steps it (beyond/offload_optimizer.py)
            if getattr(self, "pending", None) is None:
                self.owed = False
        self.unpublished = True  # publish() runs before the next forward, if nothing else did
        if self.publish_in_step:  # parameters, not a module: no forward will wait for them
            self.publish()

    def publish(self, wait=True):
        self.unpublished = False
        super().publish(wait)

    def wait_published(self, indices=None):
        if self.unpublished:  # a step whose weights nobody published yet
            self.publish(wait=False)
        super().wait_published(indices)

    def zero_grad(self):
        """The next backward starts from zero, and a step() finds no gradient until then. A
        backward still reducing is landed first."""
        if self.phase == BACKWARD:
            self.finish_backward()
        super().zero_grad()
        self.touched.clear()
        for b in self.buckets:
            b.carry = None
            for p in b.params:  # no gradient held: None, as torch's zero_grad() leaves it
                if isinstance(p.grad, HeldGrad):  # (model.zero_grad(set_to_none=False) too)
                    p.grad = None
        self.phase = STEPPED

    # -- what the entry points do ------------------------------------------------------------

    def _skipped(self):
        """The ids of the parameters step() leaves alone, their weight and optimizer state as
        they are: those frozen since the engine was built (requires_grad_(False): plain
        PyTorch's gradient is then None), and with unused="skip" those no rank had a gradient
        for since the last step (used on one rank, a parameter's reduced gradient is real).
        Each rank's flags, one all-reduce MAX: every rank skips alike."""
        skip = [not p.requires_grad for p in self.packed]
        if self.unused == "skip":
            used = torch.tensor([id(p) in self.touched for p in self.packed],
                                dtype=torch.float32, device=self.device)
            used = all_reduce_max(used, self.world_size, self.group, label="used").tolist()
            skip = [s or not u for s, u in zip(skip, used)]
        return {id(p) for p, s in zip(self.packed, skip) if s}

    def check_model(self):
        """The model's parameters as the engine packed them, or one line: replaced (a module
        swapped for a fresh one would train a dead tensor, and a save would write its master
        under the live name), added (never stepped, never saved), removed, or a frozen one made
        trainable (no master, no state). A parameter frozen since is honoured: _skipped."""
        now = [(n, id(p)) for n, p in self.model.named_parameters()]
        what = surgery(self.built, now) if now != self.built else None
        if what is None:
            what = next((f"{self.names[id(p)]} was made trainable" for p in self.frozen_at_build
                         if p.requires_grad), None)
        if what is not None:
            raise RuntimeError(f"{what} after the engine was built: the engine packs the "
                               "model's trainable parameters once, when it is built. Change the "
                               "model first, then build the engine (mid-run: take checkpoint."
                               "state_dict(zero, model) before the change, load it into a new "
                               "model, change that one and build its engine with broadcast_from"
                               "=0: the optimizer state starts anew)")

    def _optimizer_step(self, optimizer, args, kwargs):
        """The torch optimizer's step pre-hook: only zero.step() steps it. Called by the loop
        instead, it would step masters whose gradients are not prepared, and publish nothing."""
        if not self.owed:
            raise RuntimeError("zero.optimizer.step() outside zero.step(): call zero.step(), "
                               "which prepares the master gradients, steps the optimizer and "
                               "publishes the weights (a scheduler on zero.optimizer holds)")
        self.owed = False

    def _carry(self):
        """Stage 1, a backward after a finished one, before one step: the owned slice holds the
        reduced sum so far, the rest of the bucket this rank's part of it, already reduced into
        the others' slices. The sum is carried aside and the bucket zeroed; the next landing
        adds it back: the sum of both backwards, as plain PyTorch accumulates them."""
        for b in self.buckets:
            if self._viewed(b) and b.flat_grad._version != b.version:  # mixed: not one value
                raise touched(self._bucket_grads(b), "changed in place")
            b.carry = b.flat_grad[b.lo:b.hi].clone()
            b.flat_grad.zero_()

    def _take(self, p):
        """p.grad is not what the engine left there: it is the loop's gradient so far (None:
        zero). The engine's copy is cleared; the bucket's view takes p.grad's value (stages
        0-1), or p.grad carries it into this backward's reduction (stages 2-3)."""
        if not self.fresh:
            self._clear(p)
        if p.grad is not None:  # the loop's gradient so far
            self.touched.add(id(p))
        held, (b, offset) = self.held[id(p)], self.where[id(p)]
        if isinstance(held, HeldGrad):
            if b.flat_grad is not None and p.grad is not None:  # fp32 accumulation: in now
                b.flat_grad[offset:offset + p.numel()].copy_(p.grad.reshape(-1))
                p.grad = None
            return
        if p.grad is not None:
            if self.stage == 1 and not self.fresh:  # it was the view: partly reduced, partly not
                raise touched(f"{self.names[id(p)]}.grad", "replaced")
            held.copy_(p.grad)
        p.grad = held

    def _clear(self, p):
        """Zero p's gradient so far as this rank holds it: its region of the bucket (stages
        0-1), its owned pieces of the reduced shard (stages 2-3) or of stage 1's carry."""
        self.touched.discard(id(p))
        b, offset = self.where[id(p)]
        if b.flat_grad is not None:
            b.flat_grad[offset:offset + p.numel()].zero_()
        for buf in (b.grad_shard, b.carry):
            for s in self.pieces.get(id(p), []) if buf is not None else []:
                buf[s.start:s.start + s.hi - s.lo].zero_()

    def _check_held(self, b, stepping=False):
        """Bucket b's gradients as the engine left them: each p.grad its view (not changed in
        place) or its HeldGrad. A gradient the loop changed after its reduction began cannot
        mean what the loop meant: one line. None is the loop clearing it (model.zero_grad()):
        the next backward starts from zero there; step() refuses it, having no gradient."""
        if self._viewed(b) and b.flat_grad._version != b.version:
            raise touched(self._bucket_grads(b), "changed in place (as torch.nn.utils."
                                                 "clip_grad_norm_ does)")
        for p in b.params:
            if p.grad is None and stepping:
                raise RuntimeError(f"{self.names[id(p)]}.grad is None at step(): a zero_grad() "
                                   "after loss.backward() left the step no gradient. Zero "
                                   "gradients after step(), or before the next backward")
            if p.grad is not None and p.grad is not self.held[id(p)]:
                raise touched(f"{self.names[id(p)]}.grad", "replaced")

    def _bucket_grads(self, b):
        names = [self.names[id(p)] for p in b.params]
        return f"{names[0]}.grad" if len(names) == 1 else \
            f"a gradient in {names[0]}'s bucket of {len(names)}"

    def _to_step(self):
        """The step's half begins (master_grads, clip_grad_norm_, step). A backward not finished
        is finished here, and gradients no_sync kept local are reduced now: plain PyTorch's
        step needs neither call. With no gradient since the last step, one line."""
        if self.phase == STEPPED:
            raise RuntimeError("step() with no gradient since the last step() or zero_grad(): "
                               "run loss.backward() first (the engine zeroed the gradient "
                               "that plain PyTorch would step again)")
        if self.phase != FINISHED:
            self.sync = True  # no_sync around the last micro-step too: the sync happens here
            self.finish_backward()


class Guard3(Guard):
    """ZeRO-3's: the weights are gathered in the model's forward hooks, freed after backward."""

    def __init__(self, model, stage=3, **kwargs):
        if not isinstance(model, torch.nn.Module) or isinstance(model, Params):
            raise ValueError("ZeRO-3 gathers the weights in the model's forward hooks: pass the "
                             "model, not its parameters")
        if type(model).__name__ == "OptimizedModule":  # torch.compile(model)
            raise ValueError("ZeRO-3 gathers each block in the model's forward hooks, which a "
                             "model compiled whole would trace: pass the model itself, and "
                             "compile each block's forward instead (for block in model.blocks()"
                             ": block.forward = torch.compile(block.forward))")
        if not callable(getattr(model, "blocks", None)):
            raise ValueError(f"ZeRO-3 gathers the model a block at a time: declare "
                             f"{type(model).__name__}.blocks(), its repeated layers in forward "
                             "order (see model.py's GPT), or use stage 0-2")
        super().__init__(model, stage, **kwargs)
        self.began = set()  # the units whose backward began in this backward
        # the root's backward begins where the gradients of what the model returns arrive
        model.register_forward_hook(
            lambda m, args, out: before_backward(out, lambda: self._pre_unit_backward(None)))

    def _pre_backward(self, i):
        self._pre_unit_backward(i)
        super()._pre_backward(i)

    def _pre_unit_backward(self, i):
        """Unit i's backward begins (None: the root's), its weights about to be read. Twice in
        one backward cannot be: this is a second backward through a graph the last one went
        through (loss.backward(retain_graph=True) and another loss, or two forwards and then a
        backward each). The last is finished here, its reductions landed and its units freed,
        and this one gathers again each unit it reaches: the gradients add up, as on one
        process, for one more gather of those units."""
        if i in self.began:
            self.finish_backward()
        self.began.add(i)
        if i is None:
            self._gather(self.root)  # the root: kept from the forward, unless that finish freed it

    def finish_backward(self):
        super().finish_backward()
        self.began.clear()

    def _begin_backward(self):
        """A second backward that reached the weights without passing through what the model or
        a block returns (a tensor kept aside on a module) finds them freed. One line."""
        if self.phase == BACKWARD:
            raise RuntimeError("a second backward reached the weights by a tensor that the model "
                               "and its blocks do not return: ZeRO-3 gathers a unit again where "
                               "the gradients of its outputs arrive. Return it from forward(), "
                               "or sum the losses and call backward once")
        super()._begin_backward()

    def _to_step(self):
        """No micro-step follows, so a root kept gathered for one (no_sync() around the last
        micro-step too) is freed now, whichever engine then steps and publishes: its weights
        change."""
        super()._to_step()
        self._free(self.root.buckets)


_GUARDED = {}


def guarded(Engine):
    """Engine with the guard over it, made once per class (machinery/engines.py's)."""
    if Engine not in _GUARDED:
        layer = Guard3 if issubclass(Engine, ZeRO3) else Guard
        whole = getattr(Engine, "WHOLE", False)  # the layout's own (beyond/muon.py)
        _GUARDED[Engine] = type(Engine.__name__, (layer, Engine), {
            "__module__": "machinery.engines", "WHOLE": whole,
            "STAGE3": f"machinery.engines.{'WholeZeRO3' if whole else 'ZeRO3'}"})
    return _GUARDED[Engine]
