"""Muon under ZeRO (beyond/muon.py): Newton-Schulz gives an orthogonal factor; WholeZeRO's
stages 1-2 hand each rank whole block matrices (dealt whole into its slice of a bucket), so
1 rank and 2 ranks take the same steps (fp32, to 1e-6); k steps + save + resume + k steps ==
2k steps bitwise at stages 0-2, consolidated and sharded, resharded from 2 ranks to 1
(ZeRO-3: tests/test_muon3.py); the model state holds Muon's momentum per matrix and AdamW's
moments for the rest."""
import torch

import checkpoint
from machinery import checked_ckpt
from beyond.muon import deal, newton_schulz
from conftest import make_zero, run_distributed, zero_step
from data.loader import get_batch
from machinery.footprint import estimate
from model import GPTConfig
from precision import GradScaler
from model import GPT
from test_zero import B, DATA, SEED, T
from test_zero import CFG as ZERO_CFG

# no biases: the key bias's gradient is zero but for rounding, and AdamW's normalised step
# turns its last bit into a step of lr either way (tests/test_zero.py's naive test says more)
CFG = dict(ZERO_CFG, bias=False)

LR, STEPS = 1e-2, 6
HEADER = {"config": {"dtype": "fp32", "loss_scale": "none"}, "meta": {"vocab_size": 13},
          "model_args": {}}


def test_newton_schulz_orthogonalises():
    torch.manual_seed(0)
    for shape in ((30, 10), (10, 40)):  # tall and wide
        U, _, V = torch.linalg.svd(torch.randn(shape), full_matrices=False)
        G = U @ torch.diag(torch.logspace(-1.3, 0, min(shape))) @ V  # singular values 0.05-1
        s = torch.linalg.svdvals(newton_schulz(G))
        assert 0.6 < s.min() and s.max() < 1.25, (shape, s)  # all directions about equal


def test_muon_orthogonalises_same_shape_matrices_as_one_stack():
    """MuonAdamW's Newton-Schulz runs on each shape's matrices stacked: 15 batched matmuls for
    4 matrices of one shape, not 60 (one kernel each on a GPU). On a CPU the batched kernel
    loops the same GEMM: weights and momenta equal the per-matrix step bitwise (a GPU's
    batched GEMM may round differently, within the equivalence tests' tolerances)."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from beyond.muon import MuonAdamW
    seen = []

    class Ops(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.append(func.overloadpacket.__name__)
            return func(*args, **(kwargs or {}))

    runs = []
    for stacked in (True, False):
        torch.manual_seed(0)
        mats, vec = [torch.randn(24, 8) for _ in range(4)], torch.randn(8)
        opt = MuonAdamW([{"params": [vec]}, {"params": mats, "matrices": True,
                                            "weight_decay": 0.1}], lr=1e-2)
        for step in range(2):
            for p in mats + [vec]:
                p.grad = torch.randn(p.shape, generator=torch.Generator().manual_seed(step))
            if stacked:
                seen.clear()
                with Ops():
                    opt.step()
                assert seen.count("bmm") == 15 and "mm" not in seen, seen
            else:  # each matrix alone: a group of one
                groups = opt.param_groups
                opt.param_groups = [groups[0]] + [dict(groups[1], params=[m]) for m in mats]
                opt.step()
                opt.param_groups = groups
        runs.append(mats + [opt.state[m]["momentum_buffer"] for m in mats])
    assert all(torch.equal(a, b) for a, b in zip(*runs))


def test_deal_gives_each_rank_whole_tensors_largest_first():
    offsets, numel = deal([4, 4, 3, 1], 2)  # 4 -> rank 0, 4 -> 1, 3 -> 0 (7), 1 -> 1 (5)
    assert (offsets, numel) == ([0, 7, 4, 11], 14)  # slices of 7: rank 1's padded by 2
    assert deal([5, 5, 5], 2) == ([0, 10, 5], 20)  # equal matrices round robin, one of padding
    assert deal([6], 4) == ([0], 24)  # a lone tensor: N times its size


def test_matrix_buckets_launch_during_backward():
    """ZeRO-2 launches each bucket once its gradients are in, buckets in the order they complete:
    Muon's matrix buckets start while backward goes on (they all waited for the embeddings)."""
    model = make_model()
    zero = make_zero(model, 2, bucket_mb=0.002, optimizer="muon")
    arrived, launches, reduce = [0], [], zero._reduce
    for p in model.parameters():  # after the engine's own hook
        p.register_post_accumulate_grad_hook(lambda p: arrived.__setitem__(0, arrived[0] + 1))
    zero._reduce = lambda b: (launches.append(arrived[0]), reduce(b))
    x, y = get_batch(DATA, SEED, 0, 0, 0, 1, B, T, 1)
    zero.backward(model(x, y)[1])
    total = sum(1 for _ in model.parameters())
    assert len(launches) == len(zero.buckets) > 4 and launches[0] <= total // 4, launches


