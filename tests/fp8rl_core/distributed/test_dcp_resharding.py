"""DCP checkpoints of an FSDP2-sharded trainer in real gloo processes: saved at world size 2 mid-run,
loaded at 2 (the next step bit-identical to the uninterrupted run), at 1 (plain module, no process
group) and at 4 (resharded): the loaded model and AdamW state equal the saved ones exactly."""
import socket
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

from fp8rl_core.io import checkpoint as ck
from fp8rl_core.model import build_model, preset

ROWS, SAVE_AT = 4, 2  # global batch rows (split evenly over 1, 2 or 4 ranks); checkpoint after this step


class _Engine:
    """What EngineState needs of a training engine: model, optimizer, step."""

    def __init__(self, seed: int, world: int) -> None:
        torch.manual_seed(seed)
        self.model = build_model(preset("tiny", num_hidden_layers=2, intermediate_size=256))
        if world > 1:  # as fp8rl_core/distributed/parallel.py shards the policy: each block, then the root
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.fsdp import fully_shard

            mesh = init_device_mesh("cpu", (world,))
            for layer in self.model.model.layers:
                fully_shard(layer, mesh=mesh)
            fully_shard(self.model, mesh=mesh)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-3, weight_decay=0.01)
        self.step = 0

    def train_step(self, rank: int, world: int) -> None:
        """Step self.step + 1 on this rank's rows of a fixed global batch; FSDP averages the per-rank
        means of equal shares, which is the global mean."""
        ids = torch.randint(0, 32, (ROWS, 6), generator=torch.Generator().manual_seed(100 + self.step))
        share = ids[rank * ROWS // world:(rank + 1) * ROWS // world]
        logp = torch.log_softmax(self.model(share).float(), -1)
        (-logp[:, :-1].gather(-1, share[:, 1:, None]).mean()).backward()
        self.optimizer.step()
        self.optimizer.zero_grad()
        self.step += 1


def _full_state(eng: _Engine) -> dict[str, torch.Tensor]:
    """Flat {key: full tensor} of model + AdamW state (collective; complete on rank 0); copies, since
    an unsharded module hands out its live parameters."""
    model_sd, optim_sd = get_state_dict(eng.model, eng.optimizer,
                                        options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    flat = {f"model.{k}": v.clone() for k, v in model_sd.items()}
    for fqn, st in optim_sd.get("state", {}).items():  # empty off rank 0 (cpu_offload)
        flat.update({f"optim.{fqn}.{k}": v.clone() for k, v in st.items()})
    return flat


def _worker(rank: int, world: int, port: int, root: str, phase: str, out: str) -> None:
    torch.set_num_threads(1)
    if world > 1:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        _phase(rank, world, Path(root), phase, Path(out))
        if world > 1:  # meet before tearing gloo down, as fp8rl_core.distributed.shutdown does
            dist.barrier()
    finally:
        if world > 1:
            dist.destroy_process_group()


def _phase(rank: int, world: int, root: Path, phase: str, out: Path) -> None:
    gen = torch.Generator().manual_seed(1000 + rank)  # stands for a rank's sampler stream
    if phase == "save":
        eng = _Engine(seed=0, world=world)
        for _ in range(SAVE_AT):
            eng.train_step(rank, world)
        ck.save_checkpoint(root, SAVE_AT, {ck.TRAIN_KEY: ck.EngineState(eng)},
                           {"rank": rank, "gen": gen.get_state()}, meta={"cell_id": "t"})
        saved = _full_state(eng)
    else:  # resume: other initial weights, an optimizer that never stepped
        eng = _Engine(seed=1, world=world)
        meta = ck.load_checkpoint(ck.latest_checkpoint(root), {ck.TRAIN_KEY: ck.EngineState(eng)})
        assert meta["world_size"] == 2 and eng.step == SAVE_AT
        own = ck.read_rank_state(ck.latest_checkpoint(root))
        if rank < 2:
            assert own["rank"] == rank and torch.equal(own["gen"], gen.get_state())
        else:
            assert own is None  # a rank the saving run did not have
        saved = _full_state(eng)
    eng.train_step(rank, world)
    after = _full_state(eng)
    if rank == 0:
        torch.save({"at_save": saved, "next": after}, out / f"{phase}_{world}.pt")


def _spawn(world: int, root: Path, phase: str, out: Path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_worker, args=(world, port, str(root), phase, str(out)), nprocs=world, join=True)


def _equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.slow
def test_save_at_2_resume_at_1_2_and_4(tmp_path):
    root = tmp_path / "ckpt"
    _spawn(2, root, "save", tmp_path)
    assert sorted(p.name for p in ck.latest_checkpoint(root).iterdir() if p.suffix == ".pt") == \
        ["rank_00000.pt", "rank_00001.pt"]
    _spawn(2, root, "resume", tmp_path)
    _spawn(4, root, "resume", tmp_path)
    _worker(0, 1, 0, str(root), "resume", str(tmp_path))  # world size 1: this process, no process group
    straight = torch.load(tmp_path / "save_2.pt", weights_only=True)
    for world in (1, 2, 4):
        got = torch.load(tmp_path / f"resume_{world}.pt", weights_only=True)
        assert _equal(got["at_save"], straight["at_save"]), f"world size {world}: loaded state differs"
    assert _equal(torch.load(tmp_path / "resume_2.pt", weights_only=True)["next"], straight["next"])
    for world in (1, 4):  # another reduction order: equal within FP32 rounding, and different from the saved step
        nxt = torch.load(tmp_path / f"resume_{world}.pt", weights_only=True)["next"]
        for k, v in straight["next"].items():
            torch.testing.assert_close(nxt[k], v, rtol=1e-4, atol=1e-6, msg=lambda m, k=k, w=world: f"{w}: {k}: {m}")
        assert not _equal(nxt, straight["at_save"])