def make_model():
    torch.manual_seed(0)
    return GPT(GPTConfig(**CFG))


def engine(stage, rank, world_size):
    model = make_model()
    return model, make_zero(model, stage, lr=LR, bucket_mb=0.002, rank=rank,
                            world_size=world_size, optimizer="muon")


def train(model, zero, steps, rank, world_size, scaler):
    """Every rank takes its slice of the global batch of 2 x B sequences."""
    for step in steps:
        x, y = get_batch(DATA, SEED, step, 0, rank, world_size, 2 * B // world_size, T, 1)
        zero.backward(model(x, y)[1])
        zero_step(zero, scaler, LR, 1.0)


def _runs(rank, world_size, tmp):
    scaler = GradScaler(init_scale=1.0, dynamic=False)
    out = {}
    for stage in (0, 1, 2):
        model, zero = engine(stage, rank, world_size)
        if stage:  # each rank owns whole block matrices, and Muon's momentum for them only
            mats = [s for s in zero.segments if id(s.param) in zero.matrices]
            assert mats and all(s.whole for s in mats)
            mine = {s.name for s in mats}
            every = [mine] * world_size
            if world_size > 1:
                torch.distributed.all_gather_object(every, mine)
            assert len(set.union(*every)) == sum(map(len, every)) == 2 * 4  # no matrix twice
            held = [b for b in zero.buckets if id(b.params[0]) in zero.matrices]
            assert all(b.numel == sum(p.numel() for p in b.params) for b in held)  # N | L
            assert all(zero.opt.state[s.master]["momentum_buffer"].shape == s.param.shape
                       for s in mats)
        train(model, zero, range(STEPS), rank, world_size, scaler)
        out[stage] = checkpoint.state_dict(zero, model)
        # k + save + resume + k == 2k, bitwise; sharded at stage 1, consolidated else
        model, zero = engine(stage, rank, world_size)
        train(model, zero, range(STEPS // 2), rank, world_size, scaler)
        fmt = "sharded" if stage == 1 else "consolidated"
        path = checked_ckpt.save(f"{tmp}/n{world_size}s{stage}", STEPS // 2, zero, model,
                                 scaler, HEADER, fmt, 1)
        model, zero = engine(stage, rank, world_size)
        checked_ckpt.restore(path, zero, model, scaler, {"optimizer": "muon"}, {}, None)
        train(model, zero, range(STEPS // 2, STEPS), rank, world_size, scaler)
        resumed = checkpoint.state_dict(zero, model)
        if rank == 0:
            for k in out[stage]:
                assert torch.equal(out[stage][k], resumed[k]), (stage, k)
            torch.save(out[stage], f"{tmp}/n{world_size}s{stage}.pt")


def test_muon_one_and_two_ranks_and_an_exact_resume(tmp_path):
    run_distributed(_runs, 2, str(tmp_path))
    run_distributed(_runs, 1, str(tmp_path))
    for stage in (0, 1, 2):
        one, two = (torch.load(tmp_path / f"n{n}s{stage}.pt") for n in (1, 2))
        for k in one:
            torch.testing.assert_close(two[k], one[k], rtol=0, atol=1e-6, msg=(stage, k))
    # resharded: the 2-rank stage-2 checkpoint (whole matrices, padded) on 1 rank, stage 1
    scaler = GradScaler(init_scale=1.0, dynamic=False)
    model, zero = engine(1, 0, 1)
    path = checkpoint.list_checkpoints(tmp_path / "n2s2")[-1]
    checked_ckpt.restore(path, zero, model, scaler, {"optimizer": "muon"}, {}, None)
    train(model, zero, range(STEPS // 2, STEPS), 0, 1, scaler)
    two = torch.load(tmp_path / "n2s2.pt")
    for k, v in checkpoint.state_dict(zero, model).items():
        torch.testing.assert_close(v, two[k], rtol=0, atol=1e-6, msg=k)


def _state(rank, world_size):
    for stage in (0, 1, 2):
        model, zero = engine(stage, rank, world_size)
        est = estimate(GPTConfig(**CFG), world_size, stage, "fp32", bucket_mb=0.002, rank=rank,
                       optimizer="muon")
        assert zero.state_bytes() == est["state"], (stage, zero.state_bytes(), est["state"])


def test_memory_py_counts_muons_state():
    """Muon keeps a momentum (4 bytes) per block-matrix element, AdamW its two moments (8) per
    element of the rest: memory.py's estimate equals what the engine holds, padding and all,
    at stages 0-2 on 2 ranks."""
    run_distributed(_state, 2)
